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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error

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


# What each part of the lock may hold: anything else is a typo that would be silently lost
# (a misspelt `comit` leaves a pin by tag only), so it is refused by name.
# [models] is the weights pins, read by sm70ctl/weights/pins.py
_TOP_KEYS = {"schema", "notes", "toolchain", "git", "archive", "wheel", "local", "models"}
_ENTRY_KEYS = {
    "git": {"name", "url", "commit", "tag", "note", "unverified"},
    "archive": {"name", "url", "filename", "sha256", "strip", "patch", "note"},
    "wheel": {"name", "version", "filename", "url", "sha256", "unverified", "index", "note"},
    "local": {"name", "path", "hash", "globs", "note"},
}
LOCK_MAX_BYTES = 8 << 20  # the shipped lock is tens of KiB


def _entries(doc: dict[str, Any], kind: str, label: str) -> list[dict[str, Any]]:
    """`[[kind]]` entries: an array of tables with known keys only."""
    value = doc.get(kind, [])
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise LockError(f"{label}: `{kind}` must be an array of tables ([[{kind}]] entries), "
                        f"not {type(value).__name__}")
    for i, e in enumerate(value):
        stray = sorted(set(e) - _ENTRY_KEYS[kind])
        if stray:
            raise LockError(f"{label}: [[{kind}]] #{i + 1}: unknown field(s) {stray} "
                            f"(allowed: {', '.join(sorted(_ENTRY_KEYS[kind]))})")
    return value


def parse_lock(text: str, path: Path | None = None) -> Lock:
    """Parse and validate lock text; raises LockError naming what is wrong."""
    from sm70ctl.readers import parse_toml

    label = str(path) if path else "lock"
    try:
        doc = parse_toml(text, what="lock file", name=label)
    except Sm70Error as exc:
        raise LockError(exc.message, hint=exc.hint) from None
    stray = sorted(set(doc) - _TOP_KEYS)
    if stray:
        raise LockError(f"{label}: unknown top-level key(s) {stray} "
                        f"(allowed: {', '.join(sorted(_TOP_KEYS))})")
    schema = doc.get("schema")
    if schema != SCHEMA:
        raise LockError(f"{label}: schema = {schema!r}; this sm70ctl reads schema {SCHEMA}")

    tc = doc.get("toolchain")
    if not isinstance(tc, dict):
        raise LockError(f"{label}: missing [toolchain] table")
    tc_keys = {"cuda", "gcc_min", "gcc_max_major", "python", "cuda_arch_list"}
    if set(tc) - tc_keys:
        raise LockError(f"{label}: [toolchain]: unknown field(s) {sorted(set(tc) - tc_keys)} "
                        f"(allowed: {', '.join(sorted(tc_keys))})")
    toolchain = Toolchain(
        cuda=_req(tc, "cuda", "[toolchain]"),
        gcc_min=_req(tc, "gcc_min", "[toolchain]"),
        gcc_max_major=_req(tc, "gcc_max_major", "[toolchain]", int),
        python=_req(tc, "python", "[toolchain]"),
        cuda_arch_list=_req(tc, "cuda_arch_list", "[toolchain]"),
    )

    seen: set[str] = set()
    gits = []
    for i, e in enumerate(_entries(doc, "git", label)):
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
    for i, e in enumerate(_entries(doc, "archive", label)):
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
    for i, e in enumerate(_entries(doc, "wheel", label)):
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
    for i, e in enumerate(_entries(doc, "local", label)):
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
        if not globs or not all(isinstance(g, str) and g for g in globs):
            raise LockError(f"{where}: globs {globs!r} must be a list of non-empty patterns")
        local.append(LocalSource(name, p, h, tuple(globs)))

    raw_notes = doc.get("notes", {})
    if not isinstance(raw_notes, dict) or not all(isinstance(v, str) for v in raw_notes.values()):
        raise LockError(f"{label}: [notes] must be a table of strings")
    notes = dict(raw_notes)
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
    """Read a lock through the bounded reader (size, binary, folder, encoding refused)."""
    from sm70ctl.readers import read_text

    p = path or packaged_lock_path()
    try:
        text = read_text(p, what="lock file", max_bytes=LOCK_MAX_BYTES)
    except Sm70Error as exc:
        raise LockError(exc.message, hint=exc.hint) from None
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

    lock = load_lock(path)
    text = path.read_text(encoding="utf-8")  # read and checked by load_lock just now
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
