"""One engine of the GDN A/B in its own process (GPU machine): vLLM 0.22.1 on a tiny checkpoint,
stock or with our GDN layer (vllm_patch.gdn), CUDA graphs (FULL_AND_PIECEWISE).

    python3 gdn_side.py --side ours --model DIR --out SIDE.json [--spec mtp3]
        [--prefix-caching] [--plugin-config JSON] [--phases p100,p4k,p32k,batch16,prefix]

The engine settings and per-request records are tests/gpu/ab/ab_side.py's (`engine_kwargs`,
`run_phase`, `summarize_model`): fp16, TRITON_ATTN, vLLM's GDN prefill forced to FLA's
Triton kernels (`gdn_prefill_backend` triton, also on the H200), greedy 64 tokens with top-2
log-probs. Phases (`plan`): one ~100-, one ~4K- and one ~32K-token prompt alone (the 32K one
is prefilled in 2048-token chunks, each a step with a prefill row and, from the second on,
an initial state), ab_side's batch16 (short prompts decode while long ones are still
prefilled: steps of decode and prefill rows together) and its prefix batches (prefixes
shared around one and two attention blocks; served from the cache with --prefix-caching).
The "ours" side counts our steps on the device (`layer.count_on_device`), so CUDA-graph
replays count too; the JSON has those counts, the Python-side route counts (`layer.CALLS`:
prefill steps run eagerly, so each one is counted there), which chunk op each prefill step
ran and the decode / MTP rows it carried (`layer.PREFILL_OPS`), the plugin's report and the class
of every GDN layer the model built.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "ab"))

from ab_side import (  # noqa: E402
    NEW_TOKENS,
    _drafter_summary,
    _spec_metrics,
    engine_kwargs,
    prefix_batches,
    prompts,
    run_phase,
    summarize_model,
)

MAX_LEN = 33792  # a 32K prompt and its 64 new tokens
MAX_BATCHED = 2048
LONG_LENS = {"p100": 100, "p4k": 4000, "p32k": 32000}
PHASES = "p100,p4k,p32k,batch16,prefix"


def long_prompt(n: int, seed: int, vocab_cap: int = 1024) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_cap) for _ in range(n)]


def plan(phases: list[str]) -> dict[str, list[list[list[int]]]]:
    """Each phase's batches of prompts (the same on every side)."""
    out: dict[str, list[list[list[int]]]] = {}
    for i, phase in enumerate(phases):
        if phase in LONG_LENS:
            out[phase] = [[long_prompt(LONG_LENS[phase], 100 + i)]]
        elif phase == "batch16":
            out[phase] = [prompts()]
        elif phase == "prefix":
            out[phase] = prefix_batches()
        else:
            raise SystemExit(f"--phases: unknown phase {phase!r}; known: {PHASES}")
    return out


def gdn_layer_classes(model: Any) -> dict[str, int]:
    """How many modules of each GDN layer class the model holds."""
    counts: dict[str, int] = {}
    for _, mod in model.named_modules():
        name = type(mod).__name__
        if "GatedDeltaNet" in name:
            key = f"{type(mod).__module__}.{name}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["stock", "ours"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phases", default=PHASES)
    ap.add_argument("--util", type=float, default=0.05)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--spec", choices=["none", "mtp3"], default="none",
                    help="mtp3: MTP speculative decoding with 3 draft tokens")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="prefix caching on (mamba_cache_mode align)")
    ap.add_argument("--plugin-config", default="",
                    help="ours only: SM70_PLUGIN_CONFIG JSON for this engine")
    a = ap.parse_args()
    phases = a.phases.split(",")
    batches = plan(phases)
    if a.side == "ours" and a.plugin_config:  # read by the plugin when vLLM loads it
        os.environ["SM70_PLUGIN_CONFIG"] = a.plugin_config
    res: dict[str, Any] = {"side": a.side, "model": a.model, "phases": {},
                           "phase_seconds": {}, "phase_errors": {}, "error": None}

    def flush() -> None:
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(a.out)

    t0 = time.time()
    layer = None

    def counts() -> None:
        if layer is not None:
            res["gdn_calls"] = dict(layer.CALLS)
            res["gdn_prefill_ops"] = dict(layer.PREFILL_OPS)
            res["gdn_device_calls"] = layer.device_counts()
            res["gdn_unsupported"] = dict(layer.REASONS)
            res["gdn_prefill_mode"] = layer.prefill_mode()

    try:
        from vllm import LLM, SamplingParams

        if a.side == "ours":
            from vllm_patch.gdn import layer

            layer.count_on_device(True)
        kw = engine_kwargs(a.model, "graphs", MAX_BATCHED, MAX_LEN, a.kv_gib, a.util,
                           prefix_caching=a.prefix_caching)
        if a.spec == "mtp3":
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 3}
            kw["disable_log_stats"] = False  # vLLM's spec-decode counters
        res["engine_kwargs"] = kw
        llm = LLM(**copy.deepcopy(kw))  # vLLM writes objects into the dicts it gets
        res["startup_s"] = round(time.time() - t0, 1)
        cfg = llm.llm_engine.vllm_config
        res["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
        res["block_size"] = cfg.cache_config.block_size
        res["mamba_ssm_cache_dtype"] = str(cfg.cache_config.mamba_ssm_cache_dtype)
        res["model_summary"] = llm.apply_model(summarize_model)[0]
        res["gdn_layer_classes"] = llm.apply_model(gdn_layer_classes)[0]
        if a.spec != "none":
            res["drafter"] = _drafter_summary(llm)
        res["plugin_imported"] = "vllm_patch.plugin" in sys.modules
        if res["plugin_imported"]:
            from vllm_patch.plugin import registered

            res["plugin"] = {k: str(v) for k, v in registered().items() if k != "config"}
        counts()  # the warm-up and capture runs, before any request
        res["gdn_calls_at_start"] = res.get("gdn_calls")
        flush()
        sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=2, detokenize=False)
        for phase in phases:
            t = time.time()
            try:
                rows: list[dict[str, Any]] = []
                for batch in batches[phase]:
                    rows += run_phase(llm, sp, batch)
                res["phases"][phase] = rows
            except Exception as exc:  # this phase's; the next one still runs
                res["phase_errors"][phase] = f"{type(exc).__name__}: {exc}"
                res.setdefault("tracebacks", {})[phase] = traceback.format_exc()[-3000:]
            res["phase_seconds"][phase] = round(time.time() - t, 2)
            counts()
            flush()
        if a.spec != "none":
            res["spec_metrics"] = _spec_metrics(llm)
        if "vllm_patch.quantization.sm70_gptq" in sys.modules:
            from vllm_patch.quantization.sm70_gptq import CALLS

            res["sm70_op_calls"] = dict(CALLS)
    except Exception as exc:  # the driver reports it; keep what ran
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-6000:]
    try:
        counts()
    except Exception as exc:  # a dead CUDA context cannot read the counters back
        res["gdn_counts_error"] = f"{type(exc).__name__}: {exc}"
    res["total_s"] = round(time.time() - t0, 1)
    flush()
    return 0 if res["error"] is None else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
