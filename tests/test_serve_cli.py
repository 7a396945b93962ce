"""`sm70ctl serve` end to end against a stand-in server process (fast, no vLLM).

Real subprocesses, real sockets, real flock: the stand-in is a small HTTP server started
by serve exactly like vLLM (`SM70_SERVE_PYTHON -m vllm.entrypoints.openai.api_server`),
found through PYTHONPATH. A marker file records every start, so "refused before launching"
is checked, not assumed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from serve_fakes import alive, fake_env, free_port, port_is_free

REPO = Path(__file__).resolve().parents[1]
CPU_ENV = REPO / "tests" / "e2e" / "cpu.env"


def sm70(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sm70ctl", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def serve_args(*extra: str) -> list[str]:
    return ["serve", "--device", "cpu", "--env-file", str(CPU_ENV), *extra]


def start_serve(env: dict[str, str], tmp: Path, *extra: str) -> subprocess.Popen:
    err = open(tmp / "serve.stderr", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "sm70ctl", *serve_args(*extra)], env=env,
                            stdout=subprocess.PIPE, stderr=err, text=True)


def wait_http(port: int, timeout: float = 30) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def wait_file(path: Path, text: str, timeout: float = 30) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.2)
    return False


def starts(marker: Path) -> int:
    return len(marker.read_text().splitlines()) if marker.exists() else 0


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return fake_env(tmp_path, free_port(), FAKE_MARKER=str(tmp_path / "starts.txt"))


# --- refusals before launch ------------------------------------------------------------------
def test_bad_setting_refused_before_launch(env: dict[str, str], tmp_path: Path) -> None:
    env["SM70_MAX_NUM_SEQS"] = "lots"
    r = sm70(serve_args("--allow-cold"), env)
    assert r.returncode != 0
    assert "SM70_MAX_NUM_SEQS" in r.stderr and "lots" in r.stderr
    assert "Traceback" not in r.stderr
    assert starts(tmp_path / "starts.txt") == 0


def test_busy_port_refused_before_launch(env: dict[str, str], tmp_path: Path) -> None:
    port = int(env["SM70_PORT"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        r = sm70(serve_args("--allow-cold"), env)
    assert r.returncode == 1
    assert f"127.0.0.1:{port} is in use" in r.stderr
    assert "nothing was started" in r.stderr
    assert starts(tmp_path / "starts.txt") == 0
    # the lock was taken for the pre-flight and released on this exit path too
    assert sm70(serve_args("--dry-run"), env).returncode == 0


def test_held_lock_refused_naming_the_holder(env: dict[str, str], tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from sm70ctl.runtime.port_lock import port_lock;"
         f"l = port_lock(sys.argv[1], {env['SM70_PORT']}, '127.0.0.1').acquire();"
         "print('held', flush=True); time.sleep(60)", env["SM70_LOCK_DIR"]],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        r = sm70(serve_args("--allow-cold"), env)
        assert r.returncode == 1
        assert f"pid {holder.pid}" in r.stderr
        assert "refused" in r.stderr
        assert starts(tmp_path / "starts.txt") == 0
        dry = sm70(serve_args("--dry-run", "--json"), env)
        checks = {c["name"]: c for c in json.loads(dry.stdout)["checks"]}
        assert checks["port lock"]["status"] == "fail"
        assert str(holder.pid) in checks["port lock"]["detail"]
    finally:
        holder.kill()
        holder.wait()
    # the kernel drops a dead holder's lock: no stale lock file blocks the next serve
    dry = sm70(serve_args("--dry-run", "--json"), env)
    checks = {c["name"]: c for c in json.loads(dry.stdout)["checks"]}
    assert checks["port lock"]["status"] == "pass"


def test_cold_cache_refused_without_allow_cold(env: dict[str, str], tmp_path: Path) -> None:
    env["SM70_ENFORCE_EAGER"] = "false"  # something to compile: cold until warmed
    r = sm70(serve_args(), env)
    assert r.returncode == 1
    assert "compile cache" in r.stderr and "cold" in r.stderr and "--allow-cold" in r.stderr
    assert starts(tmp_path / "starts.txt") == 0


def test_cpu_device_needs_cpu_profile(env: dict[str, str], tmp_path: Path) -> None:
    r = sm70(["serve", "--device", "cpu", "--allow-cold"], env)
    assert r.returncode == 2
    assert "SM70_QUANTIZATION=gptq" in r.stderr and "SM70_KV_CACHE_DTYPE" in r.stderr
    assert starts(tmp_path / "starts.txt") == 0


def test_bad_device_is_a_usage_error(env: dict[str, str]) -> None:
    for cmd in (["serve", "--device", "gpu"], ["warmup", "--device", "tpu"]):
        r = sm70(cmd, env)
        assert r.returncode == 2 and "--device" in r.stderr


def test_dry_run_with_unresolvable_uuids(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    env.update({"SM70_LOCK_DIR": str(tmp_path / "l"), "SM70_CACHE_DIR": str(tmp_path / "c"),
                "SM70_GPUS": "GPU-aaaa,GPU-bbbb"})
    r = sm70(["serve", "--dry-run", "--json"], env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["env"]["CUDA_VISIBLE_DEVICES"].startswith("(unresolved")
    gpu = next(c for c in data["checks"] if c["name"] == "GPU indices")
    assert gpu["status"] == "fail"


def test_public_host_without_key_refused(env: dict[str, str], tmp_path: Path) -> None:
    env["SM70_HOST"] = "0.0.0.0"
    r = sm70(serve_args("--allow-cold"), env)
    assert r.returncode != 0
    assert "SM70_API_KEY" in r.stderr
    assert starts(tmp_path / "starts.txt") == 0


# --- dry run ---------------------------------------------------------------------------------
REFERENCE = (
    "--quantization gptq --dtype float16 --tensor-parallel-size 2 --disable-custom-all-reduce "
    "--gpu-memory-utilization 0.96 --kv-cache-memory-bytes 10630627328 --kv-cache-dtype "
    "int8_per_token_head --enable-prefix-caching --max-model-len 262144 --max-num-seqs 16 "
    "--max-num-batched-tokens 2048 --limit-mm-per-prompt '{\"image\":20,\"video\":2}' "
    "--enable-auto-tool-choice --tool-call-parser qwen3_coder --reasoning-parser qwen3 "
    "--compilation-config '{\"cudagraph_mode\":\"full_and_piecewise\","
    "\"cudagraph_capture_sizes\":[4,8,16,32,64]}' --mamba-cache-mode align --speculative-config "
    "'{\"method\":\"mtp\",\"num_speculative_tokens\":3}'"
)


def test_dry_run_defaults_print_reference_command(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    env.update({"SM70_LOCK_DIR": str(tmp_path / "l"), "SM70_CACHE_DIR": str(tmp_path / "c"),
                "SM70_API_KEY": "sk-very-secret-value", "SM70_HF_TOKEN": "hf_secret_token"})
    r = sm70(["serve", "--dry-run", "--json"], env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    line = data["command_line"]
    assert "-m vllm.entrypoints.openai.api_server --model " in line
    assert REFERENCE in line
    # our additions follow the reference flags
    assert line.index(REFERENCE) < line.index("--attention-backend SM70_PAGED")
    assert data["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert data["env"]["TORCH_CUDA_ARCH_LIST"] == "7.0"
    argv = data["command"]
    # the key travels in a private --config file, never on the command line
    assert "--api-key" not in argv
    assert argv[argv.index("--config") + 1].endswith("serve-8000.secrets.yaml")
    for stream in (r.stdout, r.stderr):
        assert "sk-very-secret-value" not in stream and "hf_secret_token" not in stream
    # the human rendering too
    r = sm70(["serve", "--dry-run"], env)
    assert r.returncode == 0
    assert "sk-very-secret-value" not in r.stdout + r.stderr
    assert "--tool-call-parser qwen3_coder" in r.stdout


def test_dry_run_starts_nothing(env: dict[str, str], tmp_path: Path) -> None:
    r = sm70(serve_args("--dry-run"), env)
    assert r.returncode == 0, r.stderr
    assert starts(tmp_path / "starts.txt") == 0
    assert "skip" in r.stdout and "device cpu: not checked" in r.stdout
    assert port_is_free(int(env["SM70_PORT"]))


# --- the whole life of a server ----------------------------------------------------------------
def test_serve_lifecycle_sigterm_frees_port_and_lock(env: dict[str, str], tmp_path: Path) -> None:
    port = int(env["SM70_PORT"])
    env["SM70_HF_TOKEN"] = "hf_do_not_leak"
    env["MY_SERVICE_TOKEN"] = "tok-do-not-log"
    env["VLLM_USE_V1"] = "1"
    proc = start_serve(env, tmp_path, "--allow-cold")
    try:
        assert wait_http(port), (tmp_path / "serve.stderr").read_text()
        assert wait_file(tmp_path / "serve.stderr", "ready after")
        # a second serve on the same port is refused, naming the holder
        second = sm70(serve_args("--allow-cold"), env)
        assert second.returncode == 1
        assert f"pid {proc.pid}" in second.stderr
        assert starts(tmp_path / "starts.txt") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert port_is_free(port)
    err = (tmp_path / "serve.stderr").read_text()
    assert "server stopped; port lock released" in err
    log = (tmp_path / "logs" / f"serve-{port}.log").read_text()
    assert "fake vllm: SIGTERM, shutting down" in log
    seen = log.split("SM70 vars seen: ")[1].splitlines()[0].split(",")
    # our settings never reach the server's env; only the variables we manage do
    assert set(seen) <= {"SM70_KERNELS_BUILD_DIR", ""}
    assert "inherited env (not managed): MY_SERVICE_TOKEN=***" in log
    assert "[may affect vLLM]: VLLM_USE_V1=1" in log
    assert "VLLM_USE_V1" in err  # and people are warned about it
    for text in (log, err):
        assert "hf_do_not_leak" not in text and "tok-do-not-log" not in text
    # lock released: a new serve can take the port at once
    dry = json.loads(sm70(serve_args("--dry-run", "--json"), env).stdout)
    assert {c["name"]: c["status"] for c in dry["checks"]}["port lock"] == "pass"


def test_server_stops_when_supervisor_is_killed(env: dict[str, str], tmp_path: Path) -> None:
    port = int(env["SM70_PORT"])
    proc = start_serve(env, tmp_path, "--allow-cold")
    try:
        assert wait_file(tmp_path / "serve.stderr", "ready after")
        server_pid = int((tmp_path / "starts.txt").read_text().split()[1])
        proc.send_signal(signal.SIGKILL)  # no clean-up possible in the supervisor
        proc.wait(timeout=10)
        end = time.monotonic() + 15
        while time.monotonic() < end and (alive(server_pid) or not port_is_free(port)):
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert port_is_free(port)
    assert not alive(server_pid)
    dry = json.loads(sm70(serve_args("--dry-run", "--json"), env).stdout)
    assert {c["name"]: c["status"] for c in dry["checks"]}["port lock"] == "pass"


def test_server_dying_at_start_reports_log_tail(env: dict[str, str], tmp_path: Path) -> None:
    env["FAKE_MODE"] = "die"
    r = sm70(serve_args("--allow-cold"), env, timeout=60)
    assert r.returncode == 1
    assert "exited with code 3 while starting" in r.stderr
    assert "CUDA out of memory (simulated)" in r.stderr
    assert port_is_free(int(env["SM70_PORT"]))


def test_sigkill_after_grace_if_sigterm_ignored(env: dict[str, str], tmp_path: Path) -> None:
    env.update({"FAKE_MODE": "ignore_term", "SM70_SHUTDOWN_GRACE": "1s"})
    proc = start_serve(env, tmp_path, "--allow-cold")
    try:
        assert wait_file(tmp_path / "serve.stderr", "ready after")
        server_pid = int((tmp_path / "starts.txt").read_text().split()[1])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "serve.stderr").read_text()
    assert "ignoring SIGTERM" in err and "SIGKILL" in err
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)
    assert port_is_free(int(env["SM70_PORT"]))


def test_restart_with_backoff(env: dict[str, str], tmp_path: Path) -> None:
    env.update({"FAKE_EXIT_AFTER": "0.5", "SM70_RESTART_BACKOFF_MAX": "1s"})
    proc = start_serve(env, tmp_path, "--allow-cold", "--restart")
    try:
        end = time.monotonic() + 40
        while starts(tmp_path / "starts.txt") < 3 and time.monotonic() < end:
            time.sleep(0.2)
        assert starts(tmp_path / "starts.txt") >= 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "serve.stderr").read_text()
    assert "restarting in 1s (consecutive failures: 1)" in err
    assert "restarting in 1s (consecutive failures: 2)" in err
    assert port_is_free(int(env["SM70_PORT"]))


def test_without_restart_a_dead_server_fails(env: dict[str, str], tmp_path: Path) -> None:
    env["FAKE_EXIT_AFTER"] = "0.5"
    r = sm70(serve_args("--allow-cold"), env, timeout=60)
    assert r.returncode == 1
    assert "exited with code 1" in r.stderr and "exiting on purpose" in r.stderr
    assert starts(tmp_path / "starts.txt") == 1


def test_memory_plan_overflow_refuses(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    env.update({"SM70_LOCK_DIR": str(tmp_path / "l"), "SM70_CACHE_DIR": str(tmp_path / "c"),
                "SM70_KV_CACHE_BYTES": "20GiB"})
    dry = json.loads(sm70(["serve", "--dry-run", "--json"], env).stdout)
    plan = next(c for c in dry["checks"] if c["name"] == "memory plan")
    assert plan["status"] == "fail" and "KV cache pool overflows" in plan["detail"]
    env["SM70_KV_CACHE_BYTES"] = "9.9GiB"
    dry = json.loads(sm70(["serve", "--dry-run", "--json"], env).stdout)
    plan = next(c for c in dry["checks"] if c["name"] == "memory plan")
    assert plan["status"] == "pass"


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["hangup", "term"])
def test_secrets_file_is_private_and_removed_on_stop(env: dict[str, str], tmp_path: Path,
                                                     sig: signal.Signals) -> None:
    port = int(env["SM70_PORT"])
    env["SM70_API_KEY"] = "key-do-not-leak"
    env["FAKE_PRINT_CONFIG"] = "1"  # the server prints the key it read: masked in our log
    secrets = tmp_path / "locks" / f"serve-{port}.secrets.yaml"
    proc = start_serve(env, tmp_path, "--allow-cold")
    try:
        assert wait_file(tmp_path / "serve.stderr", "ready after"), \
            (tmp_path / "serve.stderr").read_text()
        server_pid = int((tmp_path / "starts.txt").read_text().split()[1])
        assert secrets.stat().st_mode & 0o777 == 0o600
        assert "key-do-not-leak" in secrets.read_text()
        proc.send_signal(sig)  # SIGHUP: the terminal or SSH session went away
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not secrets.exists()
    assert not alive(server_pid) and port_is_free(port)
    log = (tmp_path / "logs" / f"serve-{port}.log").read_text()
    assert f"received {sig.name}" in log
    assert 'fake vllm: args from --config: api-key: "***"' in log
    for text in (log, (tmp_path / "serve.stderr").read_text()):
        assert "key-do-not-leak" not in text


def test_stop_signal_before_the_start_starts_nothing(env: dict[str, str], tmp_path: Path) -> None:
    # A signal caught between pre-flight and the supervisor (the secrets file's window)
    # stops serve cleanly without starting a server.
    import threading

    from sm70ctl.output import Output
    from sm70ctl.runtime.command_line import vllm_argv
    from sm70ctl.serve.command import _launch
    from sm70ctl.settings import load_settings

    settings = load_settings(environ=env, env_file=CPU_ENV)
    stop = threading.Event()
    stop.set()
    code = _launch(settings, Output(True), vllm_argv(settings), {}, env, [], False, {},
                   tmp_path / "locks" / "x.lock", stop, ["SIGHUP"])
    assert code == 0
    assert starts(tmp_path / "starts.txt") == 0
    log = (tmp_path / "logs" / f"serve-{env['SM70_PORT']}.log").read_text()
    assert "received SIGHUP before the start; nothing started" in log


@pytest.mark.parametrize("setting", ["SM70_LOCK_DIR", "SM70_LOG_DIR"])
def test_unwritable_folders_are_one_line_naming_the_setting(env: dict[str, str], tmp_path: Path,
                                                           setting: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env[setting] = str(blocker)
    env["SM70_API_KEY"] = "key-do-not-leak"
    r = sm70(serve_args("--allow-cold"), env)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert f"{setting}={blocker}" in r.stderr and "must be a folder" in r.stderr
    assert starts(tmp_path / "starts.txt") == 0
    assert not list(tmp_path.rglob("*.secrets.yaml"))
    assert port_is_free(int(env["SM70_PORT"]))
