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
The run and its readers are tests/gpu/ops_job.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ops_job

ERR_KEYS = ("sm70_volta_rel_err_vs_fla", "sm70_native_rel_err_vs_fla",
            "two_pass_volta_rel_err_vs_fla", "two_pass_native_rel_err_vs_fla",
            "two_pass_vs_one_pass_max_abs")


def row_figures(row: dict[str, Any]) -> dict[str, Any]:
    """One bench_gdn_chunk row's figures: its ms and TFLOP/s, its speed-up against FLA's
    prep + chunk, the Volta path's fraction of the m8n8k4 ceiling, and on the FLA row the
    errors of ours against it (pure)."""
    fig = {f"{row['impl']}_ms": row.get("ms"), f"{row['impl']}_tflops": row.get("tflops")}
    if row.get("speedup_vs_fla") is not None:
        fig[f"{row['impl']}_speedup_vs_fla"] = row["speedup_vs_fla"]
    if row["impl"] == "sm70_volta":
        fig["volta_frac_of_m8n8k4_peak"] = row.get("frac_of_m8n8k4_peak")
    fig.update({key: row[key] for key in ERR_KEYS if key in row})
    return fig


def bench_figures(bench: dict[str, Any]) -> dict[str, Any]:
    """Per case (tokens x sequences) each impl's ms and TFLOP/s, the Volta path's fraction
    of the m8n8k4 ceiling, speed-ups against FLA's prep + chunk, and errors (pure)."""
    return ops_job.bench_figures(bench, lambda row: f"{row.get('tokens')}x{row.get('seqs', 1)}",
                                 row_figures)


JOB = ops_job.OpsJob(
    name="gdn_chunk", what="GDN chunked prefill: GPU tests, bench, mutant",
    tests="tests/gpu/test_gdn_chunk_gpu.py",
    mutants=("gdn-chunk-decay-one-token-late", "gdn-two-pass-decay-one-token-late"),
    mutant_s=400.0,  # two whole-extension builds, then their tests
    tokens="8192,32768", figures=bench_figures, record_error_maxima=True)


def main(argv: list[str] | None = None) -> int:
    return ops_job.main(JOB, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
