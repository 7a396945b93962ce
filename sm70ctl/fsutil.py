"""File helpers shared by every module: hashing and atomic writes (tmp + fsync + rename)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path


def sha256_file(
    path: Path, progress: Callable[[int], None] | None = None, chunk: int = 1 << 20
) -> str:
    """The file's sha256; `progress` (if given) is called with each block's length."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()


def _create_beside(target: Path) -> tuple[int, Path]:
    """A new, empty temporary file in `target`'s folder, created the way open() creates a
    file (mode 0o666 less the umask: the kernel applies it). mkstemp's fixed 0o600 would
    become the mode of every file renamed over from it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{os.urandom(6).hex()}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{target.parent}: no free temporary name for {target.name}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder, then rename.

    The result looks like a plain write's: a symlink is written through (its target is
    replaced, the link stays), an existing file keeps its mode, a new one gets 0o666 less
    the umask. Readers see the old content or the new, never a mix.
    """
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode: int | None = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = None
    fd, tmp = _create_beside(target)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished folder into place; an older folder at `final` is removed first."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def rmtree_quiet(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
