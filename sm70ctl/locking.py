"""The one lock helper: exclusive file locks (flock) that name their holder. Serve's per-port
lock, the warmup, build, mirror and weights-fetch locks are all this class.

flock is released by the kernel when the holding process dies, however it dies, so a
crashed supervisor never leaves a stale lock behind. The file itself is never removed
(removing it would let two processes lock two different inodes of the same name); the
holder writes its pid and purpose into it so a refused caller can say who holds it. The
descriptor is not inheritable, so the vLLM child never keeps the lock alive after us.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from sm70ctl.errors import Sm70Error


class LockHeldError(Sm70Error):
    """Another live process holds the lock."""

    def __init__(self, message: str, *, holder: dict | None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.holder = holder or {}


@dataclass
class Holder:
    pid: int | None
    info: dict


def _read_holder(path: Path) -> dict:
    from sm70ctl.readers import read_json

    try:
        data = read_json(path, what="lock file", max_bytes=64 * 1024) if (
            path.is_file() and path.stat().st_size) else {}
    except (OSError, Sm70Error):  # a damaged holder record names nobody
        return {}
    return data if isinstance(data, dict) else {}


class FileLock:
    """A non-blocking exclusive flock on `path`, held until `release()` (or process exit)."""

    def __init__(
        self,
        path: Path,
        purpose: str,
        alternative: str = "lock folder",
        *,
        folder_setting: str = "",
        **info: object,
    ) -> None:
        self.path = Path(path)
        self.purpose = purpose
        self.alternative = alternative
        self.folder_setting = folder_setting  # the setting naming the lock's folder
        self.info = info
        self._fd: int | None = None
        self._since = 0.0

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> FileLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            where = f"{self.folder_setting}={self.path.parent}" if self.folder_setting \
                else str(self.path.parent)
            raise Sm70Error(
                f"{self.purpose}: cannot create the lock file {self.path}: "
                f"{exc.strerror or exc}",
                hint=f"{where} must be a folder this user can write",
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _read_holder(self.path)
            pid = holder.get("pid", "unknown")
            what = holder.get("purpose", "another sm70ctl process")
            raise LockHeldError(
                f"{self.purpose}: refused, pid {pid} ({what}) holds the lock {self.path}",
                holder=holder,
                hint=f"stop pid {pid} first (or use another {self.alternative})",
            ) from None
        self._fd = fd
        self._since = time.time()
        self._write_record()
        return self

    def update(self, **info: object) -> None:
        """Add to what the held lock tells others (e.g. the cache entry a server uses)."""
        self.info.update(info)
        self._write_record()

    def _write_record(self) -> None:
        if self._fd is None:
            raise RuntimeError(f"{self.path} is not held")
        record = {"pid": os.getpid(), "purpose": self.purpose, "since": self._since,
                  **self.info}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def probe_holder(path: Path) -> Holder | None:
    """Who holds the lock at `path` right now (None: free). Takes and drops a shared lock,
    so it never blocks and never disturbs a holder."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        info = _read_holder(path)
        pid = info.get("pid")
        return Holder(pid=pid if isinstance(pid, int) else None, info=info)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
