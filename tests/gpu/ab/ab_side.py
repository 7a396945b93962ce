"""One side of the A/B in its own process: vLLM 0.22.1 on one checkpoint in one mode.

`--side stock` runs vLLM as released (the driver starts it with VLLM_PLUGINS="" and without
our package on the path); `--side ours` runs it with the sm70 plugin (VLLM_PLUGINS=sm70, the
installed dist-info). Both: fp16, TRITON_ATTN, int8_per_token_head KV, vLLM's own GDN (Triton
prefill), chunked prefill with small chunks, greedy decoding of 64 new tokens with the top-2
log-probs of every step. The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING
=0) so the layer methods and our op's call counts can be read here.

Phases (each written to the JSON as soon as it finishes, so a killed run keeps its data):
  single   4 prompts, one at a time (decode rows M = 1: the GEMV)
  batch4   4 prompts together (M = 4)
  batch16  16 mixed prompts together: 8 short, 8 long enough to be chunked (M up to 16, and
           prefill chunks through the int8 GEMM)
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NEW_TOKENS = 64
SHORT = [5, 9, 17, 33, 64, 100, 150, 200]
LONG = [600, 1100, 1500, 2000, 2600, 3000, 700, 1300]
CAPTURE_SIZES = [1, 2, 4, 8, 16]


def prompts(seed: int = 0, vocab_cap: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_cap) for _ in range(n)] for n in SHORT + LONG]


def engine_kwargs(
    model: str, mode: str, max_batched: int, max_len: int = 4096, kv_gib: float = 2,
    util: float = 0.18, attention_backend: str = "TRITON_ATTN", prefix_caching: bool = False,
) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        model=model,
        dtype="float16",
        kv_cache_dtype="int8_per_token_head",
        attention_backend=attention_backend,
        additional_config={"gdn_prefill_backend": "triton"},
        limit_mm_per_prompt={"image": 0, "video": 0},
        max_model_len=max_len,
        max_num_seqs=16,
        max_num_batched_tokens=max_batched,
        enable_chunked_prefill=True,
        enable_prefix_caching=prefix_caching,
        gpu_memory_utilization=util,
        kv_cache_memory_bytes=int(kv_gib * 1024**3),
        seed=0,
    )
    if prefix_caching:  # a hybrid model caches GDN state only in align mode
        kw["mamba_cache_mode"] = "align"
    if mode == "eager":
        kw["enforce_eager"] = True
    else:
        kw["compilation_config"] = {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                    "cudagraph_capture_sizes": CAPTURE_SIZES}
    return kw


def summarize_model(model: Any) -> dict[str, Any]:
    """Which method every layer with a quant_method got, and the parameter bytes."""
    methods: dict[str, int] = {}
    examples: dict[str, str] = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            continue
        key = f"{type(mod).__name__}:{type(qm).__name__}"
        methods[key] = methods.get(key, 0) + 1
        examples.setdefault(key, name)
    params = {}
    for p in model.parameters():
        params[str(p.dtype)] = params.get(str(p.dtype), 0) + p.numel() * p.element_size()
    lm = getattr(getattr(model, "language_model", model), "lm_head", None)
    return {"methods": methods, "examples": examples, "param_bytes_by_dtype": params,
            "lm_head_method": type(getattr(lm, "quant_method", None)).__name__}


def summarize_attention(model: Any) -> dict[str, int]:
    """Which backend and impl class each attention layer got (a silent fallback shows)."""
    from vllm.model_executor.layers.attention.attention import Attention

    out: dict[str, int] = {}
    for _name, mod in model.named_modules():
        if not isinstance(mod, Attention):
            continue
        backend = mod.attn_backend
        key = f"{backend.__module__}.{backend.__qualname__}:{type(mod.impl).__qualname__}"
        out[key] = out.get(key, 0) + 1
    return out


# Shared prefixes ending just before, on and just after one and two blocks of the tiny
# model's 528-token attention block (vLLM aligns it to the GDN page), and one in between:
# the reference met silent corruption with align mode + MTP + prefix caching there.
PREFIX_LENS = [527, 528, 529, 1055, 1056, 1057, 1300]


def prefix_batches(seed: int = 7, vocab_cap: int = 1024) -> list[list[list[int]]]:
    """Per prefix: one request alone (it fills the cache), then three that share its prefix
    (one of them the prefix itself) together."""
    rng = random.Random(seed)
    out: list[list[list[int]]] = []
    for n in PREFIX_LENS:
        pre = [rng.randrange(vocab_cap) for _ in range(n)]
        tails = [[rng.randrange(vocab_cap) for _ in range(k)] for k in (9, 40, 200)]
        out.append([pre + tails[0]])
        out.append([pre + tails[1], pre, pre + tails[2]])
    return out


def _drafter_summary(llm: Any) -> dict[str, Any] | None:
    """The MTP drafter's linear layers and their methods, read in this process."""
    try:
        core = llm.llm_engine.engine_core
        core = getattr(core, "engine_core", core)
        worker = core.model_executor.driver_worker
        worker = getattr(worker, "worker", worker)
        drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
        model = getattr(drafter, "model", None)
        if model is None:
            return {"error": "no drafter model found"}
        return {"drafter": type(drafter).__name__, **summarize_model(model)}
    except Exception as exc:  # evidence only: the comparison stands without it
        return {"error": f"{type(exc).__name__}: {exc}"}


def _spec_metrics(llm: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens)."""
    out: dict[str, Any] = {}
    try:
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                out[m.name] = getattr(m, "value", None) if hasattr(m, "value") else str(m)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def run_phase(llm: Any, sp: Any, batch: list[list[int]]) -> list[dict[str, Any]]:
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
    rows = []
    for p, o in zip(batch, outs, strict=True):
        c = o.outputs[0]
        lps, top2 = [], []
        for tok, step in zip(c.token_ids, c.logprobs or [], strict=False):
            chosen = step.get(tok)
            lps.append(None if chosen is None else float(chosen.logprob))
            ranked = sorted(step.items(), key=lambda kv: -kv[1].logprob)
            first = ranked[0]
            second = ranked[1] if len(ranked) > 1 else (None, None)
            top2.append([first[0], float(first[1].logprob),
                         second[0], None if second[1] is None else float(second[1].logprob)])
        rows.append({"prompt_len": len(p), "tokens": list(c.token_ids), "logprobs": lps,
                     "top2": top2})
    return rows


def _exclusive_gpu(name: str) -> Iterator[float]:
    """Timed work runs alone on the GPU: wait until every peer (AB_PEERS processes) has
    started its engine (AB_READY_DIR holds one file per started side), then hold an
    exclusive lock until the generator is closed. Yields the seconds spent waiting."""
    ready = os.environ.get("AB_READY_DIR")
    if not ready:
        yield 0.0
        return
    import fcntl

    t = time.time()
    d = Path(ready)
    d.mkdir(parents=True, exist_ok=True)
    (d / name).touch()
    peers = int(os.environ.get("AB_PEERS", "1"))
    while len(list(d.iterdir())) < peers and time.time() - t < 300:
        time.sleep(1)
    with open(d.parent / "gpu.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield round(time.time() - t, 1)
        fcntl.flock(fh, fcntl.LOCK_UN)


def _bench_module(name: str) -> Any:
    """bench/<name>.py by file path: the bench modules import no vllm_patch (stock stays
    stock)."""
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["stock", "ours"], required=True)
    ap.add_argument("--mode", choices=["eager", "graphs"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-batched", type=int, default=512)
    ap.add_argument("--phases", default="single,batch4,batch16")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--kv-gib", type=float, default=2)
    ap.add_argument("--util", type=float, default=0.18)
    ap.add_argument("--bench", action="store_true", help="also bench/bench_vllm_decode.py")
    ap.add_argument("--quick-bench", action="store_true", help="the bench without b16 at 32K")
    ap.add_argument("--profile", action="store_true",
                    help="also bench/profile_vllm_ops.py (GPU time per op class)")
    ap.add_argument("--arch-path", choices=["native", "sm70"], default="native",
                    help="ours only: 'sm70' runs the Volta m8n8k4 instantiations (on the H200 "
                    "'native' is the sm_80+ timing code); correctness runs want sm70")
    ap.add_argument("--attention-backend", default="TRITON_ATTN",
                    help="vLLM's --attention-backend (ours: CUSTOM is the plugin's backend)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="prefix caching on (mamba_cache_mode align)")
    ap.add_argument("--spec", choices=["none", "mtp3"], default="none",
                    help="mtp3: MTP speculative decoding, 3 draft tokens (the drafter gets the "
                    "target's attention backend)")
    ap.add_argument("--plugin-config", default="",
                    help="ours only: SM70_PLUGIN_CONFIG JSON for this engine (e.g. the GDN layer)")
    a = ap.parse_args()
    if a.side == "ours" and a.plugin_config:  # read by the plugin when vLLM loads it, below
        os.environ["SM70_PLUGIN_CONFIG"] = a.plugin_config

    res: dict[str, Any] = {"side": a.side, "mode": a.mode, "model": a.model, "phases": {},
                           "phase_seconds": {}, "error": None}

    def flush() -> None:  # atomic: the driver copies it while this process runs
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(a.out)

    t0 = time.time()
    try:
        import torch
        from vllm import LLM, SamplingParams

        kw = engine_kwargs(a.model, a.mode, a.max_batched, a.max_len, a.kv_gib, a.util,
                           a.attention_backend, a.prefix_caching)
        if a.bench:
            kw["disable_log_stats"] = False  # per-request timestamps: the decode step
        if a.spec == "mtp3":
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 3,
                                        "attention_backend": a.attention_backend}
            kw["disable_log_stats"] = False  # vLLM's spec-decode counters
        if a.side == "ours" and a.attention_backend != "TRITON_ATTN":
            from vllm_patch.attention import backend as sm70_attention

            sm70_attention.count_on_device(True)  # graph replays count too
        gdn_layer = None
        wants_gdn = a.plugin_config and json.loads(a.plugin_config).get("gdn", {}).get(
            "decode_layer")
        if a.side == "ours" and wants_gdn:
            from vllm_patch.gdn import layer as gdn_layer

            gdn_layer.count_on_device(True)
        if a.side == "ours" and a.arch_path != "native":  # process-wide; the engine is here
            from vllm_patch.ops import kernels

            kernels.set_arch_path(a.arch_path)
            res["arch_path"] = kernels.arch_path()
        res["engine_kwargs"] = kw
        llm = LLM(**copy.deepcopy(kw))  # vLLM writes objects into the dicts it gets
        res["startup_s"] = round(time.time() - t0, 1)
        cfg = llm.llm_engine.vllm_config
        res["quantization"] = cfg.model_config.quantization
        res["quant_config"] = repr(cfg.quant_config)
        res["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
        res["capture_sizes"] = list(cfg.compilation_config.cudagraph_capture_sizes or [])
        res["model_summary"] = llm.apply_model(summarize_model)[0]
        res["attention_layers"] = llm.apply_model(summarize_attention)[0]
        res["block_size"] = cfg.cache_config.block_size
        if a.spec != "none":
            res["drafter"] = _drafter_summary(llm)
        res["plugin_imported"] = "vllm_patch.plugin" in sys.modules
        if res["plugin_imported"]:
            from vllm_patch.plugin import registered

            res["plugin"] = {k: str(v) for k, v in registered().items() if k != "config"}
        flush()
        gate = _exclusive_gpu(a.side + "_" + a.mode)
        res["waited_for_peers_s"] = next(gate)
        sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=2, detokenize=False)
        ps = prompts()
        plan = {"single": [[p] for p in ps[:4]], "batch4": [ps[4:8]], "batch16": [ps],
                "p100": [[ps[5]]], "p3000": [[ps[13]]], "prefix": prefix_batches()}
        for phase in a.phases.split(","):
            t = time.time()
            rows: list[dict[str, Any]] = []
            for batch in plan[phase]:
                rows += run_phase(llm, sp, batch)
            res["phases"][phase] = rows
            res["phase_seconds"][phase] = round(time.time() - t, 2)
            flush()
        if a.bench:
            bench = _bench_module("bench_vllm_decode")
            t = time.time()
            res["bench"] = bench.measure(llm, a.max_len, quick=a.quick_bench)
            res["phase_seconds"]["bench"] = round(time.time() - t, 2)
            flush()
        if a.profile:
            t = time.time()
            try:
                res["profile"] = _bench_module("profile_vllm_ops").measure(llm, a.max_len)
            except Exception as exc:  # the A/B and the bench above stand without it
                res["profile_error"] = f"{type(exc).__name__}: {exc}"
            res["phase_seconds"]["profile"] = round(time.time() - t, 2)
            flush()
        if "vllm_patch.quantization.sm70_gptq" in sys.modules:
            from vllm_patch.quantization.sm70_gptq import CALLS

            res["sm70_op_calls"] = dict(CALLS)
        if gdn_layer is not None:
            res["gdn_calls"] = dict(gdn_layer.CALLS)
            res["gdn_device_calls"] = gdn_layer.device_counts()
            res["gdn_unsupported"] = dict(gdn_layer.REASONS)
        if a.spec != "none":
            res["spec_metrics"] = _spec_metrics(llm)
        if "vllm_patch.attention.backend" in sys.modules:
            from vllm_patch.attention import backend as sm70_attention

            res["attention_calls"] = dict(sm70_attention.CALLS)
            res["attention_device_decodes"] = sm70_attention.device_decode_count()
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        next(gate, None)
    except Exception as exc:  # the driver reports it; keep what ran
        if os.environ.get("AB_READY_DIR"):  # a failed start must not hold its peers back
            Path(os.environ["AB_READY_DIR"]).mkdir(parents=True, exist_ok=True)
            (Path(os.environ["AB_READY_DIR"]) / f"{a.side}_{a.mode}").touch()
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-6000:]
    res["total_s"] = round(time.time() - t0, 1)
    flush()
    return 0 if res["error"] is None else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
