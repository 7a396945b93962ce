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
The run and its readers are tests/gpu/ops_job.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ops_job


def row_figures(row: dict[str, Any]) -> dict[str, Any]:
    """One bench_fmha row's figures: its TFLOP/s, the Volta path's fraction of the m8n8k4
    ceiling, and our error against SDPA on the SDPA row (pure)."""
    fig = {f"{row['impl']}_tflops": row.get("tflops")}
    if row["impl"] == "sm70_volta":
        fig["volta_frac_of_m8n8k4_peak"] = row.get("frac_of_m8n8k4_peak")
    if "rel_err_vs_sdpa" in row:
        fig["ours_rel_err_vs_sdpa"] = row["rel_err_vs_sdpa"]
    return fig


def bench_figures(bench: dict[str, Any]) -> dict[str, Any]:
    """The key figures of bench_fmha.json: peaks, and per token count each impl's TFLOP/s,
    the Volta path's fraction of the m8n8k4 ceiling, and errors (pure)."""
    return ops_job.bench_figures(bench, lambda row: str(row.get("tokens")), row_figures)


JOB = ops_job.OpsJob(
    name="fmha", what="FMHA prefill: GPU tests, bench, mutant", tests="tests/gpu/test_fmha_gpu.py",
    mutants=("fmha-mask-one-key-ahead",),
    mutant_s=260.0,  # a whole-extension build, then its tests
    tokens="8192,16384,32768", figures=bench_figures)


def main(argv: list[str] | None = None) -> int:
    return ops_job.main(JOB, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
