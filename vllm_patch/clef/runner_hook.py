"""R6 of ../runtime_patches/README.md: the runner tells Clef's layers which rows are Clef's,
and hands the scoring head the hidden states it reads (imports torch; vLLM at install).

`install()` wraps two methods of vLLM 0.22.1's `GPUModelRunner` (the v1 runner hybrid
models always get), after checking vLLM's version and their parameters:

- `_preprocess(scheduler_output, num_input_tokens, ...)`, which `execute_model` calls once
  per step after `_prepare_inputs` (so `input_batch.req_ids` is in the step's layout order,
  after the decode-first reorder, and `query_start_loc` is filled) and before the forward,
  with the padded row count: `mark_step` writes `clef_correction.ROWS` for the step from the
  requests' `extra_args` (`vllm_patch.clef.batch`). `_dummy_run` (profiling, CUDA-graph
  capture) never calls it, so no host-to-device copy is ever captured: a replay reads the
  mask buffer the last `mark_step` wrote, by address.
- `_model_forward(...)`: after the forward, the hidden-state rows of this step's scoring
  positions (`mark_step` listed them) are copied out; once a request has all of its
  positions, the head scores them (`SCORES`), kept on the worker until the API process takes
  them through `ClefWorkerExtension.sm70_clef_take` (vLLM's `collective_rpc`).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_patch.clef.batch import ScoreSpec, request_flags, rows_this_step, score_spec
from vllm_patch.rebind import base_version

logger = logging.getLogger("vllm_patch")

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
EXPECTED_VERSION = "0.22.1"
TARGETS: dict[str, tuple[str, ...]] = {
    "_preprocess": ("self", "scheduler_output", "num_input_tokens", "intermediate_tensors"),
    "_model_forward": ("self", "input_ids", "positions", "intermediate_tensors",
                       "inputs_embeds", "model_kwargs"),
}
MARK = "__sm70_clef_hook__"
PENDING = "_sm70_clef_pending"
# finished scores waiting for the API process; a client that went away never takes its
# own, so the oldest are dropped beyond this many
MAX_KEPT = 1024
_lock = threading.Lock()


class ClefHookError(RuntimeError):
    """The rebinding's target is not the method it was written against."""


Pending = list[tuple[ScoreSpec, list[int], list[int]]]


def mark_step(runner: Any, num_input_tokens: int) -> Pending:
    """Write the step's Clef row mask; return the scoring positions computed this step."""
    from vllm_patch.quantization.clef_correction import ROWS

    ib = runner.input_batch
    n = int(ib.num_reqs)
    req_ids = list(ib.req_ids[:n])
    extra = {}
    for rid in req_ids:
        state = runner.requests.get(rid) if rid is not None else None
        sp = getattr(state, "sampling_params", None)
        extra[rid] = getattr(sp, "extra_args", None)
    flags = request_flags(req_ids, extra)
    qsl = [int(v) for v in runner.query_start_loc.np[: n + 1]]
    ROWS.set_batch(qsl, flags, int(num_input_tokens), getattr(runner, "device", None))
    pending: Pending = []
    if any(flags):
        for i, rid in enumerate(req_ids):
            spec = score_spec(extra[rid]) if flags[i] else None
            if spec is None:
                continue
            idx, rows = rows_this_step(spec.positions, int(ib.num_computed_tokens_cpu[i]),
                                       qsl[i], qsl[i + 1])
            if idx:
                pending.append((spec, idx, rows))
    return pending


class ScoreStore:
    """Hidden states gathered per scoring request across prefill chunks, and the head's
    logits once all of a request's positions are in (per worker process)."""

    def __init__(self) -> None:
        self.partial: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.done: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.head: Callable[..., torch.Tensor] | None = None
        # the GPU check's window on the gathered rows (a CPU copy per request when on)
        self.keep_hidden = False
        self.hidden: OrderedDict[str, torch.Tensor] = OrderedDict()

    def collect(self, hidden: torch.Tensor, pending: Pending) -> None:
        for spec, idx, rows in pending:
            p = len(spec.positions)
            buf, got = self.partial.get(spec.key, (None, None))
            if buf is None or got is None:
                buf = hidden.new_zeros((p, hidden.shape[-1]))
                got = torch.zeros(p, dtype=torch.bool)
                self.partial[spec.key] = (buf, got)
            where = torch.tensor(idx, dtype=torch.long)
            buf.index_copy_(0, where.to(buf.device),
                            hidden.index_select(0, torch.tensor(rows, device=hidden.device)))
            got[where] = True
            if bool(got.all()):
                del self.partial[spec.key]
                self.done[spec.key] = self.score(spec, buf)
                if self.keep_hidden:
                    self.hidden[spec.key] = buf.detach().cpu()
        for store in (self.partial, self.done, self.hidden):
            while len(store) > MAX_KEPT:
                store.popitem(last=False)

    def score(self, spec: ScoreSpec, buf: torch.Tensor) -> torch.Tensor:
        head = self.head or served_head()
        dev = buf.device
        p = len(spec.positions)
        return head(buf, torch.arange(p, device=dev),
                    torch.tensor(spec.roles, device=dev), torch.tensor(spec.kinds, device=dev),
                    [0, p])

    def take(self, key: str) -> list[float] | None:
        t = self.done.pop(key, None)
        return None if t is None else [float(v) for v in t.float().cpu()]


SCORES = ScoreStore()
_head: list[Any] = []


def served_head() -> Any:
    """The serving worker's head, loaded once from SM70_CLEF_DIR (clef_correction loads it
    with the corrections, before vLLM's memory profile)."""
    from vllm_patch.quantization.clef_correction import served_head as load

    head = load()
    if head is None:
        raise RuntimeError("a Clef scoring request reached a worker without the Clef head "
                           "(SM70_CLEF is off in this process)")
    return head


def collect_after_forward(runner: Any, output: Any) -> None:
    pending = runner.__dict__.pop(PENDING, None)
    if not pending:
        return
    hidden = output[0] if isinstance(output, tuple) else output
    if not isinstance(hidden, torch.Tensor):  # not the last pipeline stage: no hidden states
        return
    with _lock:
        SCORES.collect(hidden, pending)


def check_target(cls: type, version: str) -> None:
    if base_version(version) != EXPECTED_VERSION:
        raise ClefHookError(f"{RUNNER_MODULE}: vLLM is {version}, the Clef runner hook is "
                            f"written for {EXPECTED_VERSION}; not installed")
    for name, params in TARGETS.items():
        func = cls.__dict__.get(name)
        if func is None or not callable(func):
            raise ClefHookError(f"GPUModelRunner.{name} is missing; not installed")
        got = tuple(inspect.signature(getattr(func, "__wrapped__", func)).parameters)
        if got != params:
            raise ClefHookError(f"GPUModelRunner.{name}: parameters {got}, expected {params}; "
                                "not installed")


def _wrap_preprocess(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _preprocess(self: Any, scheduler_output: Any, num_input_tokens: int,
                    intermediate_tensors: Any = None) -> Any:
        pending = mark_step(self, num_input_tokens)
        if pending:
            self.__dict__[PENDING] = pending
        return orig(self, scheduler_output, num_input_tokens, intermediate_tensors)

    _preprocess.__wrapped__ = orig  # type: ignore[attr-defined]
    return _preprocess


def _wrap_forward(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        collect_after_forward(self, out)
        return out

    _model_forward.__wrapped__ = orig  # type: ignore[attr-defined]
    return _model_forward


def install(cls: type | None = None) -> str:
    """Wrap the two methods (once per process). Raises ClefHookError on a foreign target."""
    import vllm

    if cls is None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        cls = GPUModelRunner
    with _lock:
        if getattr(cls.__dict__.get("_preprocess"), MARK, False):
            return "installed (already)"
        check_target(cls, vllm.__version__)
        pre = _wrap_preprocess(cls.__dict__["_preprocess"])
        fwd = _wrap_forward(cls.__dict__["_model_forward"])
        for f in (pre, fwd):
            setattr(f, MARK, True)
        cls._preprocess = pre  # type: ignore[attr-defined]
        cls._model_forward = fwd  # type: ignore[attr-defined]
    return "installed"


def uninstall(cls: type) -> None:
    """Put vLLM's methods back (tests)."""
    for name in TARGETS:
        f = cls.__dict__.get(name)
        if getattr(f, MARK, False):
            setattr(cls, name, f.__wrapped__)


def installed_names(cls: type) -> Sequence[str]:
    return [n for n in TARGETS if getattr(cls.__dict__.get(n), MARK, False)]
