"""A FileLock held by another process: the fixture of every refused-concurrent-run test."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

_HOLD = (
    "import sys, time; from sm70ctl.locking import FileLock;"
    "FileLock(sys.argv[1], sys.argv[2]).acquire(); print('held', flush=True);"
    "time.sleep(60)"
)


@contextmanager
def held_lock(path: Path, owner: str) -> Iterator[subprocess.Popen[str]]:
    """Yield a child process that holds the lock at path as owner; kill it on exit."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path), owner],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()
