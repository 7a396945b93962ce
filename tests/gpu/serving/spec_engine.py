"""One engine of the prefix-caching + speculation proof, in its own process (GPU machine).

Started by device_spec_prefix.py with `side_env("ours")`. It builds vLLM 0.22.1's LLM from
the keyword arguments in `--kwargs` (a JSON file), writes what vLLM made of them (block
size, mamba cache mode, speculative config, graph mode) to `--out` at once, then runs the
stage plans the driver writes into `--plan-dir` (stage1.json, then stage2.json: the driver
builds them from the block size this engine reports and from the reference's output).
Every submission's rows and counter deltas are written as soon as it finishes; an error in
one phase is recorded and the next phase still runs.

Rows have ab_side's format (tokens, chosen log-probs, top-2), so compare.compare_sides
judges them, plus max_tokens, the shared-prefix length and vLLM's num_cached_tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "ab"))
sys.path.insert(0, str(HERE))
from ab_side import run_phase, summarize_model  # noqa: E402


class _KeepOutputs:
    """Hands run_phase the engine and keeps the RequestOutputs for the cache counts."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.outputs: list[Any] = []

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.outputs = self.llm.generate(*args, **kwargs)
        return self.outputs


def read_counters(llm: Any) -> dict[str, Any]:
    """vLLM's Prometheus counters as {name: value} (a Vector as its list), summed over
    labels: one engine per process, so the registry holds only this engine's."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter):
            out[m.name] = out.get(m.name, 0) + m.value
        elif isinstance(m, Vector):
            prev = out.get(m.name)
            vals = list(m.values)
            out[m.name] = vals if prev is None else [a + b for a, b in zip(prev, vals,
                                                                          strict=False)]
    return out


def _drafter_summary(worker: Any) -> dict[str, Any] | None:
    runner = getattr(worker, "model_runner", None)
    drafter = getattr(runner, "drafter", None)
    model = getattr(drafter, "model", None)
    if model is None:
        return None
    return {"drafter": type(drafter).__name__, "model": type(model).__name__,
            **summarize_model(model)}


def _settled(worker: Any) -> Any:
    from vllm_patch.spec_decode import accepted_state

    runner = getattr(worker, "model_runner", None)
    return {"counts": (runner.__dict__.get(accepted_state.COUNTS_ATTR) if runner else None),
            "install": accepted_state.outcome()}


def engine_facts(llm: Any) -> dict[str, Any]:
    cfg = llm.llm_engine.vllm_config
    cc, spec = cfg.cache_config, cfg.speculative_config
    facts: dict[str, Any] = {
        "block_size": cc.block_size,
        "mamba_block_size": getattr(cc, "mamba_block_size", None),
        "mamba_cache_mode": getattr(cc, "mamba_cache_mode", None),
        "enable_prefix_caching": cc.enable_prefix_caching,
        "num_gpu_blocks": getattr(cc, "num_gpu_blocks", None),
        "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
        "capture_sizes": list(cfg.compilation_config.cudagraph_capture_sizes or []),
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "async_scheduling": getattr(cfg.scheduler_config, "async_scheduling", None),
        "quantization": cfg.model_config.quantization,
        "speculative": None if spec is None else {
            k: getattr(spec, k, None) for k in ("method", "num_speculative_tokens",
                                                "prompt_lookup_min", "prompt_lookup_max")},
    }
    return facts


def wait_for(path: Path, deadline: float) -> dict[str, Any] | None:
    while time.time() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:  # the driver writes it atomically; a partial read retries
                pass
        time.sleep(1)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--kwargs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plan-dir", type=Path, required=True)
    ap.add_argument("--deadline", type=float, required=True, help="epoch seconds")
    a = ap.parse_args()
    res: dict[str, Any] = {"name": a.name, "error": None, "phases": {}, "counters": {},
                           "phase_errors": {}, "phase_seconds": {}}

    def flush() -> None:
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        tmp.replace(a.out)

    t0 = time.time()
    try:
        from vllm import LLM, SamplingParams

        kw = json.loads(a.kwargs.read_text())
        res["engine_kwargs"] = kw
        flush()
        llm = LLM(**copy.deepcopy(kw))  # vLLM writes objects into the dicts it gets
        res["startup_s"] = round(time.time() - t0, 1)
        res["engine"] = engine_facts(llm)
        flush()
        try:
            res["model_summary"] = llm.apply_model(summarize_model)[0]
            res["drafter_summary"] = llm.collective_rpc(_drafter_summary)[0]
        except Exception as exc:  # the summaries describe; the proof below stands without
            res["summary_error"] = f"{type(exc).__name__}: {exc}"
        res["plugin_imported"] = "vllm_patch.plugin" in sys.modules
        flush()
        for stage in (1, 2):
            plan = wait_for(a.plan_dir / f"stage{stage}.json", a.deadline)
            if plan is None:
                res[f"stage{stage}_error"] = "no plan before the deadline"
                flush()
                break
            for phase, subs in plan["phases"].items():
                if time.time() > a.deadline:
                    res["phase_errors"][phase] = "skipped: deadline"
                    continue
                t = time.time()
                rows: list[dict[str, Any]] = []
                deltas: list[dict[str, Any]] = []
                try:
                    for sub in subs:
                        sps = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                              ignore_eos=True, logprobs=2, detokenize=False)
                               for r in sub]
                        before = read_counters(llm)
                        keep = _KeepOutputs(llm)
                        got = run_phase(keep, sps, [r["prompt"] for r in sub])
                        after = read_counters(llm)
                        for r, row, o in zip(sub, got, keep.outputs, strict=True):
                            row.update(max_tokens=r["max_tokens"], shared=r["shared"],
                                       num_cached_tokens=getattr(o, "num_cached_tokens",
                                                                 None))
                        rows += got
                        deltas.append({"before": before, "after": after})
                        res["phases"][phase] = rows
                        res["counters"][phase] = deltas
                        flush()
                except Exception as exc:
                    res["phase_errors"][phase] = f"{type(exc).__name__}: {exc}"
                    res.setdefault("tracebacks", {})[phase] = traceback.format_exc()[-3000:]
                res["phase_seconds"][phase] = round(time.time() - t, 2)
                flush()
        if "vllm_patch.quantization.sm70_gptq" in sys.modules:
            from vllm_patch.quantization.sm70_gptq import CALLS

            res["sm70_op_calls"] = dict(CALLS)
        if "vllm_patch.spec_decode.accepted_state" in sys.modules:
            try:  # R7's counters: the steps it moved a request's state on
                res["settled"] = llm.collective_rpc(_settled)[0]
            except Exception as exc:
                res["settled"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a refused combination is a finding: its exact message
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-6000:]
    res["total_s"] = round(time.time() - t0, 1)
    flush()
    return 0 if res["error"] is None else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
