"""Free-space probe (the one side effect) and the pure decision on whether a fetch fits."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sm70ctl.errors import Sm70Error


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (binary units, one decimal)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def existing_ancestor(path: Path) -> Path:
    """The folder itself if it exists, else its closest existing parent (where it will live)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding `path`."""
    target = existing_ancestor(path)
    try:
        st = os.statvfs(target)
        return st.f_bavail * st.f_frsize
    except (AttributeError, OSError):  # no statvfs (Windows)
        return shutil.disk_usage(target).free


def check_space(*, needed: int, free: int, folder: Path, what: str) -> None:
    """Raise naming both numbers when `needed` bytes will not fit in `free`."""
    if needed > free:
        raise Sm70Error(
            f"not enough disk space in {folder} for {what}: need {needed} bytes "
            f"({human_bytes(needed)}), {free} bytes ({human_bytes(free)}) free",
            hint="free some space, or point SM70_WEIGHTS_DIR at a larger filesystem",
        )


__all__ = ["check_space", "existing_ancestor", "free_bytes", "human_bytes"]
