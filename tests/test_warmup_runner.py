"""The warmup on real processes: decisions (pure), then whole runs against the stand-in
server (it "compiles" into VLLM_CACHE_ROOT, once or on every start)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lock_holder import held_lock
from serve_fakes import alive, fake_env, free_port

from sm70ctl.runtime.manifest import DONE, FAILED, NOT_NEEDED, SKIPPED, Step
from sm70ctl.warmup.runner import Capabilities, is_warm, new_files, plan_steps

REPO = Path(__file__).resolve().parents[1]
CPU_ENV = REPO / "tests" / "e2e" / "cpu.env"


# --- pure decisions --------------------------------------------------------------------------
def caps(**over) -> Capabilities:
    base = dict(device="cuda", gpus_visible=2, gpus_needed=2)
    base.update(over)
    return Capabilities(**base)


def test_plan_full_gpu_machine() -> None:
    steps = plan_steps(caps())
    assert {k: v[0] for k, v in steps.items()} == {"kernels": "run", "vllm": "run",
                                                  "verify": "run"}


def test_plan_without_gpu_says_so_and_never_runs() -> None:
    steps = plan_steps(caps(gpus_visible=0, nvml_error="NVML Shared Library Not Found"))
    assert steps["kernels"][0] == SKIPPED and "no V100 here" in steps["kernels"][1]
    assert "NVML Shared Library Not Found" in steps["vllm"][1]
    assert steps["verify"][0] == SKIPPED
    steps = plan_steps(caps(gpus_visible=1))
    assert "1 visible, 2 needed" in steps["vllm"][1]


def test_plan_cpu() -> None:
    steps = plan_steps(caps(device="cpu", gpus_visible=0))
    assert steps["kernels"][0] == NOT_NEEDED
    assert steps["vllm"][0] == "run"
    eager = plan_steps(caps(device="cpu", enforce_eager=True))
    assert [v[0] for v in eager.values()] == [NOT_NEEDED] * 3


def test_plan_missing_model_or_python() -> None:
    steps = plan_steps(caps(model_ok=False))
    assert steps["vllm"][0] == SKIPPED and "SM70_MODEL_DIR" in steps["vllm"][1]
    steps = plan_steps(caps(serve_python_ok=False))
    assert steps["kernels"][0] == SKIPPED and steps["vllm"][0] == SKIPPED


def test_is_warm() -> None:
    assert is_warm([Step("a", DONE), Step("b", NOT_NEEDED)])
    assert not is_warm([Step("a", DONE), Step("b", SKIPPED)])
    assert not is_warm([Step("a", FAILED)])
    assert not is_warm([])
    assert new_files({"a"}, {"a", "c", "b"}) == ["b", "c"]


# --- whole runs ---------------------------------------------------------------------------------
def sm70(args: list[str], env: dict[str, str], timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "sm70ctl", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def warm_args(*extra: str) -> list[str]:
    return ["warmup", "--device", "cpu", "--env-file", str(CPU_ENV), *extra]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    # compile-on-start: a CPU run without --enforce-eager
    return fake_env(tmp_path, free_port(), SM70_ENFORCE_EAGER="false", FAKE_COMPILE="once",
                    FAKE_MARKER=str(tmp_path / "starts.txt"))


def test_warmup_then_check_warm(env: dict[str, str], tmp_path: Path) -> None:
    assert sm70(warm_args("--check"), env).returncode == 1
    r = sm70(warm_args("--json"), env)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["warm"] is True
    assert [(s["name"], s["status"]) for s in m["steps"]] == [
        ("kernels", NOT_NEEDED), ("vllm", DONE), ("verify", DONE)]
    entry = tmp_path / "cache" / m["fingerprint"]
    assert (entry / "vllm" / "torch_compile_cache" / "graph.bin").is_file()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".trash")]
    assert (tmp_path / "starts.txt").read_text().count("started") == 2  # build + fresh check
    chk = sm70(warm_args("--check", "--json"), env)
    assert chk.returncode == 0
    assert json.loads(chk.stdout)["warm"] is True
    # warm already: nothing is started again
    again = sm70(warm_args(), env)
    assert again.returncode == 0 and "already warm" in again.stderr
    assert (tmp_path / "starts.txt").read_text().count("started") == 2
    # serve now passes the cache check without --allow-cold
    dry = json.loads(sm70(["serve", "--device", "cpu", "--env-file", str(CPU_ENV), "--dry-run",
                           "--json"], env).stdout)
    cache = next(c for c in dry["checks"] if c["name"] == "compile cache")
    assert cache["status"] == "pass"
    assert dry["env"]["VLLM_CACHE_ROOT"] == str(entry / "vllm")
    # so does an inherited variable vLLM folds into its compile key
    chk = sm70(warm_args("--check"), {**env, "VLLM_SOME_KNOB": "1"})
    assert chk.returncode == 1 and "env:VLLM_SOME_KNOB: new (1)" in chk.stdout
    # a compile-affecting setting changes the answer, and the answer says which
    env["SM70_GDN_CHUNK_SIZE"] = "32"
    chk = sm70(warm_args("--check"), env)
    assert chk.returncode == 1
    assert "cold" in chk.stdout and "SM70_GDN_CHUNK_SIZE: 64 -> 32" in chk.stdout


def test_recompiling_cache_is_not_marked_warm(env: dict[str, str], tmp_path: Path) -> None:
    env["FAKE_COMPILE"] = "always"
    r = sm70(warm_args("--json"), env)
    assert r.returncode == 1
    m = json.loads(r.stdout)
    assert m["warm"] is False
    verify = m["steps"][-1]
    assert verify["status"] == FAILED and "recompiled in a fresh process: 1 new files" in \
        verify["detail"]
    chk = sm70(warm_args("--check"), env)
    assert chk.returncode == 1 and "verify failed" in chk.stdout


def test_no_gpu_warmup_says_what_it_could_not_do(env: dict[str, str], tmp_path: Path) -> None:
    env.update({"SM70_QUANTIZATION": "gptq"})
    r = sm70(["warmup", "--json"], env)
    assert r.returncode == 1
    m = json.loads(r.stdout)
    assert m["warm"] is False
    assert {s["name"]: s["status"] for s in m["steps"]} == {
        "kernels": SKIPPED, "vllm": SKIPPED, "verify": SKIPPED}
    assert "no V100 here" in m["steps"][0]["detail"]
    assert not (tmp_path / "starts.txt").exists()


def start_warmup_until_server_starts(env: dict[str, str], tmp_path: Path) -> subprocess.Popen:
    """A warmup whose fake server takes 60 s to come up, returned once that server started."""
    env["FAKE_STARTUP_DELAY"] = "60"
    proc = subprocess.Popen([sys.executable, "-m", "sm70ctl", *warm_args()], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 30
    while not (tmp_path / "starts.txt").exists():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the warmup never started its fake server (exit {proc.returncode}): "
                        f"{err[-2000:]}")
        time.sleep(0.1)
    return proc


def test_interrupted_warmup_leaves_nothing_half_built(env: dict[str, str], tmp_path: Path) -> None:
    proc = start_warmup_until_server_starts(env, tmp_path)
    try:
        building = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
        assert len(building) == 1 and not (building[0] / "manifest.json").exists()
        assert sm70(warm_args("--check"), env).returncode == 1  # in progress counts as cold
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    cache = tmp_path / "cache"
    assert [p.name for p in cache.iterdir()] == [".warmup.lock"]
    assert sm70(warm_args("--check"), env).returncode == 1


def test_concurrent_warmup_refused(env: dict[str, str], tmp_path: Path) -> None:
    with held_lock(tmp_path / "cache" / ".warmup.lock", "sm70ctl warmup") as holder:
        r = sm70(warm_args(), env)
        assert r.returncode == 1
        assert f"pid {holder.pid}" in r.stderr and "warmup" in r.stderr
    assert not (tmp_path / "starts.txt").exists()


def test_damaged_manifest_is_cold_and_rebuilt(env: dict[str, str], tmp_path: Path) -> None:
    r = sm70(warm_args("--json"), env)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "cache" / json.loads(r.stdout)["fingerprint"] / "manifest.json"
    good = json.loads(path.read_text())
    for text in ("[]", '"warm"', json.dumps({**good, "warm": "false"}),
                 json.dumps({**good, "steps": "done"}), "{cut sho"):
        path.write_text(text)
        chk = sm70(warm_args("--check", "--json"), env)
        assert chk.returncode == 1, text
        assert "Traceback" not in chk.stderr
        verdict = json.loads(chk.stdout)
        assert verdict["warm"] is False and "unreadable" in verdict["reason"], text
    # a manifest copied from another entry does not vouch for this one
    path.write_text(json.dumps({**good, "fingerprint": "0" * 16}))
    chk = sm70(warm_args("--check"), env)
    assert chk.returncode == 1 and "names another fingerprint" in chk.stdout
    # and a plain `warmup` (no --force) rebuilds the entry
    again = sm70(warm_args("--json"), env)
    assert again.returncode == 0, again.stderr
    rebuilt = json.loads(path.read_text())
    assert rebuilt["warm"] is True and rebuilt["fingerprint"] == good["fingerprint"]
    assert sm70(warm_args("--check"), env).returncode == 0


def test_hangup_during_warmup_leaves_nothing_half_built(env: dict[str, str],
                                                        tmp_path: Path) -> None:
    # A closed terminal (SIGHUP) is an interruption like Ctrl-C, not a sudden death.
    proc = start_warmup_until_server_starts(env, tmp_path)
    try:
        server_pid = int((tmp_path / "starts.txt").read_text().split()[1])
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".warmup.lock"]
    end = time.monotonic() + 10
    while time.monotonic() < end and alive(server_pid):
        time.sleep(0.1)
    assert not alive(server_pid)



def test_kernel_build_child_gets_no_secrets(tmp_path: Path) -> None:
    from sm70ctl.settings import load_settings
    from sm70ctl.warmup.runner import RunContext, _run_kernels

    dump = tmp_path / "env.json"
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, os\n"
                    f"open({str(dump)!r}, 'w').write(json.dumps(dict(os.environ)))\n")
    fake.chmod(0o755)
    environ = {"PATH": "/usr/bin:/bin", "SM70_HF_TOKEN": "hf_do_not_leak",
               "SM70_API_KEY": "key-do-not-leak", "SM70_SERVE_PYTHON": str(fake),
               "SM70_CACHE_DIR": str(tmp_path / "cache")}
    settings = load_settings(environ=environ)
    step = _run_kernels(RunContext(settings=settings, device="cuda", environ=environ),
                        tmp_path / "entry")
    assert step.status == DONE, step.detail
    seen = json.loads(dump.read_text())
    assert seen["SM70_KERNELS_BUILD_DIR"] == str(tmp_path / "entry" / "kernels")
    assert "hf_do_not_leak" not in dump.read_text() and "key-do-not-leak" not in dump.read_text()
    assert not [k for k in seen if k.startswith("SM70_") and k != "SM70_KERNELS_BUILD_DIR"]


def test_cache_dir_that_is_a_file_is_one_line(env: dict[str, str], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env["SM70_CACHE_DIR"] = str(blocker)
    r = sm70(warm_args(), env)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"SM70_CACHE_DIR={blocker}" in r.stderr


def test_force_warmup_refuses_an_entry_a_server_runs_on(env: dict[str, str],
                                                        tmp_path: Path) -> None:
    assert sm70(warm_args(), env).returncode == 0
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    err = open(tmp_path / "serve.stderr", "w")  # noqa: SIM115 - closed below
    serve = subprocess.Popen([sys.executable, "-m", "sm70ctl", "serve", "--device", "cpu",
                              "--env-file", str(CPU_ENV)], env=env, stdout=subprocess.PIPE,
                             stderr=err, text=True)
    try:
        end = time.monotonic() + 30
        while "ready after" not in (tmp_path / "serve.stderr").read_text():
            if serve.poll() is not None or time.monotonic() > end:
                state = "exited" if serve.poll() is not None else "still not ready"
                pytest.fail(f"sm70ctl serve {state} without reporting ready: "
                            + (tmp_path / "serve.stderr").read_text()[-2000:])
            time.sleep(0.2)
        r = sm70(warm_args("--force"), env)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert f"in use by sm70ctl serve (pid {serve.pid} on port {env['SM70_PORT']})" \
            in r.stderr
        assert (entry / "manifest.json").is_file()  # the live entry is untouched
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
        err.close()
    assert sm70(warm_args("--force"), env).returncode == 0  # nothing serves from it now
