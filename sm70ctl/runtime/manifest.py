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

from sm70ctl.runtime.fingerprint import diff_components

MANIFEST = "manifest.json"

DONE, SKIPPED, FAILED, NOT_NEEDED = "done", "skipped", "failed", "not needed"


@dataclass
class Step:
    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Manifest:
    fingerprint: str
    components: dict[str, str]
    device: str
    steps: list[Step] = field(default_factory=list)
    warm: bool = False
    created: float = field(default_factory=time.time)
    version: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a JSON object, found {type(data).__name__}")
        if not isinstance(data.get("warm", False), bool):  # "false" must not read as warm
            raise ValueError("'warm' must be true or false")
        raw_steps = data.get("steps", [])
        if not isinstance(raw_steps, list):
            raise ValueError("'steps' must be a list")
        steps = [Step(**{k: s.get(k) for k in ("name", "status", "detail", "seconds")
                         if k in s}) for s in raw_steps if isinstance(s, dict)]
        return cls(
            fingerprint=str(data["fingerprint"]),
            components={str(k): str(v) for k, v in dict(data.get("components", {})).items()},
            device=str(data.get("device", "")),
            steps=steps,
            warm=data.get("warm", False),
            created=float(data.get("created", 0.0)),
            version=int(data.get("version", 1)),
        )


def entry_dir(cache_dir: Path, fp: str) -> Path:
    return Path(cache_dir).expanduser() / fp


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Atomic: a reader sees the old manifest or the new one, never half of one."""
    from sm70ctl.fsutil import atomic_write_text

    path = Path(folder) / MANIFEST
    atomic_write_text(path, json.dumps(manifest.to_dict(), indent=2, sort_keys=True))
    return path


def read_manifest(folder: Path) -> Manifest | None:
    try:
        return Manifest.from_dict(json.loads((Path(folder) / MANIFEST).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
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
