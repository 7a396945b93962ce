"""The per-folder manifest: what a download should contain and what it did contain.

`<folder>/.sm70/manifest.json` is written when a fetch starts (every expected file, with
the size and hashes the hub listed, nothing downloaded yet) and rewritten atomically
after each file lands (its sha256 and a stat snapshot). So an interrupted download still
says exactly which files are missing, and `verify` can skip re-hashing any file whose
size, mtime and inode are unchanged since it was last hashed.

Partial downloads live in `<folder>/.sm70/partial/` so that nothing half-written ever
sits under a name vLLM would load.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from sm70ctl.errors import Sm70Error
from sm70ctl.fsutil import atomic_write_text, sha256_file

FORMAT = 1
STATE_DIR = ".sm70"
MANIFEST_NAME = "manifest.json"
PARTIAL_DIR = "partial"
# Folders inside a model folder that belong to tools, not to the checkpoint.
IGNORED_DIRS = (STATE_DIR, ".cache")
_CHUNK = 8 * 1024 * 1024


@dataclass
class StatStamp:
    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, path: Path) -> StatStamp:
        st = path.stat()
        return cls(size=st.st_size, mtime_ns=st.st_mtime_ns, ino=st.st_ino)


@dataclass
class FileEntry:
    size: int  # bytes, as listed by the hub
    lfs_sha256: str | None = None  # the hub's LFS sha256, when it gave one
    git_oid: str | None = None  # the hub's git blob id (sha1 of "blob <n>\0" + content)
    sha256: str | None = None  # what we measured; None until the file is downloaded
    stat: StatStamp | None = None  # stat when sha256 was last measured

    @property
    def downloaded(self) -> bool:
        return self.sha256 is not None


@dataclass
class Manifest:
    name: str
    repo_id: str
    revision: str
    repo_type: str = "model"
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    complete: bool = False
    files: dict[str, FileEntry] = field(default_factory=dict)
    format: int = FORMAT

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["files"] = {path: asdict(entry) for path, entry in sorted(self.files.items())}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Parse a manifest; ValueError naming the field when it is not one we wrote (a
        hand-edited or damaged file must fail cleanly, not deep inside verify)."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, found {type(data).__name__}")
        raw_files = data.get("files", {})
        if not isinstance(raw_files, dict):
            raise ValueError(f"'files' must be an object, found {type(raw_files).__name__}")
        files = {}
        for path, raw in raw_files.items():
            if not safe_relpath(path):
                raise ValueError(f"unsafe file path {path!r} (absolute, '..' or {STATE_DIR}/)")
            if not isinstance(raw, dict):
                raise ValueError(f"entry of {path!r} must be an object")
            stat = raw.get("stat")
            if stat is not None and not isinstance(stat, dict):
                raise ValueError(f"'stat' of {path!r} must be an object")
            files[path] = FileEntry(
                size=int(raw["size"]),
                lfs_sha256=_opt_str(raw.get("lfs_sha256")),
                git_oid=_opt_str(raw.get("git_oid")),
                sha256=_opt_str(raw.get("sha256")),
                stat=StatStamp(**stat) if stat else None,
            )
        for key in ("include", "exclude"):
            if not isinstance(data.get(key, []), list):
                raise ValueError(f"'{key}' must be a list")
        return cls(
            name=str(data["name"]),
            repo_id=str(data["repo_id"]),
            revision=str(data["revision"]),
            repo_type=str(data.get("repo_type", "model")),
            include=[str(x) for x in data.get("include", [])],
            exclude=[str(x) for x in data.get("exclude", [])],
            complete=data.get("complete", False) is True,
            files=files,
            format=int(data.get("format", FORMAT)),
        )


def _opt_str(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"expected a string or null, found {type(value).__name__}")


def safe_relpath(path: object) -> bool:
    """A listed path that stays inside the model folder and out of our state folder."""
    if not isinstance(path, str) or not path or path.startswith("/"):
        return False
    parts = PurePosixPath(path).parts
    return bool(parts) and ".." not in parts and parts[0] != STATE_DIR


def manifest_path(folder: Path) -> Path:
    return Path(folder) / STATE_DIR / MANIFEST_NAME


def partial_path(folder: Path, rel: str) -> Path:
    return Path(folder) / STATE_DIR / PARTIAL_DIR / rel


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    path = manifest_path(folder)
    atomic_write_text(path, json.dumps(manifest.to_dict(), indent=2) + "\n")
    return path


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest, None when there is none; a clear error when it is unreadable."""
    path = manifest_path(folder)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return Manifest.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise Sm70Error(
            f"manifest {path} is unreadable ({exc.__class__.__name__}: {exc})",
            hint="run `sm70ctl weights fetch` again to rebuild it",
        ) from exc


def git_blob_oid(path: Path) -> str:
    """The git object id of a file's content (what the hub lists as `oid` for non-LFS files)."""
    h = hashlib.sha1(usedforsecurity=False)
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def walk_files(folder: Path) -> Iterator[str]:
    """Every regular file under `folder` as a '/'-separated relative path, tool folders skipped."""
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        rel_root = Path(root).relative_to(folder)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if d not in IGNORED_DIRS]
        dirs.sort()
        for name in sorted(files):
            yield (rel_root / name).as_posix()


__all__ = [
    "FileEntry",
    "Manifest",
    "StatStamp",
    "atomic_write_text",
    "git_blob_oid",
    "manifest_path",
    "partial_path",
    "read_manifest",
    "safe_relpath",
    "sha256_file",
    "walk_files",
    "write_manifest",
]
