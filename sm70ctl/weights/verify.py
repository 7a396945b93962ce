"""Offline check of a model folder against its manifest: missing, extra, corrupted files.

Never touches the network. Fast by default: a file whose size, mtime and inode equal the
stat recorded when it was last hashed is taken as unchanged; any other file is re-hashed
(and, when it still matches, its new stat is recorded). `full=True` re-hashes everything,
which also catches a change made behind a restored mtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.readers import check_path, read_json
from sm70ctl.weights.manifest import (
    STATE_DIR,
    Manifest,
    StatStamp,
    git_blob_oid,
    manifest_path,
    partial_path,
    read_manifest,
    sha256_file,
    walk_files,
    write_manifest,
)

# Issue kinds, in the order they are reported.
MISSING = "missing"  # listed, not on disk (or never downloaded)
INCOMPLETE = "incomplete"  # listed, a partial download exists
CORRUPTED = "corrupted"  # on disk, size or sha256 differs
EXTRA = "extra"  # on disk, not in the manifest
NO_MANIFEST = "no-manifest"
UNFINISHED = "unfinished"  # the fetch that wrote the manifest did not finish
OUTSIDE = "outside"  # a link (of the file or a folder on its way) leading out of the folder


@dataclass(frozen=True)
class Issue:
    kind: str
    path: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "path": self.path, "detail": self.detail}


@dataclass
class VerifyReport:
    folder: str
    name: str = ""
    repo_id: str = ""
    revision: str = ""
    files: int = 0
    hashed: int = 0  # files re-hashed this run (the rest came from the stat cache)
    issues: list[Issue] = field(default_factory=list)
    quant_problems: list[dict[str, Any]] = field(default_factory=list)
    cache_note: str = ""

    @property
    def ok(self) -> bool:
        return not self.issues and not self.quant_problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "name": self.name,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "ok": self.ok,
            "files": self.files,
            "hashed": self.hashed,
            "issues": [i.to_dict() for i in self.issues],
            "quant_problems": self.quant_problems,
        }


def _check_entries(
    folder: Path, manifest: Manifest, full: bool, report: VerifyReport
) -> bool:
    """Check every listed file; returns True when a stat snapshot was refreshed."""
    refreshed = False
    root = _real(folder)
    for rel, entry in sorted(manifest.files.items()):
        path = folder / rel
        if (escape := _escape(path, root)) is not None:
            report.issues.append(Issue(OUTSIDE, rel, escape))
            continue
        if not path.is_file():
            part = partial_path(folder, rel)
            if part.is_file():
                report.issues.append(Issue(INCOMPLETE, rel, f"partial download: "
                                           f"{part.stat().st_size} of {entry.size} bytes"))
            else:
                why = "not on disk" if entry.downloaded else "not downloaded yet"
                report.issues.append(Issue(MISSING, rel, f"{why} ({entry.size} bytes expected)"))
            continue
        stamp = StatStamp.of(path)
        if stamp.size != entry.size:
            report.issues.append(
                Issue(CORRUPTED, rel, f"size {stamp.size} bytes, expected {entry.size}")
            )
            continue
        # The hub's LFS sha256 outranks our own record: a record that disagrees with it
        # (a hand-edited manifest) must not vouch for the file.
        expected = (entry.lfs_sha256 or entry.sha256 or "").lower() or None
        if not full and entry.sha256 and entry.sha256 == expected and entry.stat == stamp:
            continue  # unchanged since it was last hashed
        sha = sha256_file(path)
        report.hashed += 1
        if expected is None:
            # Never recorded by a finished download; a small non-LFS file can still be
            # checked against the hub's git blob id.
            if entry.git_oid and git_blob_oid(path) == entry.git_oid:
                entry.sha256, entry.stat = sha, stamp
                refreshed = True
            else:
                report.issues.append(
                    Issue(MISSING, rel, "present but never recorded as downloaded")
                )
        elif sha != expected:
            report.issues.append(Issue(CORRUPTED, rel, f"sha256 {sha}, expected {expected}"))
        elif entry.stat != stamp or entry.sha256 != sha:
            entry.sha256, entry.stat = sha, stamp
            refreshed = True
    return refreshed


def _real(path: Path) -> Path | None:
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError):  # RuntimeError: a link loop (Python 3.10-3.12)
        return None


def _escape(path: Path, root: Path | None) -> str | None:
    """Why a listed file cannot be trusted as part of the folder, else None.

    The manifest vouches for what sits in the folder; a link to somewhere else (another
    checkpoint, a file anyone may rewrite) would let verify pass on content the folder
    does not own, so a link is followed only while it stays inside."""
    if not path.is_symlink() and not path.exists():
        return None  # reported as missing
    target = _real(path)
    if target is None:
        return "a link that leads nowhere (dangling or a loop)"
    if root is None or not target.is_relative_to(root):
        return f"a link leading outside the folder (to {target})"
    return None


def verify_folder(
    folder: Path, *, full: bool = False, check_quant: bool | None = None
) -> VerifyReport:
    """Check `folder` against `<folder>/.sm70/manifest.json` (and its quantization config).

    `check_quant`: True validates config.json's quantization_config, False skips it,
    None validates it when config.json has one.
    """
    folder = check_path(Path(folder).expanduser(), "model folder")
    report = VerifyReport(folder=str(folder))
    if not folder.is_dir():
        report.issues.append(Issue(MISSING, ".", f"folder {folder} does not exist"))
        return report
    manifest = read_manifest(folder)
    if manifest is None:
        report.issues.append(
            Issue(NO_MANIFEST, str(manifest_path(folder).relative_to(folder)),
                  "no manifest: this folder was not fetched by `sm70ctl weights fetch`")
        )
        return report
    report.name, report.repo_id, report.revision = (
        manifest.name, manifest.repo_id, manifest.revision
    )
    report.files = len(manifest.files)
    if not manifest.complete:
        report.issues.append(Issue(UNFINISHED, str(manifest_path(folder).relative_to(folder)),
                                   "the fetch that wrote this manifest did not finish"))
    refreshed = _check_entries(folder, manifest, full, report)
    listed = set(manifest.files)
    for rel in walk_files(folder):
        if rel not in listed:
            report.issues.append(Issue(EXTRA, rel, "not part of the pinned checkpoint"))
    order = [OUTSIDE, MISSING, INCOMPLETE, CORRUPTED, EXTRA, NO_MANIFEST, UNFINISHED]
    report.issues.sort(key=lambda i: (order.index(i.kind), i.path))

    if refreshed:
        try:
            write_manifest(folder, manifest)
        except OSError as exc:  # a read-only checkpoint is still verifiable
            report.cache_note = f"stat cache not updated ({exc.strerror})"

    config = folder / "config.json"
    if check_quant is None:
        check_quant = _has_quant_config(config)
    if check_quant:
        from sm70ctl.weights.fetch import check_quant_folder

        report.quant_problems = check_quant_folder(folder)
    return report


def _has_quant_config(config: Path) -> bool:
    if not config.is_file():
        return False
    data = read_json(config, what="model config")  # a broken config.json is reported
    from sm70ctl.weights.quant import has_quant_config

    return has_quant_config(data)


__all__ = ["OUTSIDE", "STATE_DIR", "Issue", "VerifyReport", "verify_folder"]
