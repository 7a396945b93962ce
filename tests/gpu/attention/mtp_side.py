"""One engine of the MTP set of the backend A/B (tests/gpu/attention/device_backend_ab.py,
`--set mtp`), in its own process: vLLM 0.22.1 on the tiny fp16 checkpoint, CUDA graphs
(FULL_AND_PIECEWISE), max_model_len 33,792, chunked prefill by 2,048-token steps (the
launcher's SM70_MAX_NUM_BATCHED_TOKENS).

  --side stock --spec mtp3 --prefix-caching    stock TRITON_ATTN, MTP k=3, prefix caching
  --side ours  --spec mtp3 --prefix-caching    SM70_PAGED (CUSTOM), Triton prefill
  ... --fmha                                   the same with SM70_PREFILL_ATTENTION=cutlass_fmha
  --side ours                                  SM70_PAGED without speculation or prefix
                                               caching: the plain-decoding reference

With MTP the capture sizes are the launcher's 4..64 (1-16 sequences of 1 + k rows) and the
drafter gets the target's attention backend; our plugin's defaults are on (R7, R8 and the
n-gram assist). Phases (the same prompts on every side, fixed seeds), each written to the
JSON as soon as it finishes:
  p100      a ~100-token prompt alone
  mix       8 short prompts decoding (1 + k verification rows) beside 3 long ones whose
            chunks prefill in the same steps
  p4k       a ~4K-token prompt alone (two chunks)
  p32k      a ~32.7K-token prompt alone (16 chunks; its later chunks read ~30K tokens of
            context from the int8 page, its decode reads all of it)
  p32k_hit  the p32k prompt's first 32,000 tokens plus a new 40-token tail: with prefix
            caching ~60 cached blocks of 528 tokens, then a decode over 32K of context
            (right after p32k, before other prompts can evict those blocks)
  prefix    ab_side's shared prefixes of 527-1300 tokens around the 528-token block (with
            prefix caching the later requests start from cached blocks)
  loop      a 48-token prompt continued for 512 tokens: a random model's greedy output falls
            into loops, so the assist's n-gram drafts can be accepted (rows 2-4 of the
            verification step then decide tokens; MTP alone accepts nothing on random
            weights)
Besides the rows (ab_side's format plus vLLM's num_cached_tokens) each phase records the
cumulative backend counters (CALLS, the device counters) and the step kinds the builder
saw (step_kinds.py), and vLLM's spec-decode and prefix-cache counters.

    python3 mtp_side.py --side ours --model DIR --out side.json --spec mtp3 --prefix-caching
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
AB = HERE.parent / "ab"
SERVING = HERE.parent / "serving"
for _p in (str(AB), str(SERVING), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from ab_side import engine_kwargs, prefix_batches, run_phase, summarize_attention  # noqa: E402

FMHA_CONFIG = '{"attention": {"prefill_kernel": "cutlass_fmha"}}'  # SM70_PLUGIN_CONFIG
K = 3  # draft tokens (the launcher's SM70_SPEC_TOKENS default)
SPEC_CAPTURE_SIZES = [4, 8, 16, 32, 64]  # 1-16 sequences of 1 + K rows (the launcher's)
PLAIN_CAPTURE_SIZES = [1, 2, 4, 8, 16]
MAX_LEN = 33792
MAX_BATCHED = 2048
NEW_TOKENS = 64
LOOP_NEW_TOKENS = 512
P32K = 32700  # not a multiple of the 528-token block: the last block is partly filled
P32K_SHARED = 32000
MIX_SHORT = [5, 9, 17, 33, 64, 100, 150, 200]
MIX_LONG = [1500, 2600, 3900]
PHASES = ("p100", "mix", "p4k", "p32k", "p32k_hit", "prefix", "loop")
COUNTER_KEYS = ("spec_decode", "prefix_cache")


def phase_prompts(seed: int = 23, vocab_cap: int = 1024) -> dict[str, list[list[list[int]]]]:
    """Per phase, its batches of token-id prompts (the same on every side)."""
    rng = random.Random(seed)

    def p(n: int) -> list[int]:
        return [rng.randrange(vocab_cap) for _ in range(n)]

    long = p(P32K)
    return {"p100": [[p(100)]], "mix": [[p(n) for n in MIX_SHORT + MIX_LONG]],
            "p4k": [[p(4000)]], "p32k": [[long]], "prefix": prefix_batches(),
            "p32k_hit": [[long[:P32K_SHARED] + p(40)]], "loop": [[p(48)]]}


def max_tokens(phase: str) -> int:
    return LOOP_NEW_TOKENS if phase == "loop" else NEW_TOKENS


def side_kwargs(model: str, ours: bool, spec: bool, prefix_caching: bool, kv_gib: float,
                util: float) -> dict[str, Any]:
    """The engine's keyword arguments: ab_side's (fp16, int8_per_token_head, chunked prefill)
    in graph mode, with the backend, MTP and the capture sizes of this set."""
    backend = "CUSTOM" if ours else "TRITON_ATTN"
    kw = engine_kwargs(model, "graphs", MAX_BATCHED, MAX_LEN, kv_gib, util, backend,
                       prefix_caching)
    kw["compilation_config"]["cudagraph_capture_sizes"] = (
        SPEC_CAPTURE_SIZES if spec else PLAIN_CAPTURE_SIZES)
    kw["disable_log_stats"] = False  # the spec-decode and prefix-cache counters
    kw["async_scheduling"] = False  # the launcher's default
    if spec:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": K,
                                    "attention_backend": backend}
    return kw


def _drafter_attention(worker: Any) -> dict[str, int] | None:
    """The MTP drafter's attention layers by backend class (None without a drafter)."""
    worker = getattr(worker, "worker", worker)  # a wrapper holds the worker
    runner = getattr(worker, "model_runner", None)
    model = getattr(getattr(runner, "drafter", None), "model", None)
    return None if model is None else summarize_attention(model)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["stock", "ours"], required=True)
    ap.add_argument("--mode", choices=["graphs"], default="graphs")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kv-gib", type=float, default=2)
    ap.add_argument("--util", type=float, default=0.05)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--spec", choices=["none", "mtp3"], default="none")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="prefix caching on (mamba_cache_mode align)")
    ap.add_argument("--arch-path", choices=["native", "sm70"], default="native",
                    help="ours only: 'sm70' runs the Volta m8n8k4 instantiations")
    ap.add_argument("--fmha", action="store_true",
                    help="ours only: SM70_PREFILL_ATTENTION=cutlass_fmha (plugin config)")
    a = ap.parse_args()
    ours = a.side == "ours"
    spec = a.spec == "mtp3"
    if ours and a.fmha:  # read by the plugin when vLLM loads it, below
        os.environ["SM70_PLUGIN_CONFIG"] = FMHA_CONFIG
    phases = [p for p in a.phases.split(",") if p]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        ap.error(f"--phases {a.phases!r}: {unknown} not in {list(PHASES)}")

    res: dict[str, Any] = {"side": a.side, "mode": a.mode, "model": a.model, "phases": {},
                           "phase_seconds": {}, "error": None, "fmha": ours and a.fmha,
                           "spec": a.spec, "prefix_caching": a.prefix_caching,
                           "calls_by_phase": {}, "counters_by_phase": {},
                           "phase_errors": {}}

    def flush() -> None:  # atomic: the driver reads it while this process runs
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(a.out)

    t0 = time.time()
    backend = None
    tally: dict[str, dict[str, int]] = {}
    try:
        import step_kinds
        import torch
        from spec_engine import _KeepOutputs, engine_facts, read_counters
        from vllm import LLM, SamplingParams

        kw = side_kwargs(a.model, ours, spec, a.prefix_caching, a.kv_gib, a.util)
        if ours:
            from vllm_patch.attention import backend

            backend.count_on_device(True)  # graph replays count too
            tally = step_kinds.install()
        if ours and a.arch_path != "native":  # process-wide; the engine runs here
            from vllm_patch.ops import kernels

            kernels.set_arch_path(a.arch_path)
            res["arch_path"] = kernels.arch_path()
        res["engine_kwargs"] = kw
        flush()
        llm = LLM(**copy.deepcopy(kw))  # vLLM writes objects into the dicts it gets
        res["startup_s"] = round(time.time() - t0, 1)
        res["engine"] = engine_facts(llm)
        res["cudagraph_mode"] = res["engine"]["cudagraph_mode"]
        res["capture_sizes"] = res["engine"]["capture_sizes"]
        res["block_size"] = res["engine"]["block_size"]
        res["attention_layers"] = llm.apply_model(summarize_attention)[0]
        if spec:
            try:
                res["drafter_attention"] = llm.collective_rpc(_drafter_attention)[0]
            except Exception as exc:  # evidence only; the check fails without it
                res["drafter_attention_error"] = f"{type(exc).__name__}: {exc}"
        res["plugin_imported"] = "vllm_patch.plugin" in sys.modules
        if backend is not None:
            res["prefill_kernel"] = backend.prefill_kernel()
            res["calls_after_startup"] = dict(backend.CALLS)
            res["step_kinds_after_startup"] = step_kinds.by_role(tally)
        flush()
        plan = phase_prompts()
        for phase in phases:
            t = time.time()
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens(phase), ignore_eos=True,
                                logprobs=2, detokenize=False)
            rows: list[dict[str, Any]] = []
            try:
                before = read_counters(llm)
                for batch in plan[phase]:
                    keep = _KeepOutputs(llm)
                    got = run_phase(keep, sp, batch)
                    for row, o in zip(got, keep.outputs, strict=True):
                        row["num_cached_tokens"] = getattr(o, "num_cached_tokens", None)
                    rows += got
                after = read_counters(llm)
                res["counters_by_phase"][phase] = {
                    k: [before.get(k), v] for k, v in after.items()
                    if any(s in k for s in COUNTER_KEYS)}
                res["phases"][phase] = rows
            except Exception as exc:  # recorded; the next phase still runs
                res["phase_errors"][phase] = f"{type(exc).__name__}: {exc}"
                res.setdefault("tracebacks", {})[phase] = traceback.format_exc()[-3000:]
            res["phase_seconds"][phase] = round(time.time() - t, 2)
            if backend is not None:
                res["attention_calls"] = dict(backend.CALLS)
                res["attention_device"] = {r: backend.device_count(r)
                                           for r in backend.DEVICE_ROUTES}
                res["step_kinds"] = step_kinds.by_role(tally)
                res["calls_by_phase"][phase] = {"calls": res["attention_calls"],
                                                "device": res["attention_device"],
                                                "step_kinds": res["step_kinds"]}
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
