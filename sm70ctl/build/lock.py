"""The lock file: every input of the build, pinned by an immutable id.

The lock is TOML. The copy shipped with the package (`sm70ctl/data/sm70.lock.toml`,
reachable at the repository root through the `sm70.lock.toml` link) is the default;
`--lock PATH` picks another (tests point it at local repositories).

Parsing is pure: `parse_lock(text)` returns plain dataclasses or raises `LockError`
naming the entry, the field, the value and the rule. An id that could not be verified
must say so (`unverified = "reason"`) instead of carrying a made-up value.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

LOCK_NAME = "sm70.lock.toml"
SCHEMA = 1
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_URL_SCHEMES = ("https://", "http://", "file://")


class LockError(Sm70Error):
    """The lock file is malformed: names the entry, field, value and rule."""


@dataclass(frozen=True)
class Toolchain:
    cuda: str  # nvcc release, e.g. "12.8"
    gcc_min: str  # oldest host compiler, e.g. "11.4"
    gcc_max_major: int  # newest host compiler major nvcc accepts, e.g. 14
    python: str  # serving interpreter, e.g. "3.12"
    cuda_arch_list: str  # TORCH_CUDA_ARCH_LIST the pins are meant for

    def ident(self) -> dict[str, Any]:
        return {
            "cuda": self.cuda,
            "gcc_min": self.gcc_min,
            "gcc_max_major": self.gcc_max_major,
            "python": self.python,
            "cuda_arch_list": self.cuda_arch_list,
        }


@dataclass(frozen=True)
class GitSource:
    name: str
    url: str
    commit: str
    tag: str = ""
    note: str = ""
    unverified: str = ""  # why the commit is not verified (then `commit` may be empty)

    @property
    def ref(self) -> str:
        """What to check out: the commit, or the tag of an unverified pin."""
        return self.commit or self.tag

    def ident(self) -> dict[str, Any]:
        # The URL is not part of the identity: the same commit from a mirror is the same input.
        return {"kind": "git", "name": self.name, "commit": self.commit, "tag": self.tag}


@dataclass(frozen=True)
class Archive:
    name: str
    url: str
    filename: str
    sha256: str
    strip: str = ""  # top folder inside the archive, removed on unpack
    patch: bool = False  # apply vllm_patch/patches to it
    note: str = ""

    def ident(self) -> dict[str, Any]:
        return {"kind": "archive", "name": self.name, "sha256": self.sha256}


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    filename: str
    url: str
    sha256: str = ""
    unverified: str = ""  # why there is no sha256 (then sha256 is empty)
    index: str = ""  # where it comes from, when not PyPI

    @property
    def verified(self) -> bool:
        return bool(self.sha256)

    def ident(self) -> dict[str, Any]:
        return {
            "kind": "wheel",
            "filename": self.filename,
            "sha256": self.sha256 or f"unverified:{self.version}",
        }


@dataclass(frozen=True)
class LocalSource:
    name: str
    path: str  # relative to the project root
    hash: str  # content hash (see `tree_hash`) when the lock was last written
    globs: tuple[str, ...] = ("**/*",)

    def ident(self) -> dict[str, Any]:
        return {"kind": "local", "name": self.name, "hash": self.hash}


@dataclass(frozen=True)
class Lock:
    toolchain: Toolchain
    git: tuple[GitSource, ...]
    archives: tuple[Archive, ...]
    wheels: tuple[Wheel, ...]
    local: tuple[LocalSource, ...]
    path: Path | None = None
    digest: str = ""  # sha256 of the lock file text
    notes: dict[str, str] = field(default_factory=dict)

    def archive(self, name: str) -> Archive:
        for a in self.archives:
            if a.name == name:
                return a
        raise LockError(f"lock has no [[archive]] named {name!r}")

    def items(self) -> list[tuple[str, str, str]]:
        """(kind, name, id) for every pinned input, for listings."""
        rows: list[tuple[str, str, str]] = []
        t = self.toolchain
        rows.append(("toolchain", "cuda", f"nvcc {t.cuda}"))
        rows.append(("toolchain", "gcc", f">= {t.gcc_min}, major <= {t.gcc_max_major}"))
        rows.append(("toolchain", "python", t.python))
        rows.append(("toolchain", "arch", t.cuda_arch_list))
        for g in self.git:
            ident = g.commit or f"UNVERIFIED tag only ({_short(g.unverified)})"
            rows.append(("git", g.name, f"{g.tag + ' ' if g.tag else ''}{ident}"))
        rows += [("archive", a.name, f"{a.filename} sha256:{a.sha256}") for a in self.archives]
        for w in self.wheels:
            ident = f"sha256:{w.sha256}" if w.sha256 else f"UNVERIFIED ({_short(w.unverified)})"
            rows.append(("wheel", f"{w.name}=={w.version}", ident))
        rows += [("local", s.name, f"{s.path}/ content:{s.hash}") for s in self.local]
        return rows


def _short(text: str, n: int = 72) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


# --- parsing (pure) ------------------------------------------------------------------


def _req(entry: dict[str, Any], key: str, where: str, kind: type = str) -> Any:
    if key not in entry:
        raise LockError(f"{where}: missing field {key!r}")
    value = entry[key]
    if not isinstance(value, kind) or (kind is str and not value):
        raise LockError(f"{where}: field {key!r} = {value!r} must be a non-empty {kind.__name__}")
    return value


def _opt(entry: dict[str, Any], key: str, where: str, default: Any = "") -> Any:
    value = entry.get(key, default)
    if not isinstance(value, type(default)):
        raise LockError(f"{where}: field {key!r} = {value!r} must be {type(default).__name__}")
    return value


def _check_name(name: str, where: str, seen: set[str]) -> None:
    if not _NAME.match(name):
        raise LockError(f"{where}: name {name!r} must match {_NAME.pattern}")
    if name in seen:
        raise LockError(f"{where}: name {name!r} appears twice")
    seen.add(name)


def _check_url(url: str, where: str) -> None:
    if not url.startswith(_URL_SCHEMES):
        raise LockError(f"{where}: url {url!r} must start with one of {', '.join(_URL_SCHEMES)}")


def _check_filename(name: str, where: str) -> None:
    if "/" in name or name in ("", ".", ".."):
        raise LockError(f"{where}: filename {name!r} must be a plain file name")


def parse_lock(text: str, path: Path | None = None) -> Lock:
    """Parse and validate lock text; raises LockError naming what is wrong."""
    label = str(path) if path else "lock"
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LockError(f"{label}: not valid TOML: {exc}") from None
    schema = doc.get("schema")
    if schema != SCHEMA:
        raise LockError(f"{label}: schema = {schema!r}; this sm70ctl reads schema {SCHEMA}")

    tc = doc.get("toolchain")
    if not isinstance(tc, dict):
        raise LockError(f"{label}: missing [toolchain] table")
    toolchain = Toolchain(
        cuda=_req(tc, "cuda", "[toolchain]"),
        gcc_min=_req(tc, "gcc_min", "[toolchain]"),
        gcc_max_major=_req(tc, "gcc_max_major", "[toolchain]", int),
        python=_req(tc, "python", "[toolchain]"),
        cuda_arch_list=_req(tc, "cuda_arch_list", "[toolchain]"),
    )

    seen: set[str] = set()
    gits = []
    for i, e in enumerate(doc.get("git", [])):
        where = f"[[git]] #{i + 1}"
        name = _req(e, "name", where)
        where = f"[[git]] {name}"
        _check_name(name, where, seen)
        url = _req(e, "url", where)
        _check_url(url, where)
        commit = _opt(e, "commit", where)
        tag = _opt(e, "tag", where)
        unverified = _opt(e, "unverified", where)
        if commit and not _COMMIT.match(commit):
            raise LockError(f"{where}: commit {commit!r} must be 40 lower-case hex digits")
        if not commit and not (unverified and tag):
            raise LockError(
                f"{where}: no commit; a pin by tag alone must say why in `unverified = \"...\"`"
            )
        gits.append(GitSource(name, url, commit, tag, _opt(e, "note", where), unverified))

    archives = []
    for i, e in enumerate(doc.get("archive", [])):
        where = f"[[archive]] #{i + 1}"
        name = _req(e, "name", where)
        where = f"[[archive]] {name}"
        _check_name(name, where, seen)
        url = _req(e, "url", where)
        _check_url(url, where)
        filename = _req(e, "filename", where)
        _check_filename(filename, where)
        sha = _req(e, "sha256", where)
        if not _SHA256.match(sha):
            raise LockError(f"{where}: sha256 {sha!r} must be 64 lower-case hex digits")
        archives.append(
            Archive(
                name,
                url,
                filename,
                sha,
                strip=_opt(e, "strip", where),
                patch=_opt(e, "patch", where, False),
                note=_opt(e, "note", where),
            )
        )

    wheels = []
    seen_files: set[str] = set()
    for i, e in enumerate(doc.get("wheel", [])):
        where = f"[[wheel]] #{i + 1}"
        name = _req(e, "name", where)
        where = f"[[wheel]] {name}"
        version = _req(e, "version", where)
        filename = _req(e, "filename", where)
        _check_filename(filename, where)
        if filename in seen_files:
            raise LockError(f"{where}: filename {filename!r} appears twice")
        seen_files.add(filename)
        url = _req(e, "url", where)
        _check_url(url, where)
        sha = _opt(e, "sha256", where)
        unverified = _opt(e, "unverified", where)
        if sha and not _SHA256.match(sha):
            raise LockError(f"{where}: sha256 {sha!r} must be 64 lower-case hex digits")
        if not sha and not unverified:
            raise LockError(
                f"{where}: no sha256; an unverified pin must say why in `unverified = \"...\"`"
            )
        if sha and unverified:
            raise LockError(f"{where}: has both sha256 and unverified; keep one")
        wheels.append(Wheel(name, version, filename, url, sha, unverified, _opt(e, "index", where)))

    local = []
    for i, e in enumerate(doc.get("local", [])):
        where = f"[[local]] #{i + 1}"
        name = _req(e, "name", where)
        where = f"[[local]] {name}"
        _check_name(name, where, seen)
        p = _req(e, "path", where)
        if p.startswith("/") or ".." in Path(p).parts:
            raise LockError(f"{where}: path {p!r} must be relative to the project root")
        h = _req(e, "hash", where)
        if not _SHA256.match(h):
            raise LockError(f"{where}: hash {h!r} must be 64 lower-case hex digits")
        globs = _opt(e, "globs", where, ["**/*"])
        local.append(LocalSource(name, p, h, tuple(globs)))

    notes = {k: v for k, v in doc.get("notes", {}).items() if isinstance(v, str)}
    return Lock(
        toolchain=toolchain,
        git=tuple(gits),
        archives=tuple(archives),
        wheels=tuple(wheels),
        local=tuple(local),
        path=path,
        digest=hashlib.sha256(text.encode()).hexdigest(),
        notes=notes,
    )


# --- files (edges) --------------------------------------------------------------------


def packaged_lock_path() -> Path:
    """The lock shipped inside the package (the repository root links to it)."""
    return Path(__file__).resolve().parent.parent / "data" / LOCK_NAME


def project_root() -> Path:
    """The source tree holding csrc/ and vllm_patch/ (for an editable or source install)."""
    return Path(__file__).resolve().parent.parent.parent


def load_lock(path: Path | None = None) -> Lock:
    p = path or packaged_lock_path()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise LockError(f"cannot read lock file {p}: {exc.strerror}") from None
    return parse_lock(text, p)


def tree_hash(root: Path, globs: tuple[str, ...] = ("**/*",)) -> str:
    """sha256 over (relative path, content) of the files under `root` matching `globs`.

    Stable across machines: sorted POSIX paths, file bytes only (no mtimes or modes), and
    caches (`__pycache__`) left out.
    """
    h = hashlib.sha256()
    files: set[Path] = set()
    if root.is_dir():
        for g in globs:
            files.update(p for p in root.glob(g) if p.is_file() and "__pycache__" not in p.parts)
    for p in sorted(files, key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        h.update(rel.encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def relock_local(path: Path, root: Path, csrc: Path) -> dict[str, tuple[str, str]]:
    """Rewrite the `hash` of every [[local]] entry to the current content; atomic.

    `root` holds the local trees, `csrc` is the kernel sources' folder (see
    `local_sources`). A source that is missing or empty raises before anything is written:
    the hash of an empty folder is never recorded. Returns {name: (old, new)} for the
    entries that changed.
    """
    from sm70ctl.build.local_sources import local_hash
    from sm70ctl.fsutil import atomic_write_text

    text = path.read_text(encoding="utf-8")
    lock = parse_lock(text, path)
    changed: dict[str, tuple[str, str]] = {}
    for src in lock.local:
        new = local_hash(src, root, csrc)
        if new != src.hash:
            changed[src.name] = (src.hash, new)
            text = text.replace(f'hash = "{src.hash}"', f'hash = "{new}"', 1)
    if changed:
        parse_lock(text, path)  # never write a lock we cannot read back
        atomic_write_text(path, text)
    return changed
