"""Device script of the GDN chunked prefill (issue 23 item 2's chunk kernel, item 6's bench).

    python3 tests/gpu/gdn_chunk/device_gdn_chunk.py --out OUT_DIR --budget-s N  (cwd = root)

Steps, each with its own time limit inside the budget, each recorded as soon as it ends:
1. the GPU tests: pytest -q -m gpu --noconftest -p no:cacheprovider
   tests/gpu/test_gdn_chunk_gpu.py (log gdn_chunk_tests.log, junit gdn_chunk_junit.xml,
   measured error / bound ratios gdn_chunk_errors.jsonl);
2. bench/bench_gdn_chunk.py --out OUT_DIR/bench_gdn_chunk.json (and .md);
3. with budget left, the mutants (tests/gpu/mutants.py --only gdn-chunk-decay-one-token-late
   gdn-two-pass-decay-one-token-late, log gdn_chunk_mutant.log, mutant_gdn_chunk.json): the
   tests must kill them.
summary.json: {"passed": tests passed and every Volta bench row ran, ...key figures}.
The ops are the ones the orchestrator built (SM70_KERNELS_BUILD_DIR); no vLLM engine runs.
The junit and step helpers are device_fmha.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "gpu" / "fmha"))

from device_fmha import failed_tests, junit_counts, run_step  # noqa: E402

TESTS = "tests/gpu/test_gdn_chunk_gpu.py"
MUTANTS = ("gdn-chunk-decay-one-token-late", "gdn-two-pass-decay-one-token-late")
MARGIN_S = 15.0  # kept back for writing the summary
MUTANT_S = 400.0  # the mutant step: two whole-extension builds, then their tests


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


def bench_figures(bench: dict) -> dict:
    """Per case (tokens x sequences) each impl's ms and TFLOP/s, the Volta path's fraction
    of the m8n8k4 ceiling, speed-ups against FLA's prep + chunk, and errors (pure)."""
    per: dict[str, dict] = {}
    for row in bench.get("rows", []):
        entry = per.setdefault(f"{row.get('tokens')}x{row.get('seqs', 1)}", {})
        if "error" in row:
            entry[f"{row['impl']}_error"] = row["error"][:200]
            continue
        entry[f"{row['impl']}_ms"] = row.get("ms")
        entry[f"{row['impl']}_tflops"] = row.get("tflops")
        if row.get("speedup_vs_fla") is not None:
            entry[f"{row['impl']}_speedup_vs_fla"] = row["speedup_vs_fla"]
        if row["impl"] == "sm70_volta":
            entry["volta_frac_of_m8n8k4_peak"] = row.get("frac_of_m8n8k4_peak")
        for key in ("sm70_volta_rel_err_vs_fla", "sm70_native_rel_err_vs_fla",
                    "two_pass_volta_rel_err_vs_fla", "two_pass_native_rel_err_vs_fla",
                    "two_pass_vs_one_pass_max_abs"):
            if key in row:
                entry[key] = row[key]
    return {"peak_tflops": bench.get("peak_tflops"), "by_tokens": per,
            "errors": [e[:300] for e in bench.get("errors", [])][:10]}


def volta_rows_ok(bench: dict, tokens: list[int]) -> bool:
    """Every requested token count has a one-sequence Volta row without an error (pure)."""
    done = {r.get("tokens") for r in bench.get("rows", [])
            if r.get("impl") == "sm70_volta" and r.get("seqs", 1) == 1 and "error" not in r}
    return all(t in done for t in tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--budget-s", type=float, required=True, help="seconds for everything")
    ap.add_argument("--tokens", default="8192,32768", help="bench token counts")
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
    errors_log = out / "gdn_chunk_errors.jsonl"
    env["SM70_GPU_ERROR_LOG"] = str(errors_log)
    summary: dict = {"passed": None, "what": "GDN chunked prefill: GPU tests, bench, mutant",
                     "budget_s": args.budget_s, "steps": {}}

    def save() -> None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    save()
    py = sys.executable
    # 1. tests: at most half of the budget
    junit = out / "gdn_chunk_junit.xml"
    step = run_step(
        [py, "-m", "pytest", "-q", "-m", "gpu", "--noconftest", "-p", "no:cacheprovider", "-rf",
         f"--junitxml={junit}", TESTS],
        out / "gdn_chunk_tests.log", min(0.5 * args.budget_s, t_end - time.monotonic()), env)
    step["counts"] = junit_counts(junit)
    step["failed"] = failed_tests(junit)
    step["error_over_bound_max"] = error_maxima(errors_log)
    summary["steps"]["tests"] = step
    tests_ok = step["rc"] == 0 and step["counts"].get("passed", 0) > 0
    summary["tests_passed"] = tests_ok
    summary["passed"] = tests_ok
    save()

    # 2. bench: what is left, less a share for the mutant when there is room for it
    left = t_end - time.monotonic()
    bench_json = out / "bench_gdn_chunk.json"
    bench_s = left - MUTANT_S if left > 2 * MUTANT_S + 60 else left
    if bench_s > 20:
        step = run_step([py, "bench/bench_gdn_chunk.py", "--out", str(bench_json), "--tokens",
                         args.tokens, "--budget-s", str(max(bench_s - 20, 10))],
                        out / "bench_gdn_chunk.log", bench_s, env)
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

    # 3. the mutant, if there is time for its build and its tests
    left = t_end - time.monotonic()
    if left > MUTANT_S - 20:
        work = out / "mutant_work"  # the mutated csrc copy and library, removed after
        menv = {**env, "SM70_MUTANTS_DIR": str(work)}
        step = run_step([py, "tests/gpu/mutants.py", "--only", *MUTANTS, "--jobs", "8", "--out",
                         str(out / "mutant_gdn_chunk.json")], out / "gdn_chunk_mutant.log",
                        left, menv)
        step["killed"] = step["rc"] == 0
        for name in MUTANTS:
            for sub in ("lib", "csrc"):
                shutil.rmtree(work / name / sub, ignore_errors=True)
    else:
        step = {"rc": None, "skipped": f"{left:.0f} s left"}
    summary["steps"]["mutant"] = step
    save()
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
