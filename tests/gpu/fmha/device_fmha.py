"""Device script of the FMHA prefill work (issue 22 item 1, the FMHA part of item 6).

    python3 tests/gpu/fmha/device_fmha.py --out OUT_DIR --budget-s N     (cwd = repo root)

Steps, each with its own time limit inside the budget, each recorded as soon as it ends:
1. the GPU tests: pytest -q -m gpu --noconftest -p no:cacheprovider tests/gpu/test_fmha_gpu.py
   (log fmha_tests.log, junit fmha_junit.xml, measured errors fmha_errors.jsonl);
2. bench/bench_fmha.py --out OUT_DIR/bench_fmha.json (and bench_fmha.md);
3. with budget left, the fmha mutant (tests/gpu/mutants.py --only fmha-mask-one-key-ahead,
   log fmha_mutant.log, mutant_fmha.json): the tests must kill it.
summary.json: {"passed": tests passed and every Volta bench row ran, ...key figures}.
The ops are the ones the orchestrator built (SM70_KERNELS_BUILD_DIR); no vLLM engine runs.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TESTS = "tests/gpu/test_fmha_gpu.py"
MUTANT = "fmha-mask-one-key-ahead"
MARGIN_S = 15.0  # kept back for writing the summary
MUTANT_S = 260.0  # the mutant step: a whole-extension build, then its tests


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


def bench_figures(bench: dict) -> dict:
    """The key figures of bench_fmha.json: peaks, and per token count each impl's TFLOP/s,
    the Volta path's fraction of the m8n8k4 ceiling, and errors (pure)."""
    per: dict[str, dict] = {}
    for row in bench.get("rows", []):
        entry = per.setdefault(str(row.get("tokens")), {})
        if "error" in row:
            entry[f"{row['impl']}_error"] = row["error"][:200]
            continue
        entry[f"{row['impl']}_tflops"] = row.get("tflops")
        if row["impl"] == "sm70_volta":
            entry["volta_frac_of_m8n8k4_peak"] = row.get("frac_of_m8n8k4_peak")
        if "rel_err_vs_sdpa" in row:
            entry["ours_rel_err_vs_sdpa"] = row["rel_err_vs_sdpa"]
    return {"peak_tflops": bench.get("peak_tflops"), "by_tokens": per,
            "errors": [e[:300] for e in bench.get("errors", [])][:10]}


def volta_rows_ok(bench: dict, tokens: list[int]) -> bool:
    """Every requested token count has a Volta row without an error (pure)."""
    done = {r.get("tokens") for r in bench.get("rows", [])
            if r.get("impl") == "sm70_volta" and "error" not in r}
    return all(t in done for t in tokens)


def run_step(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--budget-s", type=float, required=True, help="seconds for everything")
    ap.add_argument("--tokens", default="8192,16384,32768", help="bench token counts")
    args = ap.parse_args(argv)
    if args.budget_s <= MARGIN_S:
        ap.error(f"--budget-s {args.budget_s}: more than {MARGIN_S} s needed")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + args.budget_s - MARGIN_S
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                     else "")
    env["SM70_GPU_ERROR_LOG"] = str(out / "fmha_errors.jsonl")
    summary: dict = {"passed": None, "what": "FMHA prefill: GPU tests, bench, mutant",
                     "budget_s": args.budget_s, "steps": {}}

    def save() -> None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    save()
    py = sys.executable
    # 1. tests: at most half of the budget
    junit = out / "fmha_junit.xml"
    step = run_step(
        [py, "-m", "pytest", "-q", "-m", "gpu", "--noconftest", "-p", "no:cacheprovider", "-rf",
         f"--junitxml={junit}", TESTS],
        out / "fmha_tests.log", min(0.5 * args.budget_s, t_end - time.monotonic()), env)
    step["counts"] = junit_counts(junit)
    step["failed"] = failed_tests(junit)
    summary["steps"]["tests"] = step
    tests_ok = step["rc"] == 0 and step["counts"].get("passed", 0) > 0
    summary["tests_passed"] = tests_ok
    summary["passed"] = tests_ok
    save()

    # 2. bench: what is left, less a share for the mutant when there is room for it
    left = t_end - time.monotonic()
    bench_json = out / "bench_fmha.json"
    bench_s = left - MUTANT_S if left > 2 * MUTANT_S + 60 else left
    if bench_s > 20:
        step = run_step([py, "bench/bench_fmha.py", "--out", str(bench_json), "--tokens",
                         args.tokens, "--budget-s", str(max(bench_s - 20, 10))],
                        out / "bench_fmha.log", bench_s, env)
    else:
        step = {"rc": None, "skipped": f"{left:.0f} s left"}
    try:
        bench = json.loads(bench_json.read_text())
    except (OSError, ValueError):
        bench = {}
    step.update(bench_figures(bench))
    summary["steps"]["bench"] = step
    tokens = [int(x) for x in args.tokens.split(",") if x.strip()]
    summary["bench_volta_rows_ok"] = volta_rows_ok(bench, tokens)
    summary["passed"] = tests_ok and summary["bench_volta_rows_ok"]
    save()

    # 3. the mutant, if there is time for its build (about a minute) and its tests
    left = t_end - time.monotonic()
    if left > MUTANT_S - 20:
        work = out / "mutant_work"  # the mutated csrc copy and library, removed after
        menv = {**env, "SM70_MUTANTS_DIR": str(work)}
        step = run_step([py, "tests/gpu/mutants.py", "--only", MUTANT, "--jobs", "8", "--out",
                         str(out / "mutant_fmha.json")], out / "fmha_mutant.log", left, menv)
        step["killed"] = step["rc"] == 0
        for sub in ("lib", "csrc"):
            shutil.rmtree(work / MUTANT / sub, ignore_errors=True)
    else:
        step = {"rc": None, "skipped": f"{left:.0f} s left"}
    summary["steps"]["mutant"] = step
    save()
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
