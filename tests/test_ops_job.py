"""The ops-only device jobs' shared run (tests/gpu/ops_job.py) through the two drivers, with
a stand-in for each step's process and a stopped clock: which commands run with which time
limits, what each step records, and when the bench and the mutants are left out."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu" / "fmha"))
sys.path.insert(0, str(ROOT / "tests" / "gpu" / "gdn_chunk"))

import device_fmha  # noqa: E402
import device_gdn_chunk  # noqa: E402
import ops_job  # noqa: E402

JUNIT = ('<testsuites><testsuite tests="3" failures="{f}" errors="0" skipped="0">'
         '<testcase name="a"/></testsuite></testsuites>')


class _Steps:
    """Each step's process: the pytest one writes its junit and error log, the bench one its
    JSON with a Volta row per token count; every call recorded."""

    def __init__(self, tests_fail: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.tests_fail = tests_fail

    def __call__(self, cmd: list[str], log: Path, timeout: float,
                 env: dict[str, str]) -> dict[str, Any]:
        self.calls.append({"cmd": cmd, "log": log.name, "timeout": timeout, "env": env})
        if "pytest" in cmd:
            junit = Path(next(c for c in cmd if c.startswith("--junitxml=")).split("=", 1)[1])
            junit.write_text(JUNIT.format(f=int(self.tests_fail)))
            Path(env["SM70_GPU_ERROR_LOG"]).write_text('{"metric": "m", "value": 0.25}\n')
            return {"rc": int(self.tests_fail), "seconds": 1.0, "timed_out": False}
        if "--tokens" in cmd:
            tokens = cmd[cmd.index("--tokens") + 1].split(",")
            rows = [{"tokens": int(t), "seqs": 1, "impl": "sm70_volta", "tflops": 1.0}
                    for t in tokens]
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({"rows": rows}))
        return {"rc": 0, "seconds": 2.0, "timed_out": False}


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> _Steps:
    s = _Steps()
    monkeypatch.setattr(ops_job, "run_step", s)
    monkeypatch.setattr(ops_job, "time", types.SimpleNamespace(monotonic=lambda: 100.0))
    return s


def test_gdn_chunk_job_runs_tests_bench_and_mutants(tmp_path: Path, steps: _Steps) -> None:
    assert device_gdn_chunk.main(["--out", str(tmp_path), "--budget-s", "1000"]) == 0
    tests, bench, mutant = steps.calls
    assert tests["cmd"][-2:] == [f"--junitxml={tmp_path}/gdn_chunk_junit.xml",
                                 "tests/gpu/test_gdn_chunk_gpu.py"]
    assert (tests["log"], tests["timeout"]) == ("gdn_chunk_tests.log", 500.0)
    assert tests["env"]["SM70_GPU_ERROR_LOG"] == str(tmp_path / "gdn_chunk_errors.jsonl")
    assert tests["env"]["PYTHONPATH"].split(":")[0] == str(ops_job.ROOT)
    # 985 s left: the bench gets all but the mutants' 400 s, and 20 s less for itself
    assert bench["cmd"][1:] == ["bench/bench_gdn_chunk.py", "--out",
                                str(tmp_path / "bench_gdn_chunk.json"), "--tokens",
                                "8192,32768", "--budget-s", "565.0"]
    assert (bench["log"], bench["timeout"]) == ("bench_gdn_chunk.log", 585.0)
    assert mutant["cmd"][1:5] == ["tests/gpu/mutants.py", "--only",
                                  "gdn-chunk-decay-one-token-late",
                                  "gdn-two-pass-decay-one-token-late"]
    assert mutant["env"]["SM70_MUTANTS_DIR"] == str(tmp_path / "mutant_work")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == ["passed", "what", "budget_s", "steps", "tests_passed",
                             "bench_volta_rows_ok"]
    assert summary["passed"] and summary["tests_passed"] and summary["bench_volta_rows_ok"]
    assert summary["steps"]["tests"]["counts"]["passed"] == 3
    assert summary["steps"]["tests"]["error_over_bound_max"] == {"m": 0.25}
    assert summary["steps"]["bench"]["by_tokens"]["8192x1"]["sm70_volta_tflops"] == 1.0
    assert summary["steps"]["mutant"] == {"rc": 0, "seconds": 2.0, "timed_out": False,
                                          "killed": True}


def test_fmha_job_with_failed_tests_and_a_short_budget(tmp_path: Path, steps: _Steps) -> None:
    steps.tests_fail = True
    # 250 s left: too little to set the mutant's 260 s aside, enough (20 s short) to run it
    assert device_fmha.main(["--out", str(tmp_path), "--budget-s", "265"]) == 1
    tests, bench, mutant = steps.calls
    assert tests["cmd"][-1] == "tests/gpu/test_fmha_gpu.py" and tests["timeout"] == 132.5
    assert bench["cmd"][-4:] == ["--tokens", "8192,16384,32768", "--budget-s", "230.0"]
    assert mutant["cmd"][3:4] == ["fmha-mask-one-key-ahead"]
    assert mutant["log"] == "fmha_mutant.log"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["passed"] and not summary["tests_passed"]
    assert summary["bench_volta_rows_ok"]
    assert "error_over_bound_max" not in summary["steps"]["tests"]


def test_bench_and_mutants_left_out_without_time(tmp_path: Path, steps: _Steps) -> None:
    assert device_fmha.main(["--out", str(tmp_path), "--budget-s", "30"]) == 1
    assert len(steps.calls) == 1  # the tests only
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"]["bench"]["skipped"] == "15 s left"
    assert summary["steps"]["mutant"] == {"rc": None, "skipped": "15 s left"}
    assert summary["tests_passed"] and not summary["bench_volta_rows_ok"]
    # 235 s left: the bench runs, the fmha mutant (260 s, 20 s of slack) does not
    steps.calls.clear()
    assert device_fmha.main(["--out", str(tmp_path), "--budget-s", "250"]) == 0
    assert len(steps.calls) == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"]["mutant"] == {"rc": None, "skipped": "235 s left"}
