"""Decode step and prefill time inside real vLLM 0.22.1: our plugin (int8) vs stock (fp16).

Measured by `tests/gpu/ab/ab_side.py --bench` in each side's own process (same engine as the
A/B, CUDA graphs on): for each (batch, context) case, the same prompts are generated twice,
once with 1 new token and once with 1 + STEPS; the decode step is the difference divided by
STEPS (prefill and scheduling start-up cancel out). Prefix caching is off, so each call
prefills again. The prefill case is the time to the first token of one long prompt.

`python bench/bench_vllm_decode.py SIDES_JSON [--out bench/results/h200_vllm_decode.json]`
turns the two sides' rows into the JSON and the table (ours / stock per case). On the H200
these figures say whether our kernels keep up inside vLLM; the V100 figures are what count.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import md_table, write_json

STEPS = 32
DECODE_CASES = [(1, 1024), (4, 1024), (16, 1024), (1, 32768), (16, 32768)]
QUICK_CASES = [(1, 1024), (4, 1024), (16, 1024), (1, 32768)]
PREFILL_LEN = 8192


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(length)] for _ in range(batch)]


def _timed(llm: Any, prompts: list[Any], sp: Any) -> tuple[float, list[Any]]:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t, outs


def engine_step_ms(outs: list[Any]) -> float | None:
    """Mean decode step from vLLM's own per-request timestamps (first to last new token,
    engine-core clock), or None without request stats (disable_log_stats). Unlike the
    difference of two runs it carries no prefill noise: at 32K of context one prefill
    varies by more than 32 decode steps take."""
    steps = []
    for o in outs:
        m = getattr(o, "metrics", None)
        n = getattr(m, "num_generation_tokens", 0) if m is not None else 0
        if n > 1 and m.last_token_ts > m.first_token_ts > 0:
            steps.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    return round(sum(steps) / len(steps) * 1e3, 3) if steps else None


def measure(
    llm: Any, max_model_len: int, seed: int = 1, quick: bool = False
) -> list[dict[str, Any]]:
    """Rows {case, batch, context, seconds...} for every case that fits max_model_len;
    quick: without batch 16 at 32K (half a million prefill tokens twice)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    many = SamplingParams(temperature=0.0, max_tokens=1 + STEPS, ignore_eos=True,
                          detokenize=False)
    rows: list[dict[str, Any]] = []
    warm = [TokensPrompt(prompt_token_ids=p) for p in _prompts(1, 64, seed)]
    _timed(llm, warm, many)  # first-call costs (allocator, lazy init) out of the figures
    for batch, ctx in QUICK_CASES if quick else DECODE_CASES:
        if ctx + 1 + STEPS > max_model_len:
            continue
        ps = [TokensPrompt(prompt_token_ids=p) for p in _prompts(batch, ctx, seed + ctx)]
        t1, _ = _timed(llm, ps, one)
        t2, outs = _timed(llm, ps, many)
        by_diff = round((t2 - t1) / STEPS * 1e3, 3)
        by_engine = engine_step_ms(outs)
        rows.append({"case": f"decode b{batch} ctx{ctx}", "batch": batch, "context": ctx,
                     "prefill_s": round(t1, 4),
                     "step_ms": by_engine if by_engine is not None else by_diff,
                     "step_ms_source": "engine timestamps" if by_engine is not None
                     else "difference of two runs", "step_ms_by_difference": by_diff})
    if max_model_len > PREFILL_LEN:
        ps = [TokensPrompt(prompt_token_ids=p) for p in _prompts(1, PREFILL_LEN, seed + 7)]
        _timed(llm, ps, one)  # the first long prompt compiles/tunes its chunk shapes
        t, _ = _timed(llm, ps, one)
        rows.append({"case": f"prefill {PREFILL_LEN}", "batch": 1, "context": PREFILL_LEN,
                     "prefill_s": round(t, 4)})
    return rows


def combine(stock: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case with both sides' figures and ours / stock."""
    by_case = {r["case"]: r for r in stock}
    out = []
    for r in ours:
        s = by_case.get(r["case"])
        if s is None:
            continue
        key = "step_ms" if "step_ms" in r else "prefill_s"
        ratio = r[key] / s[key] if s[key] else None
        out.append({"case": r["case"], "metric": key, "stock": s[key], "ours": r[key],
                    "ours_over_stock": None if ratio is None else round(ratio, 3)})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    return md_table(("case", "metric", "stock", "ours", "ours/stock"),
                    [(r["case"], r["metric"], r["stock"], r["ours"], r["ours_over_stock"])
                     for r in rows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sides", type=Path, help="sides_<shape>.json from tests/gpu/ab/run_ab.py")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--mode", default="graphs")
    a = ap.parse_args()
    sides = json.loads(a.sides.read_text())
    stock = sides.get(f"stock_{a.mode}", {}).get("bench") or []
    ours = sides.get(f"ours_{a.mode}", {}).get("bench") or []
    rows = combine(stock, ours)
    if not rows:
        print(f"no bench rows for mode {a.mode} in {a.sides}", file=sys.stderr)
        return 1
    print(table(rows))
    if a.out:
        write_json(a.out, {"mode": a.mode, "steps": STEPS, "rows": rows, "stock": stock,
                           "ours": ours})
    return 0


if __name__ == "__main__":
    sys.exit(main())
