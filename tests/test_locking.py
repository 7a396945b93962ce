"""The per-port lock on real processes: exclusive, names its holder, released on every
exit path (release, exception, SIGKILL of the holder)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sm70ctl.locking import FileLock, LockHeldError, probe_holder
from sm70ctl.runtime.port_lock import port_lock, port_lock_path

HOLD = (
    "import sys, time; from sm70ctl.runtime.port_lock import port_lock;"
    "l = port_lock(sys.argv[1], int(sys.argv[2]), '127.0.0.1').acquire();"
    "print('held', flush=True); time.sleep(60)"
)


def holder(lock_dir: Path, port: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_dir), str(port)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_holder_refused_with_pid(tmp_path: Path) -> None:
    p = holder(tmp_path, 8123)
    try:
        with pytest.raises(LockHeldError) as exc:
            port_lock(tmp_path, 8123, "127.0.0.1").acquire()
        assert f"pid {p.pid}" in exc.value.message
        assert "port 8123" in exc.value.message
        assert exc.value.holder["pid"] == p.pid
        assert probe_holder(port_lock_path(tmp_path, 8123)).pid == p.pid
        # another port is independent
        with port_lock(tmp_path, 8124, "127.0.0.1"):
            pass
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # killed holder: the kernel released the flock, the next caller gets it
    assert probe_holder(port_lock_path(tmp_path, 8123)) is None
    with port_lock(tmp_path, 8123, "127.0.0.1") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_released_on_exception(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), FileLock(tmp_path / "x.lock", "test"):
        raise RuntimeError("boom")
    assert probe_holder(tmp_path / "x.lock") is None
    assert (tmp_path / "x.lock").read_text() == ""


def test_same_process_second_acquire_refused(tmp_path: Path) -> None:
    a = FileLock(tmp_path / "x.lock", "first").acquire()
    try:
        with pytest.raises(LockHeldError):
            FileLock(tmp_path / "x.lock", "second").acquire()
    finally:
        a.release()
    a.release()  # idempotent


def test_lock_not_inherited_by_children(tmp_path: Path) -> None:
    with FileLock(tmp_path / "x.lock", "parent") as lock:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not lock.held
        # the parent released; a child that outlives it must not keep the lock
        assert probe_holder(tmp_path / "x.lock") is None
    finally:
        child.kill()
        child.wait()


def test_probe_missing_file(tmp_path: Path) -> None:
    assert probe_holder(tmp_path / "none.lock") is None
