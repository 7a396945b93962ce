"""The rules and the engine-process helpers the speculation drivers share
(tests/gpu/serving/spec_rules.py, device_io.py), on made-up engine results and on short
Python processes standing in for engines."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SERVING = Path(__file__).resolve().parent / "gpu" / "serving"
sys.path.insert(0, str(SERVING))
sys.path.insert(0, str(SERVING.parent / "ab"))
import device_io  # noqa: E402
import spec_rules as rules  # noqa: E402
from compare import compare_sides  # noqa: E402


def row(tokens: list[int]) -> dict[str, Any]:
    """A row in ab_side's format whose chosen token always leads by 1.0."""
    return {"tokens": tokens, "logprobs": [-0.1] * len(tokens),
            "top2": [[t, -0.1, t + 1, -1.1] for t in tokens]}


def engine(**phases: list[list[int]]) -> dict[str, Any]:
    return {"error": None, "startup_s": 1.5, "engine": {"block_size": 48},
            "phases": {ph: [row(t) for t in rows] for ph, rows in phases.items()}}


def test_progress_counts_phases_under_the_drivers_key() -> None:
    engines = {"E0": engine(seed=[[1, 2]], a=[[3]]), "E1": {"error": "ValueError: no"}}
    got = rules.progress(engines, ("E0", "E1", "E2"))
    assert got == {"E0": {"error": None, "startup_s": 1.5, "phases_done": 2},
                   "E1": {"error": "ValueError: no", "startup_s": None, "phases_done": 0},
                   "E2": {"error": None, "startup_s": None, "phases_done": 0}}
    assert rules.progress(engines, ("E0",), count_key="phases") == {
        "E0": {"error": None, "startup_s": 1.5, "phases": 2}}


def test_block_size_comes_from_the_first_engine_in_order_that_reported() -> None:
    engines = {"E2": {"engine": {"block_size": 64}}, "E1": {"engine": None},
               "E0": {"engine": {"block_size": 16}}}
    assert rules.first_block_size(engines, ("E1", "E2")) == ("E2", 64)
    assert rules.first_block_size(engines, ("E0", "E2")) == ("E0", 16)
    assert rules.first_block_size(engines, ("E1", "E3")) is None


def test_stage2_waits_for_the_reference_while_it_runs() -> None:
    engines = {"E1": engine(seed=[[5, 6]]), "E0": engine(seed=[])}
    running = rules.seed_order("E0", ("E0", "E1", "E2"), ref_running=True)
    assert running == ("E0",)
    assert rules.seed_source(engines, running) is None  # E1's output must not be taken
    gone = rules.seed_order("E0", ("E0", "E1", "E2"), ref_running=False)
    assert rules.seed_source(engines, gone) == ("E1", [5, 6])
    engines["E0"] = engine(seed=[[7, 8, 9]])
    assert rules.seed_source(engines, gone) == ("E0", [7, 8, 9])


def test_vs_reference_drops_rows_and_skips_engines_without_results() -> None:
    ref = engine(seed=[[1, 2, 3]], b=[[4, 5]])
    same = engine(seed=[[1, 2, 3]], b=[[4, 5]])
    off = engine(seed=[[1, 2, 3]], b=[[4, 9]])
    engines = {"E0": ref, "E1": same, "E2": off}
    got = rules.vs_reference(engines, "E0", ("E1", "E2", "E3"), compare_sides,
                             with_per_phase=True)
    assert set(got) == {"E1_vs_E0", "E2_vs_E0"}
    assert all("phases" not in c for c in got.values())
    assert got["E1_vs_E0"]["all_equal"] and got["E1_vs_E0"]["requests"] == 2
    assert not got["E2_vs_E0"]["all_equal"]
    assert got["E2_vs_E0"]["per_phase"]["b"]["equal"] == 0
    assert got["E2_vs_E0"]["per_phase"]["seed"] == {"equal": 1, "requests": 1,
                                                    "max_abs_dlogprob": 0.0}
    assert "per_phase" not in rules.vs_reference(engines, "E0", ("E1",), compare_sides)[
        "E1_vs_E0"]
    assert rules.vs_reference({"E1": same}, "E0", ("E1",), compare_sides) == {}


def _stand_in(name: str, kw: Path, result: Path) -> list[str]:
    """An 'engine' that writes its keyword arguments back (unless told to stay quiet), then
    sleeps if told to."""
    code = ("import json,sys,time; kw=json.load(open(sys.argv[1])); "
            "kw.get('quiet') or json.dump({'name': sys.argv[3], 'kw': kw}, "
            "open(sys.argv[2], 'w')); "
            "print('log of', sys.argv[3], flush=True); time.sleep(kw.get('sleep', 0))")
    return [sys.executable, "-c", code, str(kw), str(result), name]


def _start(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    fh = open(log_path, "w")  # noqa: SIM115 (closed with the process, as run_ab.start)
    return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)


def test_launch_snapshot_watch_and_stop(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    work.mkdir()
    for n in ("slow", "quiet"):  # an earlier call's results
        (work / f"{n}.json").write_text('{"stale": true}')
    configs = {"fast": {"x": 1}, "slow": {"x": 2, "sleep": 60}, "quiet": {"quiet": True}}
    envs: list[str] = []

    def env(name: str) -> dict[str, str]:
        envs.append(name)
        return {"PATH": "/usr/bin:/bin"}

    procs, files = device_io.launch(configs, work, _stand_in, env, _start)
    assert envs == ["fast", "slow", "quiet"]
    assert json.loads((work / "slow_kwargs.json").read_text()) == configs["slow"]
    engines: dict[str, Any] = {}
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.time())
        device_io.snapshot(out, work, files, engines)

    t0 = time.time()
    device_io.watch(procs, t0 + 2.0, tick, every_s=0.5)
    assert 2.0 <= time.time() - t0 < 10 and ticks  # the sleeper held it to the deadline
    assert procs["fast"].poll() == 0 and procs["slow"].poll() is None
    rcs = device_io.stop(procs, say=False)
    assert rcs["fast"] == 0 and rcs["slow"] not in (0, None)
    assert json.loads((out / "engines.json").read_text()) == {
        n: {"name": n, "kw": configs[n]} for n in ("fast", "slow")}  # nothing stale
    logs = (out / "logs.txt").read_text()
    assert "===== fast.log" in logs and "log of fast" in logs and "log of slow" in logs


def test_watch_returns_when_every_engine_is_done(tmp_path: Path) -> None:
    procs, _ = device_io.launch({"a": {}}, tmp_path, _stand_in, lambda n: {}, _start)
    t0 = time.time()
    device_io.watch(procs, t0 + 60, lambda: None, every_s=0.2)
    assert time.time() - t0 < 30


def test_read_engines_keeps_the_last_whole_result(tmp_path: Path) -> None:
    f = tmp_path / "e.json"
    engines: dict[str, Any] = {}
    f.write_text('{"phases": {"seed": []}}')
    device_io.read_engines({"e": f}, engines)
    f.write_text('{"phases": {"se')  # the engine is writing it
    device_io.read_engines({"e": f}, engines)
    assert engines == {"e": {"phases": {"seed": []}}}


def test_fresh_plan_dir_removes_an_earlier_calls_plans(tmp_path: Path) -> None:
    plans = tmp_path / "plans"
    plans.mkdir()
    (plans / "stage1.json").write_text("{}")
    assert device_io.fresh_plan_dir(tmp_path) == plans
    assert not list(plans.iterdir())


def test_finish_writes_the_verdict_or_the_judges_error(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    summary: dict[str, Any] = {"passed": None}
    flush = device_io.summary_writer(path, summary, time.time())
    assert device_io.finish(summary, flush, lambda: {"passed": True, "x": 1}) == 0
    assert json.loads(path.read_text())["x"] == 1
    summary = {"passed": None}
    flush = device_io.summary_writer(path, summary, time.time())

    def broken() -> dict[str, Any]:
        raise KeyError("rows")

    assert device_io.finish(summary, flush, broken) == 1
    got = json.loads(path.read_text())
    assert got["judge_error"] == "KeyError: 'rows'" and got["passed"] is None
    assert "elapsed_s" in got and "broken" in got["judge_traceback"]
