"""The MTP draft layer on our kernels (issue 24 item 3): int8 draft against no speculation.

Run on the GPU machine by the lead's round call, from the repository root:

    python3 tests/gpu/serving/device_draft_int8.py --out $OUT_DIR --budget-s N

after the plugin is installed into $SM70_SITE, our ops are built and the tiny A/B checkpoint
(it carries the MTP tensors, 16-bit as the reference's) is in $SM70_AB_TINY. Three engines
on our plugin and the int8 copy, each in its own process (this file with --engine), started
at once; the first two eager, so every draft-layer call runs Python and is counted:
  spec         MTP k = 3, SM70_PLUGIN_CONFIG spec.draft_head_dtype int8 (the default);
  plain        no speculation: the reference output;
  spec_graphs  as spec with torch.compile and FULL_AND_PIECEWISE graphs (the serving mode:
               the draft method traced through our op; its calls are counted only while
               capturing, so only its methods and outputs are judged).
The spec engine records, in-process: every linear layer under the drafter's model
(worker.model_runner.drafter.model) and the method it got; the bytes of each draft layer
when draft_int8 converts it (its fp16 weight before, the int8 tensors after, and the
allocator's change); the calls of our GEMV/dequant ops whose weight is a draft layer's
(the kernel entry points wrapped after start-up, matched by the weight's address); vLLM's
spec-decode counters. Greedy 64 tokens for 10 prompts (one at a time, then all together)
are compared with compare.compare_sides. $OUT_DIR/summary.json is rewritten as it goes,
beside engines.json (every row) and logs.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parents[0] / "ab"))
sys.path.insert(0, str(HERE))
import spec_rules as rules  # noqa: E402
from device_io import (  # noqa: E402
    engine_share,
    finish,
    launch,
    log,
    snapshot,
    stop,
    summary_writer,
    utc_stamp,
    watch,
)

ENGINES = ("spec", "plain", "spec_graphs")
K = 3
MAX_LEN = 4096
MAX_BATCHED = 512
KV_GIB = 0.5
DRAFT_METHOD = "DraftInt8LinearMethod"
# The drafter's linear layers in vLLM 0.22.1's Qwen3_5MTP: fc, qkv_proj, o_proj,
# gate_up_proj, down_proj (one MTP layer in the tiny checkpoint).
DRAFT_LINEARS = 5
MARGIN_S = 20


# ---------------------------------------------------------------------- pure parts
def engine_configs(model: str, util: float) -> dict[str, dict[str, Any]]:
    """vLLM keyword arguments of the engines (ab_side.engine_kwargs)."""
    from ab_side import engine_kwargs

    if not 0.0 < util < 1.0:
        raise ValueError(f"gpu_memory_utilization={util}: must be in (0, 1)")
    out = {}
    for name in ENGINES:
        mode = "graphs" if name.endswith("_graphs") else "eager"
        kw = engine_kwargs(model, mode, MAX_BATCHED, MAX_LEN, KV_GIB, util)
        kw["disable_log_stats"] = False  # the spec-decode counters (acceptance)
        if name.startswith("spec"):
            # the drafter picks its own attention backend unless told: the target's, which
            # serves the int8 KV cache
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": K,
                                        "attention_backend": kw["attention_backend"]}
        out[name] = kw
    return out


def plan_phases() -> dict[str, list[list[list[int]]]]:
    """10 prompts (8 short, 2 long enough for chunked prefill): 3 one at a time (decode rows
    of one sequence), then all 10 together (the drafter's rows above the GEMV's 8)."""
    from ab_side import prompts

    ps = prompts()[:10]
    return {"single": [[p] for p in ps[:3]], "batch10": [ps]}


def judge_graphs(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The graphs engine: every draft linear ours and outputs like the plain engine's. None
    when it produced no rows without an error of its own (the budget ran out)."""
    from compare import compare_sides

    g, plain = engines.get("spec_graphs") or {}, engines.get("plain") or {}
    if not g.get("phases") or not plain.get("phases"):
        failed = bool(g.get("error") or g.get("phase_errors"))
        return {"passed": False if failed else None, "error": g.get("error")}
    cmp = compare_sides(plain, g)
    layers = (g.get("drafter") or {}).get("linear_methods") or {}
    checks = {"outputs_match": bool(cmp["passed"]),
              "every_draft_linear_is_ours": len(layers) >= DRAFT_LINEARS
              and all(m == DRAFT_METHOD for m in layers.values())}
    return {"passed": all(checks.values()), "checks": checks, "all_equal": cmp["all_equal"],
            "equal_requests": cmp["equal_requests"], "requests": cmp["requests"],
            "comparison": {k: v for k, v in cmp.items() if k != "phases"},
            "capture_time_draft_op_calls": g.get("draft_op_calls")}


def judge(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The verdict: None when an eager engine produced nothing to compare; the graphs
    engine fails it only when it ran and failed."""
    from compare import compare_sides

    spec, plain = engines.get("spec") or {}, engines.get("plain") or {}
    out: dict[str, Any] = {"passed": None}
    if not spec.get("phases") or not plain.get("phases"):
        out["why"] = "an engine produced no rows (see engines.json and logs.txt)"
        return out
    cmp = compare_sides(plain, spec)
    out["comparison"] = {k: v for k, v in cmp.items() if k != "phases"}
    layers = (spec.get("drafter") or {}).get("linear_methods") or {}
    ours = [n for n, m in layers.items() if m == DRAFT_METHOD]
    calls = spec.get("draft_op_calls") or {}
    conv = spec.get("conversions") or []
    before = sum(c["bytes_before"] for c in conv)
    after = sum(c["bytes_after"] for c in conv)
    checks = {
        "outputs_match": bool(cmp["passed"]),
        "every_draft_linear_is_ours": bool(layers) and len(ours) == len(layers),
        "draft_linears_seen": len(layers) >= DRAFT_LINEARS,
        "draft_gemv_ran": calls.get("gptq_gemv", 0) > 0,
        "draft_apply_counted": (spec.get("draft_int8_calls") or {}).get("apply", 0) > 0,
        "draft_layers_converted": len(conv) == len(layers) and before > 0,
        "draft_bytes_shrank": 0 < after < before,
        "plain_has_no_drafter": not (plain.get("drafter") or {}).get("linear_methods"),
    }
    out.update(checks=checks, draft_bytes_before=before, draft_bytes_after=after,
               draft_linears=len(layers), draft_op_calls=calls,
               all_equal=cmp["all_equal"], equal_requests=cmp["equal_requests"],
               requests=cmp["requests"], spec_counters=spec.get("spec_counters"))
    out["graphs"] = judge_graphs(engines)
    out["passed"] = all(checks.values()) and out["graphs"]["passed"] is not False
    return out


# ---------------------------------------------------------------------- engine side
def _drafter(worker: Any) -> Any:
    return getattr(getattr(worker, "model_runner", None), "drafter", None)


def _drafter_facts(worker: Any) -> dict[str, Any] | None:
    """Runs in the worker (in this process): the drafter's linear layers and their methods,
    the addresses of their int8 weights, and its parameter bytes."""
    from ab_side import summarize_model
    from vllm.model_executor.layers.linear import LinearBase

    drafter = _drafter(worker)
    model = getattr(drafter, "model", None)
    if model is None:
        return None
    methods: dict[str, str] = {}
    ptrs: list[int] = []
    layer_bytes: dict[str, int] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, LinearBase):
            continue
        methods[name] = type(getattr(mod, "quant_method", None)).__name__
        w = getattr(mod, "qweight", None)
        if w is not None:
            ptrs.append(int(w.data_ptr()))
        layer_bytes[name] = sum(p.numel() * p.element_size()
                                for p in mod.parameters(recurse=False))
    return {"drafter": type(drafter).__name__, "model": type(model).__name__,
            "linear_methods": methods, "qweight_ptrs": ptrs, "linear_param_bytes": layer_bytes,
            **summarize_model(model)}


def _drafter_facts_direct(llm: Any) -> dict[str, Any] | None:
    """The same from llm.llm_engine's in-process engine core, if collective_rpc fails."""
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    worker = core.model_executor.driver_worker
    return _drafter_facts(getattr(worker, "worker", worker))


def _record_conversions(draft_int8: Any, conversions: list[dict[str, Any]]) -> None:
    """Wrap draft_int8.convert_layer (before the engine loads): bytes and allocator change."""
    original = draft_int8.convert_layer

    def convert_layer(layer: Any) -> None:
        import torch

        w = getattr(layer, "weight", None)
        if w is None:  # converted already: nothing to measure
            original(layer)
            return
        rec: dict[str, Any] = {"shape": list(w.shape), "dtype": str(w.dtype),
                               "bytes_before": w.numel() * w.element_size()}
        del w
        torch.cuda.synchronize()
        mem0 = torch.cuda.memory_allocated()
        original(layer)
        torch.cuda.synchronize()
        rec["bytes_after"] = sum(p.numel() * p.element_size()
                                 for p in (layer.qweight, layer.sm70_sz))
        rec["allocated_delta"] = torch.cuda.memory_allocated() - mem0
        conversions.append(rec)

    draft_int8.convert_layer = convert_layer


def _count_draft_ops(ptrs: set[int], counts: dict[str, int]) -> None:
    """Wrap our kernel entry points: count the calls whose weight is a draft layer's."""
    from vllm_patch.ops import kernels

    def wrap(name: str) -> None:
        fn: Callable[..., Any] = getattr(kernels, name)
        counts.setdefault(name, 0)
        counts.setdefault(name + "_all", 0)

        def counted(x: Any, qw: Any, *args: Any, **kwargs: Any) -> Any:
            counts[name + "_all"] += 1
            if int(qw.data_ptr()) in ptrs or (qw.dim() == 2 and int(qw.untyped_storage()
                                                                      .data_ptr()) in ptrs):
                counts[name] += 1
            return fn(x, qw, *args, **kwargs)

        setattr(kernels, name, counted)

    # gptq_gemv / int8_gemm(x, qw, ...); gptq_dequant(qw, sz, ...) takes the weight first
    wrap("gptq_gemv")
    wrap("int8_gemm")
    original = kernels.gptq_dequant
    counts.setdefault("gptq_dequant", 0)

    def dequant(qw: Any, *args: Any, **kwargs: Any) -> Any:
        if int(qw.untyped_storage().data_ptr()) in ptrs:
            counts["gptq_dequant"] += 1
        return original(qw, *args, **kwargs)

    kernels.gptq_dequant = dequant


def _counters(read: Callable[[Any], dict[str, Any]], llm: Any,
              res: dict[str, Any]) -> dict[str, Any]:
    try:
        return read(llm)
    except Exception as exc:  # descriptive only
        res["counters_error"] = f"{type(exc).__name__}: {exc}"
        return {}


def engine_main(name: str, kwargs_path: Path, out: Path, deadline: float) -> int:
    from spec_engine import run_engine, run_phases

    res: dict[str, Any] = {"name": name, "error": None, "phases": {}, "phase_errors": {},
                           "phase_seconds": {}}
    conversions: list[dict[str, Any]] = []
    draft_int8: Any = None

    def prepare() -> None:
        nonlocal draft_int8
        # draft_int8 imports no vLLM: wrapped before the engine loads the drafter
        from vllm_patch.quantization import draft_int8 as module

        draft_int8 = module
        res["conversions"] = conversions
        _record_conversions(draft_int8, conversions)

    def body(llm: Any, flush: Callable[[], None]) -> None:
        from ab_side import NEW_TOKENS, run_phase
        from spec_engine import greedy, read_counters

        cfg = llm.llm_engine.vllm_config
        spec = getattr(cfg, "speculative_config", None)
        res["speculative"] = None if spec is None else {
            k: str(getattr(spec, k, None)) for k in ("method", "num_speculative_tokens",
                                                     "attention_backend")}
        res["quant_config"] = repr(getattr(cfg, "quant_config", None))
        try:
            from vllm_patch.plugin import registered

            res["plugin"] = {k: str(v) for k, v in registered().items()}
        except Exception as exc:
            res["plugin"] = f"{type(exc).__name__}: {exc}"
        try:
            facts = llm.collective_rpc(_drafter_facts)[0]
            res["drafter_via"] = "collective_rpc"
        except Exception as exc:
            res["drafter_rpc_error"] = f"{type(exc).__name__}: {exc}"
            facts = _drafter_facts_direct(llm)
            res["drafter_via"] = "llm_engine.engine_core"
        res["drafter"] = facts
        ptrs = set((facts or {}).get("qweight_ptrs") or [])
        op_counts: dict[str, int] = {}
        _count_draft_ops(ptrs, op_counts)
        res["draft_op_calls"] = op_counts
        flush()
        sp = greedy(NEW_TOKENS)
        counters0 = _counters(read_counters, llm, res)

        def one_phase(phase: str, batches: list[list[list[int]]]) -> None:
            rows: list[dict[str, Any]] = []
            for batch in batches:
                rows += run_phase(llm, sp, batch)
                res["phases"][phase] = rows
                res["draft_op_calls"] = dict(op_counts)
                res["draft_int8_calls"] = dict(draft_int8.CALLS)
                flush()

        run_phases(plan_phases(), deadline, res, flush, one_phase)
        counters1 = _counters(read_counters, llm, res)
        res["spec_counters"] = {k: v for k, v in counters1.items()
                                if "spec_decode" in k and v != counters0.get(k)}
        if "vllm_patch.quantization.sm70_gptq" in sys.modules:  # loaded by the plugin
            from vllm_patch.quantization import sm70_gptq

            res["sm70_op_calls"] = dict(sm70_gptq.CALLS)
        res["draft_int8_calls"] = dict(draft_int8.CALLS)
        res["draft_op_calls"] = dict(op_counts)

    return run_engine(res, kwargs_path, out, body, prepare)


# ---------------------------------------------------------------------- driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="summary.json, engines.json, logs.txt")
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--work", type=Path, default=Path("/tmp/draft_int8"),
                    help="engine JSON and logs (only --out comes back)")
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--kwargs", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        return engine_main(a.engine, a.kwargs, a.result, a.deadline)
    if a.out is None:
        ap.error("--out is required")

    from run_ab import side_env, start

    t0 = time.time()
    deadline = t0 + a.budget_s - MARGIN_S
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    work: Path = a.work
    work.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"passed": None, "started": utc_stamp(), "budget_s": a.budget_s}

    flush = summary_writer(out / "summary.json", summary, t0)

    tiny, share, util = engine_share(len(ENGINES), "0.08")
    try:
        configs = engine_configs(str(tiny / "int8"), util)
    except ValueError as exc:
        summary["error"] = str(exc)
        flush()
        return 1
    summary.update(model=str(tiny / "int8"), gpu_share=share, util_per_engine=util,
                   engine_kwargs=configs)
    flush()
    plugin_config = json.dumps({"spec": {"draft_head_dtype": "int8"}})
    procs, files = launch(
        configs, work,
        lambda name, kw_path, result: [
            sys.executable, str(Path(__file__).resolve()), "--engine", name, "--kwargs",
            str(kw_path), "--result", str(result), "--deadline", str(deadline)],
        lambda name: side_env("ours", {"VLLM_CACHE_ROOT": f"/tmp/vc_draft_{name}",
                                       "SM70_PLUGIN_CONFIG": plugin_config}),
        start)
    log(f"started {list(procs)} at util {util} each")

    engines: dict[str, dict[str, Any]] = {}

    def tick() -> None:
        snapshot(out, work, files, engines)
        summary["progress"] = rules.progress(engines, ENGINES)
        flush()

    watch(procs, deadline, tick)
    summary["rc"] = stop(procs)
    snapshot(out, work, files, engines)
    for n in ENGINES:
        e = engines.get(n) or {}
        if e.get("error") or e.get("phase_errors"):
            summary.setdefault("engine_errors", {})[n] = {
                "error": e.get("error"), "phase_errors": e.get("phase_errors")}
    return finish(summary, flush, lambda: judge(engines))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
