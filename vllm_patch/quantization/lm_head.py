"""The int8 lm_head: vLLM builds `ParallelLMHead` without a quant config, so we swap its method.

`register()` installs `Sm70ParallelLMHead` as vLLM's out-of-tree replacement for
`ParallelLMHead` (PluggableLayer.register_oot: every `ParallelLMHead(...)` then builds ours).
It behaves exactly like vLLM's unless the model being built is quantized with sm70_gptq; then
its `quant_method` becomes `Int8LmHeadMethod`: the checkpoint's fp16 head loads as usual, is
quantized per row to int8 after loading (`reference.quantize_lm_head_int8` in row slices:
codes + 128 with zero 128, one group per row, so the GEMV serves it unchanged) and the fp16
copy is freed. The
MTP drafter shares the target's lm_head object (vLLM's proposer replaces the draft's head
with the target's), so the draft's logits use the same int8 head.
See vllm_patch/runtime_patches/README.md for what this changes in vLLM and why.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
)

from vllm_patch.quantization.sm70_gptq import NAME, int8_linear

_registered: list[str] = []


class Int8LmHeadMethod(UnquantizedEmbeddingMethod):
    """Creates the fp16 weight like vLLM's method; after loading, runs on int8 codes."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from vllm_patch.quantization.repack import quantize_lm_head_sliced

        # Row slices: reference.quantize_lm_head_int8's bytes without its fp32 copies of
        # the whole head at once.
        qw, sz, group = quantize_lm_head_sliced(layer.weight.data)
        layer.register_parameter("sm70_qw", torch.nn.Parameter(qw, requires_grad=False))
        layer.register_parameter("sm70_sz", torch.nn.Parameter(sz, requires_grad=False))
        layer.sm70_group_size = group
        # Keep a zero-size `weight` (vLLM's proposer probes it); the fp16 copy is freed.
        layer.weight.data = layer.weight.data.new_empty(0)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return int8_linear(x, layer.sm70_qw, layer.sm70_sz, layer.sm70_group_size, bias)

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the int8 lm_head has no embedding lookup (tied embeddings stay fp16)")


class Sm70ParallelLMHead(ParallelLMHead):
    """vLLM's ParallelLMHead, with the int8 method when the model is served by sm70_gptq."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        if _uses_sm70_gptq():
            self.quant_method = Int8LmHeadMethod()


def _uses_sm70_gptq() -> bool:
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    quant = getattr(cfg, "quant_config", None) if cfg is not None else None
    return quant is not None and quant.get_name() == NAME


def register() -> str:
    """Make ParallelLMHead(...) build Sm70ParallelLMHead (once per process)."""
    if not _registered:
        ParallelLMHead.register_oot(Sm70ParallelLMHead)
        _registered.append("int8 (Sm70ParallelLMHead)")
    return _registered[0]
