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

The frame of such an engine process (run_engine: build, record, catch; run_stages /
run_phases: the plans, one phase's error kept to itself; greedy: the sampling) is also
what device_assist.py's and device_draft_int8.py's own engines run on.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "ab"))
sys.path.insert(0, str(HERE))
from ab_side import run_phase, summarize_model  # noqa: E402
from device_io import atomic_write  # noqa: E402


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
    from vllm_patch.gdn import spec_gates
    from vllm_patch.spec_decode import accepted_state

    runner = getattr(worker, "model_runner", None)
    return {"counts": (runner.__dict__.get(accepted_state.COUNTS_ATTR) if runner else None),
            "install": accepted_state.outcome(),
            # R10 in the same process: mixed speculative GDN calls whose gates it gathered
            "spec_gates": {"counts": dict(spec_gates.COUNTS), "install": spec_gates.outcome()}}


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


def run_engine(res: dict[str, Any], kwargs_path: Path, out: Path,
               body: Callable[[Any, Callable[[], None]], None],
               prepare: Callable[[], None] | None = None) -> int:
    """One engine process's frame: `prepare()` (before vLLM builds anything), the LLM from
    the keyword arguments in `kwargs_path`, then `body(llm, flush)`. `res` is written to
    `out` as it goes (flush); an exception anywhere is the result's `error` and
    `traceback` (a refused combination is a finding: its exact message), and the process's
    exit code is 1."""

    def flush() -> None:
        atomic_write(out, res)

    t0 = time.time()
    try:
        if prepare is not None:
            prepare()
        from vllm import LLM

        kw = json.loads(kwargs_path.read_text())
        res["engine_kwargs"] = kw
        flush()
        llm = LLM(**copy.deepcopy(kw))  # vLLM writes objects into the dicts it gets
        res["startup_s"] = round(time.time() - t0, 1)
        body(llm, flush)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-6000:]
    res["total_s"] = round(time.time() - t0, 1)
    flush()
    return 0 if res["error"] is None else 1


def run_phases(phases: Mapping[str, Any], deadline: float, res: dict[str, Any],
               flush: Callable[[], None], one_phase: Callable[[str, Any], None]) -> None:
    """`one_phase(name, submissions)` for each phase before the deadline (the rest are
    recorded as skipped); an error is that phase's and the next one still runs."""
    for phase, subs in phases.items():
        if time.time() > deadline:
            res["phase_errors"][phase] = "skipped: deadline"
            continue
        t = time.time()
        try:
            one_phase(phase, subs)
        except Exception as exc:
            res["phase_errors"][phase] = f"{type(exc).__name__}: {exc}"
            res.setdefault("tracebacks", {})[phase] = traceback.format_exc()[-3000:]
        res["phase_seconds"][phase] = round(time.time() - t, 2)
        flush()


def run_stages(plan_dir: Path, deadline: float, res: dict[str, Any],
               flush: Callable[[], None], one_phase: Callable[[str, Any], None]) -> None:
    """The driver's stage plans in order (stage1.json, then stage2.json, each waited for
    until the deadline), every phase through run_phases."""
    for stage in (1, 2):
        plan = wait_for(plan_dir / f"stage{stage}.json", deadline)
        if plan is None:
            res[f"stage{stage}_error"] = "no plan before the deadline"
            flush()
            break
        run_phases(plan["phases"], deadline, res, flush, one_phase)


def greedy(max_tokens: int) -> Any:
    """The sampling of every comparison: greedy, the full length, the top-2 log-probs."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=2, detokenize=False)


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

    def body(llm: Any, flush: Callable[[], None]) -> None:
        res["engine"] = engine_facts(llm)
        flush()
        try:
            res["model_summary"] = llm.apply_model(summarize_model)[0]
            res["drafter_summary"] = llm.collective_rpc(_drafter_summary)[0]
        except Exception as exc:  # the summaries describe; the proof below stands without
            res["summary_error"] = f"{type(exc).__name__}: {exc}"
        res["plugin_imported"] = "vllm_patch.plugin" in sys.modules
        flush()

        def one_phase(phase: str, subs: list[list[dict[str, Any]]]) -> None:
            rows: list[dict[str, Any]] = []
            deltas: list[dict[str, Any]] = []
            for sub in subs:
                sps = [greedy(r["max_tokens"]) for r in sub]
                before = read_counters(llm)
                keep = _KeepOutputs(llm)
                got = run_phase(keep, sps, [r["prompt"] for r in sub])
                after = read_counters(llm)
                for r, row, o in zip(sub, got, keep.outputs, strict=True):
                    row.update(max_tokens=r["max_tokens"], shared=r["shared"],
                               num_cached_tokens=getattr(o, "num_cached_tokens", None))
                rows += got
                deltas.append({"before": before, "after": after})
                res["phases"][phase] = rows
                res["counters"][phase] = deltas
                flush()

        run_stages(a.plan_dir, a.deadline, res, flush, one_phase)
        if "vllm_patch.quantization.sm70_gptq" in sys.modules:
            from vllm_patch.quantization.sm70_gptq import CALLS

            res["sm70_op_calls"] = dict(CALLS)
        if "vllm_patch.spec_decode.accepted_state" in sys.modules:
            try:  # R7's counters: the steps it moved a request's state on
                res["settled"] = llm.collective_rpc(_settled)[0]
            except Exception as exc:
                res["settled"] = f"{type(exc).__name__}: {exc}"

    return run_engine(res, a.kwargs, a.out, body)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
