"""The restart back-off policy (pure), and the supervisor's pieces on real processes."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from serve_fakes import alive

from sm70ctl.runtime.server import (
    ServerFailed,
    ServerLog,
    ServerProcess,
    ServerSpec,
    group_has_live_members,
    wait_ready,
)
from sm70ctl.serve.supervisor import next_backoff


def test_backoff_doubles_up_to_max() -> None:
    failures, delays = 0, []
    for _ in range(12):
        failures, delay = next_backoff(failures, 1.0, healthy_reset=300, maximum=300)
        delays.append(delay)
    assert delays == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]
    assert failures == 12


def test_healthy_run_resets_backoff() -> None:
    failures = 9
    failures, delay = next_backoff(failures, 300.0, healthy_reset=300, maximum=300)
    assert (failures, delay) == (1, 1)
    failures, delay = next_backoff(9, 299.9, healthy_reset=300, maximum=300)
    assert (failures, delay) == (10, 300)


@given(
    failures=st.integers(0, 10_000),
    healthy=st.floats(0, 1e6, allow_nan=False),
    reset=st.floats(0.1, 1e5, allow_nan=False),
    maximum=st.floats(0, 1e5, allow_nan=False),
)
def test_backoff_properties(failures: int, healthy: float, reset: float, maximum: float) -> None:
    new, delay = next_backoff(failures, healthy, healthy_reset=reset, maximum=maximum)
    assert 0 <= delay <= maximum
    if healthy >= reset:
        assert new == 1
    else:
        assert new == failures + 1
        # never shorter than the previous delay
        _, before = next_backoff(max(failures - 1, 0), 0, healthy_reset=reset, maximum=maximum)
        assert delay >= before or failures == 0


def test_log_rotates_and_keeps_tail(tmp_path: Path) -> None:
    echoed: list[str] = []
    log = ServerLog(tmp_path / "s.log", max_bytes=2000, backups=2, echo=echoed.append)
    for i in range(400):
        log.server_line(f"line {i:04d} " + "x" * 40)
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["s.log", "s.log.1", "s.log.2"]
    assert all(p.stat().st_size <= 2200 for p in tmp_path.iterdir())
    assert "line 0399" in (tmp_path / "s.log").read_text()
    assert list(log.tail)[-1].startswith("line 0399") and len(log.tail) == 40
    assert len(echoed) == 400


def test_wait_ready_times_out_with_tail(tmp_path: Path) -> None:
    script = "import time; print('still loading', flush=True); time.sleep(30)"
    spec = ServerSpec(argv=[sys.executable, "-c", script], env={}, base_url="http://127.0.0.1:9",
                      startup_timeout=1.0, shutdown_grace=2)
    log = ServerLog(tmp_path / "s.log", 10**6, 1)
    server = ServerProcess(spec, log)
    server.start()
    try:
        with pytest.raises(ServerFailed) as exc:
            wait_ready(server, threading.Event(), poll=0.1)
        assert "not ready after 1s" in exc.value.message
        assert "still loading" in exc.value.message
    finally:
        code = server.stop(2)
    log.close()
    # The leader obeys SIGTERM: stop() ends it without reaching for SIGKILL.
    assert code == -signal.SIGTERM
    assert "SIGKILL" not in (tmp_path / "s.log").read_text()


def test_stop_kills_whole_group(tmp_path: Path) -> None:
    # a leader with a child that ignores SIGTERM: both are gone after stop()
    script = (
        "import subprocess, sys, time;"
        "c = subprocess.Popen([sys.executable, '-c', 'import signal, time;"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(\"child up\", flush=True);"
        "time.sleep(60)']); print('child', c.pid, flush=True); c.wait()"
    )
    spec = ServerSpec(argv=[sys.executable, "-c", script], env={}, base_url="http://x")
    log = ServerLog(tmp_path / "s.log", 10**6, 1)
    server = ServerProcess(spec, log)
    server.start()
    # "child up" is printed once the child ignores SIGTERM, so stop() must escalate.
    _wait_for(lambda: "child up" in list(log.tail), "the child never reported it was up")
    child = int(next(line for line in log.tail if line.startswith("child ")).split()[1])
    server.stop(1.0)
    log.close()
    assert "SIGKILL to group" in (tmp_path / "s.log").read_text()
    # SIGKILL is delivered asynchronously: wait (bounded) for the child to be gone.
    _wait_for(lambda: not alive(child), f"child {child} still alive after stop()")
    assert server.pid is not None and not group_has_live_members(server.pid)


def _wait_for(condition: Callable[[], bool], failure: str, limit: float = 10.0) -> None:
    """Poll until `condition` holds; fail with `failure` if it never does within `limit`."""
    end = time.monotonic() + limit
    while not condition():
        if time.monotonic() > end:
            pytest.fail(failure)
        time.sleep(0.05)


def test_secrets_stay_out_of_reprs_and_server_lines(tmp_path: Path) -> None:
    spec = ServerSpec(argv=["x"], env={}, base_url="http://127.0.0.1:1", api_key="sk-secret-1")
    assert "sk-secret-1" not in repr(spec)
    echoed: list[str] = []
    log = ServerLog(tmp_path / "s.log", 10_000, 1, echo=echoed.append,
                    secrets=["sk-secret-1", "", "hf_tok"])
    log.server_line("args: api_key='sk-secret-1' token hf_tok")
    log.close()
    for text in ((tmp_path / "s.log").read_text(), echoed[0], log.tail[0]):
        assert "sk-secret-1" not in text and "hf_tok" not in text
        assert "api_key='***' token ***" in text


def test_unwritable_log_folder_is_a_clear_error(tmp_path: Path) -> None:
    from sm70ctl.errors import Sm70Error

    (tmp_path / "f").write_text("")
    with pytest.raises(Sm70Error, match="cannot write the server log") as err:
        ServerLog(tmp_path / "f" / "s.log", 1000, 1)
    assert err.value.hint == f"SM70_LOG_DIR={tmp_path / 'f'} must be a folder this user can write"
