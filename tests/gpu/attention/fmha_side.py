"""One side of the FMHA-route A/B in its own process (tests/gpu/attention/device_backend_ab.py
starts four): vLLM 0.22.1 on the tiny fp16 checkpoint, stock (TRITON_ATTN) or ours with the
SM70 backend and SM70_PREFILL_ATTENTION=cutlass_fmha (the plugin config), so every prefill
chunk and extend of the attention layer runs torch.ops.sm70.fmha_prefill on TRITON_ATTN's
260-byte-row page.

The engine is tests/gpu/ab/ab_side.py's (engine_kwargs, run_phase, summarize_attention: fp16,
int8_per_token_head KV, chunked prefill, greedy 64 tokens with top-2 log-probs); only the
prompts and the budget of one step differ:
  p100  one ~100-token prompt alone (one chunk, no context)
  p4k   one ~4K-token prompt alone, chunked by max_num_batched_tokens (1024): the later
        chunks read their context from the int8 page
  mix   8 short prompts beside 3 long ones (1.5K-3.9K): the shorts decode while the longs'
        chunks prefill, so steps mix decode rows and FMHA prefill rows
  prefix  (with --prefix-caching, align mode) ab_side's shared prefixes of 527-1300 tokens
        around the 528-token block: a request that hits the cache starts with a context
        of whole cached blocks that other requests wrote
Each phase is written to the JSON as soon as it finishes (the shape ab_side writes, so
compare.compare_sides reads both). Ours also records the backend's call counters and the
device counters of the decode and FMHA routes (graph replays count there).

    python3 fmha_side.py --side ours --mode graphs --model DIR --out side.json --fmha
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

AB = Path(__file__).resolve().parents[1] / "ab"
sys.path.insert(0, str(AB))

from ab_side import engine_kwargs, prefix_batches, run_phase, summarize_attention  # noqa: E402

FMHA_CONFIG = '{"attention": {"prefill_kernel": "cutlass_fmha"}}'  # SM70_PLUGIN_CONFIG
P100 = 100
P4K = 4000
MIX_SHORT = [5, 9, 17, 33, 64, 100, 150, 200]
MIX_LONG = [1500, 2600, 3900]
MAX_LEN = 4352  # the 4K prompt plus 64 new tokens, rounded up
MAX_BATCHED = 1024  # chunks the 4K prompt into four


def phase_prompts(seed: int = 11, vocab_cap: int = 1024) -> dict[str, list[list[list[int]]]]:
    """Per phase, its batches of token-id prompts (the same on both sides: a fixed seed)."""
    rng = random.Random(seed)

    def p(n: int) -> list[int]:
        return [rng.randrange(vocab_cap) for _ in range(n)]

    return {"p100": [[p(P100)]], "p4k": [[p(P4K)]],
            "mix": [[p(n) for n in MIX_SHORT + MIX_LONG]], "prefix": prefix_batches()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["stock", "ours"], required=True)
    ap.add_argument("--mode", choices=["eager", "graphs"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-batched", type=int, default=MAX_BATCHED)
    ap.add_argument("--max-len", type=int, default=MAX_LEN)
    ap.add_argument("--kv-gib", type=float, default=1)
    ap.add_argument("--util", type=float, default=0.05)
    ap.add_argument("--phases", default=None,
                    help="default p100,p4k,mix (and prefix with --prefix-caching)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="prefix caching on (mamba_cache_mode align)")
    ap.add_argument("--arch-path", choices=["native", "sm70"], default="native",
                    help="ours only: 'sm70' runs the Volta m8n8k4 instantiations")
    ap.add_argument("--fmha", action="store_true",
                    help="ours only: the SM70 backend with SM70_PREFILL_ATTENTION=cutlass_fmha")
    a = ap.parse_args()
    ours = a.side == "ours"
    if ours and a.fmha:  # read by the plugin when vLLM loads it, below
        os.environ["SM70_PLUGIN_CONFIG"] = FMHA_CONFIG

    res: dict[str, Any] = {"side": a.side, "mode": a.mode, "model": a.model, "phases": {},
                           "phase_seconds": {}, "error": None, "fmha": ours and a.fmha}

    def flush() -> None:  # atomic: the driver reads it while this process runs
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(a.out)

    t0 = time.time()
    backend = None
    try:
        import torch
        from vllm import LLM, SamplingParams

        kw = engine_kwargs(a.model, a.mode, a.max_batched, a.max_len, a.kv_gib, a.util,
                           "CUSTOM" if ours and a.fmha else "TRITON_ATTN", a.prefix_caching)
        if ours and a.fmha:
            from vllm_patch.attention import backend

            backend.count_on_device(True)  # graph replays count too
        if ours and a.arch_path != "native":  # process-wide; the engine runs here
            from vllm_patch.ops import kernels

            kernels.set_arch_path(a.arch_path)
            res["arch_path"] = kernels.arch_path()
        res["engine_kwargs"] = kw
        llm = LLM(**copy.deepcopy(kw))  # vLLM writes objects into the dicts it gets
        res["startup_s"] = round(time.time() - t0, 1)
        cfg = llm.llm_engine.vllm_config
        res["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
        res["capture_sizes"] = list(cfg.compilation_config.cudagraph_capture_sizes or [])
        res["block_size"] = cfg.cache_config.block_size
        res["attention_layers"] = llm.apply_model(summarize_attention)[0]
        res["plugin_imported"] = "vllm_patch.plugin" in sys.modules
        if backend is not None:
            res["prefill_kernel"] = backend.prefill_kernel()
            res["calls_after_startup"] = dict(backend.CALLS)
        flush()
        sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2,
                            detokenize=False)
        plan = phase_prompts()
        phases = a.phases or ("p100,p4k,mix" + (",prefix" if a.prefix_caching else ""))
        for phase in phases.split(","):
            t = time.time()
            rows: list[dict[str, Any]] = []
            for batch in plan[phase]:
                rows += run_phase(llm, sp, batch)
            res["phases"][phase] = rows
            res["phase_seconds"][phase] = round(time.time() - t, 2)
            if backend is not None:
                res["attention_calls"] = dict(backend.CALLS)
                res["attention_device"] = {r: backend.device_count(r)
                                           for r in backend.DEVICE_ROUTES}
            flush()
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    except Exception as exc:  # the driver reports it; keep what ran
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-6000:]
    res["total_s"] = round(time.time() - t0, 1)
    flush()
    return 0 if res["error"] is None else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
