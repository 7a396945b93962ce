"""The serve secrets file does not outlive serve, not even a SIGKILL; the serve log never
holds the key, also not through an inherited variable with an innocent name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_fakes import alive, fake_env, free_port

REPO = Path(__file__).resolve().parents[1]
CPU_ENV = REPO / "tests" / "e2e" / "cpu.env"
KEY = "sk-planted-7c1e9a"


def _wait(path: Path, text: str, timeout: float = 30) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    found = []
    for p in root.rglob("*"):
        try:
            if p.is_file() and needle in p.read_bytes():
                found.append(p)
        except OSError:
            continue
    return found


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    env = fake_env(tmp_path, free_port(), FAKE_MARKER=str(tmp_path / "starts.txt"))
    env.update(SM70_API_KEY=KEY, INNOCENT_LOOKING=f"prefix-{KEY}", FAKE_PRINT_CONFIG="1")
    return env


def test_secrets_file_does_not_survive_sigkill(env: dict[str, str], tmp_path: Path) -> None:
    port = env["SM70_PORT"]
    secrets = tmp_path / "locks" / f"serve-{port}.secrets.yaml"
    err = tmp_path / "serve.stderr"
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sm70ctl", "serve", "--device", "cpu",
                                 "--env-file", str(CPU_ENV), "--allow-cold"], env=env,
                                stdout=subprocess.DEVNULL, stderr=fh)
    try:
        assert _wait(err, "ready after"), err.read_text()
        server_pid = int((tmp_path / "starts.txt").read_text().split()[1])
        # while serve runs, vLLM reads the key through the usual .yaml path
        assert KEY in secrets.read_text()
        assert secrets.stat().st_mode & 0o777 == 0o600
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    end = time.monotonic() + 20
    while alive(server_pid) and time.monotonic() < end:
        time.sleep(0.2)
    # nothing on disk holds the key any more: not the secrets path, not the log
    assert not secrets.exists()  # at most a dangling link to the dead process's memory
    assert _files_holding(tmp_path, KEY.encode()) == []
    log = (tmp_path / "logs" / f"serve-{port}.log").read_text()
    assert "INNOCENT_LOOKING=***" in log
    assert "args from --config: api-key:" in log


def test_next_start_removes_a_left_link(env: dict[str, str], tmp_path: Path) -> None:
    from sm70ctl.runtime.secrets import secrets_file, secrets_path
    from sm70ctl.settings import load_settings

    s = load_settings(environ={"SM70_API_KEY": KEY, "SM70_LOCK_DIR": str(tmp_path)})
    left = secrets_path(s)
    os.symlink("/proc/1/fd/999", left)  # what a killed serve leaves behind
    with secrets_file(s) as path:
        assert path == left and path.read_text() == f'api-key: "{KEY}"\n'
    assert not os.path.lexists(left)
