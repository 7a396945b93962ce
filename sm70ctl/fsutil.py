"""File helpers shared by every module: hashing and atomic writes (tmp + fsync + rename)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
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


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished folder into place; an older folder at `final` is removed first."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def rmtree_quiet(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
