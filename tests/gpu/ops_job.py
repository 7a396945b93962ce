"""The run the ops-only device scripts share (tests/gpu/fmha/device_fmha.py,
tests/gpu/gdn_chunk/device_gdn_chunk.py), and the readers of what its steps leave behind.

Steps, each with its own time limit inside the budget, each recorded in OUT/summary.json as
soon as it ends (every file named after the job, <name> below):
1. the GPU tests: pytest -q -m gpu --noconftest -p no:cacheprovider <the job's test file>
   (log <name>_tests.log, junit <name>_junit.xml, measured errors <name>_errors.jsonl);
2. bench/bench_<name>.py --out OUT/bench_<name>.json (and its .md), log bench_<name>.log;
3. with budget left, the job's mutants (tests/gpu/mutants.py --only ..., log
   <name>_mutant.log, mutant_<name>.json): the tests must kill them.
summary.json: {"passed": tests passed and every Volta bench row ran, "what", "budget_s",
"steps": {"tests", "bench", "mutant"}, "tests_passed", "bench_volta_rows_ok"}.
The ops are the ones the orchestrator built (SM70_KERNELS_BUILD_DIR); no vLLM engine runs.
No torch here: the CPU tests import the drivers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARGIN_S = 15.0  # kept back for writing the summary


# ------------------------------------------------------------------ readers (pure but for I/O)
def junit_counts(path: Path) -> dict[str, int]:
    """tests / failures / errors / skipped summed over a junit XML file's suites (pure
    apart from reading the file); {} when it is missing or unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for key in out:
            out[key] += int(s.get(key, 0))
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


def failed_tests(path: Path, limit: int = 20) -> list[str]:
    """Names of failed or erroring test cases in a junit XML file (at most `limit`)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    names = [case.get("name", "?") for case in root.iter("testcase")
             if case.find("failure") is not None or case.find("error") is not None]
    return names[:limit]


def error_maxima(path: Path) -> dict[str, float]:
    """The largest value per metric in a JSON-lines error log ({} when absent; pure apart
    from reading the file)."""
    out: dict[str, float] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
            out[rec["metric"]] = max(out.get(rec["metric"], 0.0), float(rec["value"]))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def bench_figures(bench: dict[str, Any], case_key: Callable[[dict[str, Any]], str],
                  row_figures: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """The key figures of a bench JSON (pure): per case (case_key of its rows) each row's
    row_figures, or for a row that failed its impl's error; the peaks and the first errors."""
    per: dict[str, dict[str, Any]] = {}
    for row in bench.get("rows", []):
        entry = per.setdefault(case_key(row), {})
        if "error" in row:
            entry[f"{row['impl']}_error"] = row["error"][:200]
            continue
        entry.update(row_figures(row))
    return {"peak_tflops": bench.get("peak_tflops"), "by_tokens": per,
            "errors": [e[:300] for e in bench.get("errors", [])][:10]}


def volta_rows_ok(bench: dict[str, Any], tokens: list[int]) -> bool:
    """Every requested token count has a one-sequence Volta row without an error (a row
    without "seqs" is one sequence; pure)."""
    done = {r.get("tokens") for r in bench.get("rows", [])
            if r.get("impl") == "sm70_volta" and r.get("seqs", 1) == 1 and "error" not in r}
    return all(t in done for t in tokens)


# ------------------------------------------------------------------ the steps
def run_step(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Run one command with its output in `log`; rc, seconds and whether it timed out."""
    t0 = time.monotonic()
    with log.open("w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                  timeout=max(timeout, 1.0), check=False)
            rc, timed_out = proc.returncode, False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        except OSError as exc:
            fh.write(f"could not start: {exc!r}\n")
            rc, timed_out = None, False
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "timed_out": timed_out}


@dataclass(frozen=True)
class OpsJob:
    """What one ops-only device job runs; the rest of the run is the same for every job."""

    name: str  # the prefix of the files it writes; its bench is bench/bench_<name>.py
    what: str  # summary.json's "what"
    tests: str  # the GPU test file, from the repository root
    mutants: tuple[str, ...]  # tests/gpu/mutants.py --only
    mutant_s: float  # the mutant step's share of the budget: its builds, then their tests
    tokens: str  # the default --tokens of the bench
    figures: Callable[[dict[str, Any]], dict[str, Any]]  # bench JSON -> the step's figures
    record_error_maxima: bool = False  # the tests step also records the error log's maxima


def step_env(errors_log: Path) -> dict[str, str]:
    """The steps' environment: this one, unbuffered, the repository first on PYTHONPATH,
    the GPU tests' measured errors to `errors_log`."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                     else "")
    env["SM70_GPU_ERROR_LOG"] = str(errors_log)
    return env


def tests_step(job: OpsJob, out: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """The job's GPU tests, with their junit counts and failed names."""
    junit = out / f"{job.name}_junit.xml"
    step = run_step(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--noconftest", "-p",
         "no:cacheprovider", "-rf", f"--junitxml={junit}", job.tests],
        out / f"{job.name}_tests.log", timeout, env)
    step["counts"] = junit_counts(junit)
    step["failed"] = failed_tests(junit)
    if job.record_error_maxima:
        step["error_over_bound_max"] = error_maxima(Path(env["SM70_GPU_ERROR_LOG"]))
    return step


def bench_step(job: OpsJob, out: Path, left: float, tokens: str,
               env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's bench in what is left, less the mutant's share when there is room for it;
    (the step with the bench's figures, the bench JSON or {})."""
    bench_json = out / f"bench_{job.name}.json"
    bench_s = left - job.mutant_s if left > 2 * job.mutant_s + 60 else left
    if bench_s > 20:
        step = run_step([sys.executable, f"bench/bench_{job.name}.py", "--out", str(bench_json),
                         "--tokens", tokens, "--budget-s", str(max(bench_s - 20, 10))],
                        out / f"bench_{job.name}.log", bench_s, env)
    else:
        step = {"rc": None, "skipped": f"{left:.0f} s left"}
    try:
        bench = json.loads(bench_json.read_text())
    except (OSError, ValueError):
        bench = {}
    step.update(job.figures(bench))
    return step, bench


def mutant_step(job: OpsJob, out: Path, left: float, env: dict[str, str]) -> dict[str, Any]:
    """The job's mutants, if there is time for their builds and tests; killed when
    mutants.py says every one was."""
    if left <= job.mutant_s - 20:
        return {"rc": None, "skipped": f"{left:.0f} s left"}
    work = out / "mutant_work"  # the mutated csrc copies and libraries, removed after
    menv = {**env, "SM70_MUTANTS_DIR": str(work)}
    step = run_step([sys.executable, "tests/gpu/mutants.py", "--only", *job.mutants, "--jobs",
                     "8", "--out", str(out / f"mutant_{job.name}.json")],
                    out / f"{job.name}_mutant.log", left, menv)
    step["killed"] = step["rc"] == 0
    for name in job.mutants:
        for sub in ("lib", "csrc"):
            shutil.rmtree(work / name / sub, ignore_errors=True)
    return step


def main(job: OpsJob, doc: str, argv: list[str] | None = None) -> int:
    """The driver's command line (`doc`: its docstring), then the three steps; 0 when the
    tests passed and every Volta bench row ran."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--budget-s", type=float, required=True, help="seconds for everything")
    ap.add_argument("--tokens", default=job.tokens, help="bench token counts")
    args = ap.parse_args(argv)
    if args.budget_s <= MARGIN_S:
        ap.error(f"--budget-s {args.budget_s}: more than {MARGIN_S} s needed")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + args.budget_s - MARGIN_S
    env = step_env(out / f"{job.name}_errors.jsonl")
    summary: dict[str, Any] = {"passed": None, "what": job.what, "budget_s": args.budget_s,
                               "steps": {}}

    def save() -> None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    save()
    # 1. tests: at most half of the budget
    step = tests_step(job, out, min(0.5 * args.budget_s, t_end - time.monotonic()), env)
    summary["steps"]["tests"] = step
    tests_ok = step["rc"] == 0 and step["counts"].get("passed", 0) > 0
    summary["tests_passed"] = tests_ok
    summary["passed"] = tests_ok
    save()

    # 2. bench
    step, bench = bench_step(job, out, t_end - time.monotonic(), args.tokens, env)
    summary["steps"]["bench"] = step
    tokens = [int(x) for x in args.tokens.split(",") if x.strip()]
    summary["bench_volta_rows_ok"] = volta_rows_ok(bench, tokens)
    summary["passed"] = tests_ok and summary["bench_volta_rows_ok"]
    save()

    # 3. the mutants
    summary["steps"]["mutant"] = mutant_step(job, out, t_end - time.monotonic(), env)
    save()
    return 0 if summary["passed"] else 1
