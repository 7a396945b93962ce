"""Sweep `compute_plan` over card sizes and memory settings: what fits where.

Prints one JSON document (with --json) or a rich table: for each GPU pair and variant, the
longest single sequence (KV pool tokens, with the pool taking what the budget leaves), the
sequences of 32K at once, and how long computing the plan took. Projections from shapes,
not measurements on GPUs.

    python bench/bench_plan.py [--json]
"""

from __future__ import annotations

import sys
import time

from sm70ctl.output import Output, make_table
from sm70ctl.plan.gpus import parse_gpus
from sm70ctl.plan.model_config import builtin_config_path, load_config
from sm70ctl.plan.plan import PlanInputs, compute_plan

GPUS = ["2x16GiB", "2x24GiB", "2xv100", "2x32GiB", "2x48GiB"]
# The first variants are the served path (what vLLM 0.22.1 allocates today); the "target"
# ones plan the not-yet-served design of issue 23 (int16 state, split pools, x8 slots).
VARIANTS = {
    "reference (pool auto)": {},
    "target: int16 state, split pools": {"path": "target"},
    "target: fp32 state, split pools": {"path": "target", "gdn_state_dtype": "float32"},
    "target: int16 state, unified pool": {"path": "target", "split_pools": False},
    "no MTP": {"spec_method": "none"},
    "text only, no MTP": {"spec_method": "none", "limit_images": 0, "limit_videos": 0},
    "Clef on": {"clef": True},
}


def main() -> None:
    model = load_config(builtin_config_path())
    rows = []
    for spec in GPUS:
        gpus = parse_gpus(spec)
        for name, change in VARIANTS.items():
            inputs = PlanInputs(**{"kv_cache_bytes": 0, "max_model_len": 1, **change})
            t0 = time.perf_counter()
            plan = compute_plan(model, inputs, gpus)
            ms = (time.perf_counter() - t0) * 1000
            ok = plan.overflow is None
            rows.append({
                "gpus": spec,
                "variant": name,
                "pool_bytes": plan.gpus[0].layout.pool_bytes if ok else 0,
                "longest_sequence": plan.longest_sequence if ok else 0,
                "seqs_at_32k": plan.concurrency(32_768)["sequences"] if ok else 0,
                "holds_262144": ok and plan.longest_sequence >= 262_144,
                "plan_ms": round(ms, 2),
            })
    out = Output("--json" in sys.argv)
    out.emit({"rows": rows, "projected": "computed by sm70ctl plan; not measured"},
             lambda c: c.print(make_table(
                 "Longest sequence by card size (pool = what the 0.96 budget leaves)",
                 ["GPUs", "variant", "pool GiB", "longest seq", "32K seqs", "262,144", "ms"],
                 [[r["gpus"], r["variant"], f"{r['pool_bytes'] / 2**30:.2f}",
                   f"{r['longest_sequence']:,}", r["seqs_at_32k"],
                   "yes" if r["holds_262144"] else "no", r["plan_ms"]] for r in rows])))


if __name__ == "__main__":
    main()
