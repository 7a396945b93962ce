"""The warm-cache manifest: what a warmup did, written atomically, and the warm/cold verdict.

Layout under SM70_CACHE_DIR:
    <fingerprint>/manifest.json      written last (atomically); its `warm` flag is the verdict
    <fingerprint>/vllm, triton, inductor, kernels   the compile caches
    .warmup.lock                     one warmup at a time
An entry without a manifest is a warmup in progress (or one killed outright) and counts
as cold; see sm70ctl/warmup/runner.py for why entries are built in place.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error
from sm70ctl.readers import View, read_json
from sm70ctl.runtime.compile_cache import CACHE_SUBDIRS
from sm70ctl.runtime.fingerprint import diff_components

MANIFEST = "manifest.json"

DONE, SKIPPED, FAILED, NOT_NEEDED = "done", "skipped", "failed", "not needed"


@dataclass
class Step:
    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


STATUSES = (DONE, SKIPPED, FAILED, NOT_NEEDED)
DEVICES = ("cuda", "cpu")
# A manifest holds a few dozen components and three steps; the bound only keeps a stray
# huge file in the cache folder from being read into memory.
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
_KEYS = ("fingerprint", "components", "device", "steps", "warm", "created", "version",
         "inventory")


@dataclass
class Manifest:
    fingerprint: str
    components: dict[str, str]
    device: str
    steps: list[Step] = field(default_factory=list)
    warm: bool = False
    created: float = field(default_factory=time.time)
    version: int = 1
    # cache sub-folder -> {"files": n, "bytes": b} when the manifest was written
    inventory: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, name: str = MANIFEST) -> Manifest:
        """A manifest as warmup writes it, else Sm70Error naming the field: a manifest
        with garbage steps or a `warm` flag its steps contradict is damaged, not warm."""
        doc = View(data, what="warmup manifest", name=name).table().only(_KEYS)
        version = doc.get_int("version", 1)
        if version != 1:
            doc.fail(f"version {version} is not one this sm70ctl reads (1)", "version")
        steps = []
        for item in doc.tables("steps", []):
            item.only(("name", "status", "detail", "seconds"))
            status = item.get_str("status")
            if status not in STATUSES:
                item.fail(f"{status!r} is not one of {', '.join(STATUSES)}", "status")
            steps.append(Step(name=item.get_str("name", nonempty=True, max_len=64),
                              status=status, detail=item.get_str("detail", ""),
                              seconds=item.get_float("seconds", 0.0, min=0.0)))
        warm = doc.get_bool("warm", False)  # "false" must not read as warm
        if warm and not (steps and all(s.status in (DONE, NOT_NEEDED) for s in steps)):
            doc.fail("warm, but its steps do not all say done or not needed", "warm")
        device = doc.get_str("device")
        if device not in DEVICES:
            doc.fail(f"{device!r} is not one of {', '.join(DEVICES)}", "device")
        inventory = {}
        for sub, counts in doc.sub("inventory", {}).items():
            counts.only(("files", "bytes"))
            if sub not in CACHE_SUBDIRS.values():
                counts.fail(f"not a cache folder ({', '.join(CACHE_SUBDIRS.values())})")
            inventory[sub] = {"files": counts.get_int("files", min=0),
                              "bytes": counts.get_int("bytes", min=0)}
        return cls(
            fingerprint=doc.get_str("fingerprint", pattern=r"[0-9A-Za-z_.-]{1,64}"),
            components=doc.get_str_map("components"),
            device=device,
            steps=steps,
            warm=warm,
            created=doc.get_float("created", 0.0),
            version=version,
            inventory=inventory,
        )


def entry_dir(cache_dir: Path, fp: str) -> Path:
    return Path(cache_dir).expanduser() / fp


def inventory(folder: Path) -> dict[str, dict[str, int]]:
    """Files and bytes in each cache sub-folder of an entry (what a warm manifest vouches
    for; a later check finds folders that were deleted or emptied since)."""
    out: dict[str, dict[str, int]] = {}
    for sub in sorted(set(CACHE_SUBDIRS.values())):
        root = Path(folder) / sub
        if not root.is_dir():
            continue
        files = [p for p in root.rglob("*") if p.is_file()]
        if files:
            out[sub] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    return out


def lost_entries(folder: Path, manifest: Manifest) -> list[str]:
    """Cache sub-folders the manifest recorded that are gone or hold fewer files now.
    A server may add files to a warm entry (new shapes), so more files are fine."""
    now = inventory(folder)
    lost = []
    for sub, was in sorted(manifest.inventory.items()):
        have = now.get(sub, {}).get("files", 0)
        if have < was["files"]:
            lost.append(f"{sub}/ holds {have} of the {was['files']} files it was warmed with"
                        if have else f"{sub}/ is gone")
    return lost


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Atomic: a reader sees the old manifest or the new one, never half of one. The
    entry's inventory is taken now, after every step has written its caches."""
    from sm70ctl.fsutil import atomic_write_text

    manifest.inventory = inventory(folder)
    path = Path(folder) / MANIFEST
    atomic_write_text(path, json.dumps(manifest.to_dict(), indent=2, sort_keys=True))
    return path


def load_manifest(folder: Path) -> Manifest | None:
    """The entry's manifest, None when there is none; Sm70Error naming the file and the
    field when it is damaged. A warm manifest whose cache folders were deleted since
    comes back cold, with a failed `cache` step saying which."""
    path = Path(folder) / MANIFEST
    if not path.exists() and not path.is_symlink():
        return None
    manifest = Manifest.from_dict(read_json(path, what="warmup manifest",
                                            max_bytes=MAX_MANIFEST_BYTES), name=str(path))
    lost = lost_entries(Path(folder), manifest)
    if lost and manifest.warm:
        manifest.warm = False
        manifest.steps.append(Step("cache", FAILED, "; ".join(lost)))
    return manifest


def read_manifest(folder: Path) -> Manifest | None:
    """`load_manifest`, with a damaged manifest read as none (cold; `cache_status` says
    it is damaged when the file exists)."""
    try:
        return load_manifest(folder)
    except Sm70Error:
        return None


def other_manifests(cache_dir: Path, skip: str) -> list[Manifest]:
    """Manifests of other fingerprints, newest first (to explain a cold answer)."""
    root = Path(cache_dir).expanduser()
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith(".") or child.name == skip or not child.is_dir():
            continue
        m = read_manifest(child)
        if m is not None:
            found.append(m)
    return sorted(found, key=lambda m: m.created, reverse=True)


@dataclass(frozen=True)
class Verdict:
    warm: bool
    fingerprint: str
    reason: str
    changed: tuple[str, ...] = ()


def assess(
    fp: str,
    components: Mapping[str, str],
    manifest: Manifest | None,
    others: list[Manifest],
) -> Verdict:
    """Warm or cold, and why (pure)."""
    if manifest is not None and manifest.fingerprint != fp:
        return Verdict(False, fp, f"the manifest in entry {fp} names another fingerprint "
                       f"({manifest.fingerprint}): a copied or damaged file")
    if manifest is not None:
        if manifest.warm:
            if all(s.status == NOT_NEEDED for s in manifest.steps):
                return Verdict(True, fp, "nothing to compile for these settings")
            return Verdict(True, fp, "warmed and verified in a fresh process")
        not_done = [f"{s.name} {s.status}" + (f" ({s.detail})" if s.detail else "")
                    for s in manifest.steps if s.status in (SKIPPED, FAILED)]
        return Verdict(False, fp, "the last warmup did not finish: " + "; ".join(not_done)
                       if not_done else "the last warmup was not verified")
    if not others:
        return Verdict(False, fp, "no warmup has run for these settings (empty cache)")
    latest = others[0]
    changed = tuple(diff_components(latest.components, components))
    if not changed:
        return Verdict(False, fp, f"no manifest for {fp}")
    shown = "; ".join(changed[:5]) + (f" (+{len(changed) - 5} more)" if len(changed) > 5 else "")
    return Verdict(False, fp, f"changed since the last warmup ({latest.fingerprint}): {shown}",
                   changed)
