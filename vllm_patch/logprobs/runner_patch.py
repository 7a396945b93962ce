"""R5 of ../runtime_patches/README.md: vLLM 0.22.1's prompt-logprobs step, sliced.

`install(rows_per_slice)` rebinds `GPUModelRunner._get_prompt_logprobs_dict` (the v1 model
runner, which hybrid models such as Qwen3.5 always get) to `sliced_method`, after checking
that the attribute is the function this module was written against: vLLM's version, the
parameter names, and the names its code uses (the runner state it reads and the three
calls it makes). Anything else is refused with a `PromptLogprobsPatchError` naming what
differs, and vLLM's own method stays.

The replacement keeps vLLM's bookkeeping (per-request CPU tensors filled chunk by chunk,
finished requests handed back on the step that also has their first sample, one device
sync when anything is handed back) and changes only how a chunk's rows are turned into
log-probs: `slices.sliced_prompt_logprobs`, at most `rows_per_slice` rows at a time.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from vllm_patch import rebind
from vllm_patch.logprobs.plan import plan_step

logger = logging.getLogger("vllm_patch")

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
TARGET = f"{RUNNER_MODULE}.GPUModelRunner._get_prompt_logprobs_dict"
EXPECTED_VERSION = "0.22.1"
EXPECTED_PARAMS = ("self", "hidden_states", "num_scheduled_tokens")
# Names the 0.22.1 body uses that this replacement relies on meaning the same thing.
EXPECTED_NAMES = frozenset({
    "num_prompt_logprobs", "requests", "prompt_token_ids", "in_progress_prompt_logprobs_cpu",
    "empty_cpu", "num_computed_tokens", "input_batch", "req_id_to_index", "query_start_loc",
    "compute_logits", "compute_logprobs", "gather_logprobs", "_sync_device",
})
MARK = "__sm70_prompt_logprobs_rows__"
_TARGET = rebind.Target(RUNNER_MODULE, "GPUModelRunner", "_get_prompt_logprobs_dict",
                        EXPECTED_VERSION, EXPECTED_PARAMS, EXPECTED_NAMES, MARK)
REPLACES = "__sm70_replaces__"  # the replacement keeps vLLM's function here


class PromptLogprobsPatchError(rebind.RebindError):
    """The rebinding's target is not the function it was written against."""


def check_target(func: Any, version: str) -> None:
    """Raise `PromptLogprobsPatchError` unless `func` looks like vLLM 0.22.1's method."""
    rebind.check(_TARGET, func, version, PromptLogprobsPatchError,
                 "set logprobs.prompt_chunk to 0")


def sliced_method(rows_per_slice: int) -> Callable[..., dict[str, Any]]:
    """The replacement method, computing each request's rows `rows_per_slice` at a time."""
    if rows_per_slice < 1:
        raise ValueError(f"logprobs.prompt_chunk is {rows_per_slice}: must be >= 1 to slice")
    import torch
    from vllm.v1.outputs import LogprobsTensors

    from vllm_patch.logprobs.slices import sliced_prompt_logprobs

    def _get_prompt_logprobs_dict(self: Any, hidden_states: torch.Tensor,
                                  num_scheduled_tokens: dict[str, int]) -> dict[str, Any]:
        wanted: dict[str, int] = self.num_prompt_logprobs
        if not wanted:
            return {}
        finished: dict[str, Any] = {}
        done: list[str] = []
        for req_id, k in wanted.items():
            scheduled = num_scheduled_tokens.get(req_id)
            if scheduled is None:  # preempted before its prefill ran this step
                continue
            req = self.requests[req_id]
            prompt = req.prompt_token_ids
            if prompt is None:  # prompt embeddings have no prompt tokens to score
                continue
            out = req.in_progress_prompt_logprobs_cpu
            if out is None:
                out = LogprobsTensors.empty_cpu(len(prompt) - 1, k + 1)
                req.in_progress_prompt_logprobs_cpu = out
            step = plan_step(len(prompt), req.num_computed_tokens, scheduled)
            if step.last:
                done.append(req_id)
                finished[req_id] = out
            if step.rows <= 0:
                continue
            row0 = int(self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]])
            first = step.first_target
            targets = torch.tensor(prompt[first:first + step.rows], dtype=torch.int64)
            ids, lps, ranks = sliced_prompt_logprobs(
                hidden_states[row0:row0 + step.rows], targets.to(self.device, non_blocking=True),
                k, rows_per_slice, self.model.compute_logits, self.sampler.compute_logprobs,
                self.sampler.gather_logprobs)
            rows = slice(step.start, step.start + step.rows)
            out.logprob_token_ids[rows].copy_(ids, non_blocking=True)
            out.logprobs[rows].copy_(lps, non_blocking=True)
            out.selected_token_ranks[rows].copy_(ranks, non_blocking=True)
        for req_id in done:
            del wanted[req_id]
            self.requests[req_id].in_progress_prompt_logprobs_cpu = None
        if finished:  # the copies above are asynchronous
            self._sync_device()
        return finished

    setattr(_get_prompt_logprobs_dict, MARK, rows_per_slice)
    return _get_prompt_logprobs_dict


def install(rows_per_slice: int) -> str:
    """Rebind the target (once per process; a second call with the same rows is a no-op).
    Raises `PromptLogprobsPatchError` when the target is not the expected function."""
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current = GPUModelRunner.__dict__.get("_get_prompt_logprobs_dict")
    installed = getattr(current, MARK, None)
    if installed is not None:
        if installed != rows_per_slice:
            raise PromptLogprobsPatchError(
                f"{TARGET}: already sliced at {installed} rows, asked for {rows_per_slice}")
        return f"sliced ({installed} rows, already installed)"
    check_target(current, vllm.__version__)
    method = sliced_method(rows_per_slice)
    setattr(method, REPLACES, current)
    GPUModelRunner._get_prompt_logprobs_dict = method
    return f"sliced ({rows_per_slice} rows per slice)"


def install_or_refuse(rows_per_slice: int) -> str:
    """`install`, or the refusal logged and reported (vLLM's own method then stays)."""
    try:
        return install(rows_per_slice)
    except PromptLogprobsPatchError as exc:
        logger.error("sm70 plugin: prompt logprobs stay unbounded: %s", exc)
        return f"refused ({exc})"
    except ImportError as exc:  # a vLLM without the v1 GPU runner (a CPU-only build)
        return f"absent ({TARGET} does not import: {exc})"


_outcome: list[str] = []


def outcome() -> str | None:
    """What the last install attempt in this process said (None: none has run yet)."""
    return _outcome[-1] if _outcome else None


def install_when_imported(rows_per_slice: int) -> str:
    """`install_or_refuse` now if vLLM's runner module is loaded, else right after it is:
    only engine workers import it, so the API server and vLLM's model-inspection
    subprocess (where the plugin also loads) never pay for that import."""

    def run() -> None:
        _outcome.append(install_or_refuse(rows_per_slice))

    if RUNNER_MODULE in sys.modules:
        run()
        return _outcome[-1]
    # by mark: any other rebinding's hook on the same module must not stand in for this one
    rebind.defer(RUNNER_MODULE, MARK, run)
    return f"deferred ({rows_per_slice} rows; installed when {RUNNER_MODULE} is imported)"
