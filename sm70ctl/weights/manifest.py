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
from sm70ctl.readers import View, path_problem, read_json

FORMAT = 1
STATE_DIR = ".sm70"
MANIFEST_NAME = "manifest.json"
PARTIAL_DIR = "partial"
# Folders inside a model folder that belong to tools, not to the checkpoint.
IGNORED_DIRS = (STATE_DIR, ".cache")
_CHUNK = 8 * 1024 * 1024
# A checkpoint lists a few hundred files at about 300 bytes each.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


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
    def from_dict(cls, data: Any, *, name: str = "manifest.json") -> Manifest:
        """Parse a manifest; one Sm70Error line naming the field when it is not one we
        wrote (a hand-edited or damaged file must fail cleanly, not deep inside verify)."""
        return _parse(View(data, what="weights manifest", name=name))


_SHA256 = r"[0-9a-fA-F]{64}"
_GIT_OID = r"[0-9a-f]{40}|[0-9a-f]{64}"
_TOP_KEYS = ("name", "repo_id", "revision", "repo_type", "include", "exclude", "complete",
             "files", "format")
_ENTRY_KEYS = ("size", "lfs_sha256", "git_oid", "sha256", "stat")
_BIG = 1 << 62  # no file is larger; bounds what a hand-edited size may claim


def _opt_hex(entry: View, key: str, pattern: str) -> str | None:
    if entry.get(key, None).value is None:
        return None
    return entry.get_str(key, pattern=pattern).lower()


def _parse(doc: View) -> Manifest:
    doc.table().only(_TOP_KEYS)
    version = doc.get_int("format", FORMAT, min=1)
    if version != FORMAT:
        doc.fail(f"format {version} is not one this version reads ({FORMAT})", "format")
    files: dict[str, FileEntry] = {}
    for path, entry in doc.sub("files", {}).items():
        if not safe_relpath(path) or path_problem(path) is not None:
            entry.fail(f"unsafe file path {path!r} (absolute, '..', {STATE_DIR}/ or too long)")
        entry.table().only(_ENTRY_KEYS)
        stat = None
        if entry.get("stat", None).value is not None:
            st = entry.sub("stat").only(("size", "mtime_ns", "ino"))
            stat = StatStamp(size=st.get_int("size", min=0, max=_BIG),
                             mtime_ns=st.get_int("mtime_ns"), ino=st.get_int("ino", min=0))
        files[path] = FileEntry(
            size=entry.get_int("size", min=0, max=_BIG),
            lfs_sha256=_opt_hex(entry, "lfs_sha256", _SHA256),
            git_oid=_opt_hex(entry, "git_oid", _GIT_OID),
            sha256=_opt_hex(entry, "sha256", _SHA256),
            stat=stat,
        )
    return Manifest(
        name=doc.get_str("name", nonempty=True),
        repo_id=doc.get_str("repo_id"),
        revision=doc.get_str("revision"),
        repo_type=doc.get_str("repo_type", "model"),
        include=doc.get_str_list("include", []),
        exclude=doc.get_str_list("exclude", []),
        complete=doc.get_bool("complete", False),
        files=files,
        format=version,
    )


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
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = read_json(path, what="weights manifest", max_bytes=MAX_MANIFEST_BYTES)
        return Manifest.from_dict(data, name=str(path))
    except Sm70Error as exc:
        raise Sm70Error(exc.message, hint="run `sm70ctl weights fetch` again to rebuild it"
                        ) from None


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
