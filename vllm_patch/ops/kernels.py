"""Typed wrappers over torch.ops.sm70.*; each loads the ops first (`loader.load_ops`).

The shapes and dtypes each op takes are checked by the op itself (a RuntimeError naming the
argument and the rule); these wrappers add only the loading and the Python signature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_patch.ops.loader import load_ops

if TYPE_CHECKING:
    from torch import Tensor

ARCH_PATHS = ("native", "sm70")


def _ops() -> Any:  # torch's op namespace has no public type
    import torch

    load_ops()
    return torch.ops.sm70


def gptq_gemv(
    x: Tensor, qw: Tensor, sz: Tensor, group_size: int, bias: Tensor | None = None
) -> Tensor:
    """y [M, N] fp16 = x [M, K] fp16 (M = 1..8) times the int8 weights in the GEMV layout
    (qw [N, K] uint8 codes, sz [N, K/G, 2] fp16 scale and zero; see reference.repack_gptq_int8),
    plus bias [N]. The op picks the kernel for M and K."""
    return _ops().gptq_gemv(x, qw, sz, group_size, bias)


def int8_gemm(
    x: Tensor,
    qw: Tensor,
    sz: Tensor,
    group_size: int,
    bias: Tensor | None = None,
    a_t: Tensor | None = None,
    b_t: Tensor | None = None,
    row_mask: Tensor | None = None,
) -> Tensor:
    """y [M, N] fp16 = x W + bias for any M, with the optional low-rank correction
    row_mask * ((x A) B), A given as a_t [r, K] and B as b_t [N, r]."""
    return _ops().int8_gemm_lowrank(x, qw, sz, group_size, bias, a_t, b_t, row_mask)


def kv_int8_write(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_scale: Tensor,
    v_scale: Tensor,
    slot_mapping: Tensor,
) -> None:
    """Quantise key/value [T, Hkv, 256] per (token, head) to int8 and store them, with their
    scales, at slot_mapping's slots (in place; negative slots are skipped)."""
    _ops().kv_int8_write(key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_scale: Tensor,
    v_scale: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    q_per_seq: int,
    sm_scale: float,
    num_splits: int,
) -> Tensor:
    """Attention of q [B * q_per_seq, Hq, 256] over the int8 paged cache, split over
    num_splits chunks per sequence (reference.decode_num_splits sizes it); fp16 [like q]."""
    return _ops().paged_decode(
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, q_per_seq, sm_scale,
        num_splits,
    )


def paged_decode_blocks_per_sm(q_per_seq: int, device: int = -1) -> int:
    """Decode blocks resident per SM on `device` (-1: the current one), from the driver."""
    return int(_ops().paged_decode_blocks_per_sm(q_per_seq, device=device))


def set_arch_path(path: str) -> None:
    """Process-wide: "native" (the device's own instantiations, the default) or "sm70" (the
    Volta m8n8k4 instantiations on any GPU, for testing them on newer cards). Not for serving."""
    if path not in ARCH_PATHS:
        raise ValueError(f"arch path must be one of {', '.join(ARCH_PATHS)}, got {path!r}")
    _ops().set_arch_path(path)


def arch_path() -> str:
    """The process-wide architecture path set_arch_path chose."""
    return str(_ops().arch_path())


def gdn_recurrent_decode(
    qkv: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    query_start_loc: Tensor,
    state_indices: Tensor,
    num_accepted: Tensor | None,
    num_k_heads: int,
    scale: float,
    state_scale: Tensor | None = None,
) -> Tensor:
    """Gated DeltaNet decode of 1 + k tokens per sequence: out [T, HV, 128] fp16 from the
    conv output qkv [T, 2 H 128 + HV 128], gates a, b [T, HV], the states of `state`
    [slots, HV, 128, 128] (float32, or int16 with state_scale [slots, HV, 128]) at the
    slots state_indices [N] or [N, 1 + k] names, updated in place per token position
    (reference_gdn.gdn_recurrent_reference defines it)."""
    return _ops().gdn_recurrent_decode(
        qkv, a, b, A_log, dt_bias, state, state_scale, query_start_loc, state_indices,
        num_accepted, num_k_heads, scale,
    )


def gdn_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    query_start_loc: Tensor,
    state_indices: Tensor,
    num_accepted: Tensor | None = None,
    silu: bool = True,
) -> Tensor:
    """Decode-side causal conv (width 4) of x [T, D] fp16, 1 + k tokens per sequence, over
    the window in conv_state [slots, 3 + k, D] (vLLM's SD layout) at state_indices' column
    0, which it advances in place (reference_gdn.conv1d_update_reference defines it)."""
    return _ops().gdn_conv1d_update(
        x, conv_state, weight, bias, query_start_loc, state_indices, num_accepted, silu
    )


def gdn_conv1d_prefill(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor | None,
    silu: bool = True,
) -> Tensor:
    """Prefill causal conv (width 4) of varlen sequences in x [T, D] fp16, each starting from
    its state's window where has_initial_state and leaving its last 3 inputs there
    (reference_gdn.conv1d_prefill_reference defines it)."""
    return _ops().gdn_conv1d_prefill(
        x, conv_state, weight, bias, query_start_loc, state_indices, has_initial_state, silu
    )
