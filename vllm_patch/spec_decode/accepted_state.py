"""R7 of ../runtime_patches/README.md: a decode step without drafts after accepted drafts.

The bug (vLLM 0.22.1, every hybrid model with speculative decoding; measured on the H200 with
stock vLLM and with our stack, `tests/gpu/serving/device_spec_diag.py`): after a step in
which a request's drafts were accepted, its Gated DeltaNet state after the last accepted
token is in state slot `num_accepted - 1` of the request's speculative slots, and its conv
window starts `num_accepted - 1` rows into slot 0. vLLM reads them there only on the
speculative path of the GDN metadata, which a request takes only when it has drafts in
this step, and the whole batch takes only when some request has any
(`gpu_model_runner.py:2128`, `gdn_attn.py:185-216`, `:283-289`). A request without drafts
this step (n-gram found no match; MTP never does this, it always drafts k) goes through
the non-speculative path, which reads slot 0 and the conv window at row 0: the state after
the first token of the previous step, not after its last accepted one. Greedy output then
differs from decoding without speculation (n-gram, margins of 2-5 nats).

The fix: right after vLLM's `_prepare_inputs` (which has synchronised this step's accepted
counts into `input_batch.num_accepted_tokens_cpu`), every request that has no drafts in
this step and `num_accepted > 1` gets its state settled where the non-speculative path
reads it: the temporal state of slot `base + a - 1` copied to slot `base`, the conv
window shifted down by `a - 1` rows in slot `base`, with vLLM's own copy-spec functions
(the ones its align-mode prefix caching uses for the same move), then `num_accepted` set
to 1. `base` is 0 without prefix caching and the request's running-state block
(`mamba_state_idx`) in align mode, where vLLM's `preprocess_mamba` then moves the settled
state on with an accepted count of 1. Requests with drafts are left to vLLM, which handles
them. The copies run eagerly before the forward (outside any captured graph), only on the
steps where a request stops drafting after an acceptance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_patch import rebind

TARGET = rebind.Target(
    module="vllm.v1.worker.gpu_model_runner", owner="GPUModelRunner", attr="_prepare_inputs",
    version="0.22.1", params=("self", "scheduler_output", "num_scheduled_tokens"),
    # names the 0.22.1 body uses for the accepted-count sync this fix runs after
    names=frozenset({"num_accepted_tokens_event", "num_accepted_tokens",
                     "num_accepted_tokens_cpu", "scheduled_spec_decode_tokens"}),
    mark="__sm70_settle_accepted__")
MARK = TARGET.mark
COUNTS_ATTR = "_sm70_settled"  # on the runner: {"steps": n, "requests": n, "copies": n}


class SettlePatchError(rebind.RebindError):
    """The rebinding's target is not the function it was written against."""


@dataclass(frozen=True)
class Settle:
    row: int
    req_id: str
    base: int  # index into the request's block ids of its slot 0
    accepted: int  # >= 2


def rows_to_settle(req_ids: Sequence[str | None], accepted: Sequence[int],
                   drafted: Mapping[str, Sequence[int]], mode: str,
                   state_idx: Mapping[str, int]) -> list[Settle]:
    """Which rows of this step need their state moved (pure: the CPU tests' subject).

    `accepted`: the batch's synchronised accepted counts, row by row; `drafted`: the
    scheduler's draft tokens per request this step; `mode`: vLLM's mamba_cache_mode;
    `state_idx`: the runner's `mamba_state_idx` (align mode's running-state block of the
    previous step, per request)."""
    if mode not in ("none", "align"):
        raise ValueError(f"mamba_cache_mode {mode!r}: the settle fix covers none and align")
    out = []
    for row, rid in enumerate(req_ids):
        if rid is None or int(accepted[row]) <= 1 or len(drafted.get(rid, ())) > 0:
            continue
        if mode == "align":
            base = state_idx.get(rid)
            if base is None:  # a request new to this runner starts with accepted = 1
                continue
        else:
            base = 0
        out.append(Settle(row, rid, int(base), int(accepted[row])))
    return out


def _copy_within(state: Any, spec: Any, dst_block: int) -> None:
    """Copy `spec` (a vLLM MambaCopySpec of `state`: start address, element count) to the
    start of `state[dst_block]`, through a temporary: source and destination may overlap
    (the conv window moves down inside its own block)."""
    import torch

    storage = state.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=state.device).set_(storage)
    base = storage.data_ptr()
    n = int(spec.num_elements) * state.element_size()
    src = int(spec.start_addr) - base
    dst = state[dst_block].data_ptr() - base
    if src == dst:
        return
    flat[dst:dst + n].copy_(flat[src:src + n].clone())


def settle(runner: Any, scheduler_output: Any) -> int:
    """Apply the fix to this step's batch (after `_prepare_inputs`); returns the rows moved."""
    from vllm.v1.worker import mamba_utils

    batch = runner.input_batch
    n = int(batch.num_reqs)
    mode = getattr(runner.cache_config, "mamba_cache_mode", "none") or "none"
    todo = rows_to_settle(list(batch.req_ids[:n]), batch.num_accepted_tokens_cpu[:n],
                          scheduler_output.scheduled_spec_decode_tokens, mode,
                          getattr(runner, "mamba_state_idx", {}) or {})
    if not todo:
        return 0
    group_ids, _ = mamba_utils.get_mamba_groups(runner.kv_cache_config)
    ctx = runner.compilation_config.static_forward_context
    funcs = runner.model.get_mamba_state_copy_func()
    copies = 0
    for s in todo:
        blocks_of = runner.requests[s.req_id].block_ids
        for gid in group_ids:
            block_ids = blocks_of[gid]
            for name in runner.kv_cache_config.kv_cache_groups[gid].layer_names:
                for state, func in zip(ctx[name].kv_cache, funcs, strict=True):
                    _copy_within(state, func(state, block_ids, s.base, s.accepted),
                                 block_ids[s.base])
                    copies += 1
        batch.num_accepted_tokens_cpu[s.row] = 1
        runner.num_accepted_tokens.np[s.row] = 1
    runner.num_accepted_tokens.copy_to_gpu(n)
    counts = runner.__dict__.setdefault(COUNTS_ATTR, {"steps": 0, "requests": 0, "copies": 0})
    counts["steps"] += 1
    counts["requests"] += len(todo)
    counts["copies"] += copies
    return len(todo)


def applies(runner: Any) -> bool:
    spec = getattr(runner, "speculative_config", None)
    return spec is not None and bool(getattr(runner.model_config, "is_hybrid", False))


def check_target(func: Any, version: str) -> None:
    rebind.check(TARGET, func, version, SettlePatchError)


def wrap(original: Any) -> Any:
    def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, scheduler_output, *args, **kwargs)
        if applies(self):
            settle(self, scheduler_output)
        return out

    return _prepare_inputs


_INSTALLER = rebind.Installer(TARGET, wrap, "acts for hybrid models with speculative decoding",
                              SettlePatchError)
install = _INSTALLER.install
install_or_refuse = _INSTALLER.install_or_refuse
outcome = _INSTALLER.outcome
install_when_imported = _INSTALLER.install_when_imported
