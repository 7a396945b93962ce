"""R10 of ../runtime_patches/README.md: the gates of speculative rows in a mixed GDN step.

The bug (vLLM 0.22.1, read in its source; the n-gram losses it explains were measured on the
H200 with stock vLLM and with our stack, `tests/gpu/results/h200_spec_diag*.json`): in a step
whose batch has speculative rows (requests with drafts) and other rows (requests without
drafts, reclassified as 1-token prefills, or prefill chunks), `_forward_core` of
`QwenGatedDeltaNetAttention` gathers the speculative tokens' q, k and v with
`spec_token_indx` but hands `fused_sigmoid_gating_delta_rule_update` the gates `a` and `b` of
the whole batch, in batch order (`qwen_gdn_linear_attn.py:1437-1458`). The kernel reads the
gates of its t-th token at row t (`fused_sigmoid_gating.py:89-95`), so the speculative rows
get the gates of whichever tokens come first in the batch. They are theirs only when every
speculative token precedes every other token; vLLM orders decodes before prefills but leaves
requests with and without drafts in batch order, so with n-gram drafting (a request finds a
match or not, step by step) a draft-less request ahead of a drafting one shifts the gates.
MTP drafts k tokens for every running request, so MTP steps put the drafting rows first and
never meet it. The state update is then wrong for those rows and greedy output differs from
plain decoding (stock vLLM too), at margins far above fp16 noise.

The fix: the function vLLM's layer module calls is rebound (module attribute) to a wrapper
that, when the gates have more rows than q, gathers them with the step's own index: the
speculative call (the one given `num_accepted_tokens`) with `spec_token_indx`, the other
(vLLM's non-speculative decode call, which in 0.22.1 only runs without speculative rows) with
`non_spec_token_indx`, both read from the step's GDN metadata in the forward context (the
same tensors for every GDN layer of the step). Aligned calls (every batch without a mix, CUDA
graph replays of uniform decode steps) pass through untouched. A mixed call whose index
cannot be found keeps vLLM's behaviour, is counted as unresolved and logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm_patch import rebind

logger = logging.getLogger("vllm_patch")

MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
TARGET = rebind.Target(
    module=MODULE, owner="", attr="fused_sigmoid_gating_delta_rule_update", version="0.22.1",
    params=("A_log", "a", "b", "dt_bias", "q", "k", "v", "beta", "threshold", "scale",
            "initial_state", "inplace_final_state", "cu_seqlens", "ssm_state_indices",
            "num_accepted_tokens", "use_qk_l2norm_in_kernel", "is_kda"),
    names=frozenset({"fused_sigmoid_gating_delta_rule_update_kernel"}),
    mark="__sm70_spec_gates__")
# The caller whose ungathered gates the wrapper corrects: it must still gather q/k/v by the
# step's indices and call the rebound name (checked, not wrapped).
CALLER = rebind.Target(
    module=MODULE, owner="QwenGatedDeltaNetAttention", attr="_forward_core",
    version="0.22.1", params=("self", "mixed_qkv", "b", "a", "core_attn_out"),
    names=frozenset({"fused_sigmoid_gating_delta_rule_update", "spec_token_indx",
                     "non_spec_token_indx", "index_select"}),
    mark="__sm70_spec_gates_caller__")
COUNTS: dict[str, int] = {"gathered_spec": 0, "gathered_non_spec": 0, "unresolved": 0}


class SpecGatesPatchError(rebind.RebindError):
    """The rebinding's target (or its caller) is not the function it was written against."""


def _step_metadata(attn_metadata: Any) -> Iterable[Any]:
    """The step's per-layer metadata objects that carry GDN token indices."""
    groups = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
    for group in groups:
        if isinstance(group, dict):
            for md in group.values():
                if hasattr(md, "spec_token_indx") and hasattr(md, "non_spec_token_indx"):
                    yield md


def find_index(attn_metadata: Any, which: str, rows: int) -> Any | None:
    """`spec_token_indx` or `non_spec_token_indx` of length `rows` from the step's GDN
    metadata (every GDN layer's metadata of one step holds the same token split)."""
    attr = f"{which}_token_indx"
    for md in _step_metadata(attn_metadata):
        idx = getattr(md, attr)
        if idx is not None and int(idx.shape[0]) == rows:
            return idx
    return None


def wrap(original: Any) -> Any:
    def fused_sigmoid_gating_delta_rule_update(*args: Any, **kwargs: Any) -> Any:
        if args:  # vLLM's layer passes every argument by keyword
            return original(*args, **kwargs)
        a, b, q = kwargs["a"], kwargs["b"], kwargs["q"]
        q_rows = int(q.shape[1]) if q.dim() == 4 else int(q.shape[0])
        if int(a.shape[0]) == q_rows:
            return original(**kwargs)
        from vllm.forward_context import get_forward_context

        speculative = kwargs.get("num_accepted_tokens") is not None
        which = "spec" if speculative else "non_spec"
        md = get_forward_context().attn_metadata
        idx = find_index(md, which, q_rows)
        if idx is None:
            COUNTS["unresolved"] += 1
            if COUNTS["unresolved"] == 1:
                logger.error("sm70 plugin: R10 found no %s_token_indx of %d rows for gates of "
                             "%d rows; this GDN call keeps vLLM's ungathered gates", which,
                             q_rows, int(a.shape[0]))
            return original(**kwargs)
        kwargs["a"] = a.index_select(0, idx)
        kwargs["b"] = b.index_select(0, idx)
        COUNTS[f"gathered_{which}"] += 1
        return original(**kwargs)

    return fused_sigmoid_gating_delta_rule_update


class _Installer(rebind.Installer):
    def install(self) -> str:
        import importlib

        import vllm

        module = importlib.import_module(MODULE)
        caller = getattr(module, CALLER.owner).__dict__.get(CALLER.attr)
        rebind.check(CALLER, caller, vllm.__version__, SpecGatesPatchError)
        return super().install()


_INSTALLER = _Installer(TARGET, wrap, "gathers the gates of mixed speculative GDN steps",
                        SpecGatesPatchError)
install = _INSTALLER.install
install_or_refuse = _INSTALLER.install_or_refuse
outcome = _INSTALLER.outcome
install_when_imported = _INSTALLER.install_when_imported
