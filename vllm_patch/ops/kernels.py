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


def gptq_dequant(qw: Tensor, sz: Tensor, group_size: int, out: Tensor) -> Tensor:
    """out [N, K] fp16 = W^T dequantised from the GEMV layout (scale * (q - zero), rounded
    once); returns out."""
    _ops().gptq_dequant(qw, sz, group_size, out)
    return out


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


GDN_HEAD = 128  # key and value head size the chunked prefill is built for


def gdn_chunk_problem(
    qkv: Tensor,
    a: Tensor,
    b: Tensor,
    state: Tensor,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor | None,
    num_k_heads: int,
) -> str | None:
    """Why gdn_chunk_prefill cannot take these arguments (one line), or None. Reads only
    shapes and dtypes (no device sync); the op checks strides and alignment itself."""
    import torch

    if state.dim() != 4 or tuple(state.shape[2:]) != (GDN_HEAD, GDN_HEAD):
        return f"state must be [slots, HV, {GDN_HEAD}, {GDN_HEAD}], got {list(state.shape)}"
    if state.dtype != torch.float32:
        return f"state must be float32, got {state.dtype}"
    hv = state.shape[1]
    if num_k_heads < 1 or hv % num_k_heads:
        return f"num_k_heads must divide the state's {hv} value heads, got {num_k_heads}"
    width = 2 * num_k_heads * GDN_HEAD + hv * GDN_HEAD
    if qkv.dim() != 2 or qkv.shape[1] != width:
        return f"qkv must be [T, {width}] (2 x {num_k_heads} key heads + {hv} value heads of " \
               f"{GDN_HEAD}), got {list(qkv.shape)}"
    tokens = qkv.shape[0]
    for name, t in (("qkv", qkv), ("a", a), ("b", b)):
        if t.dtype != torch.float16:
            return f"{name} must be float16, got {t.dtype}"
    for name, t in (("a", a), ("b", b)):
        if tuple(t.shape) != (tokens, hv):
            return f"{name} must be [{tokens}, {hv}], got {list(t.shape)}"
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        return "query_start_loc must be [N + 1]"
    n = query_start_loc.numel() - 1
    for name, t in (("query_start_loc", query_start_loc), ("state_indices", state_indices)):
        if t.dtype != torch.int32:
            return f"{name} must be int32, got {t.dtype}"
    if state_indices.dim() not in (1, 2) or state_indices.shape[0] != n:
        return f"state_indices must be [N] or [N, S] with N = {n}, got {list(state_indices.shape)}"
    if has_initial_state is not None and (
        has_initial_state.dtype != torch.bool or tuple(has_initial_state.shape) != (n,)
    ):
        return f"has_initial_state must be a [{n}] bool tensor"
    return None


def _raise_problem(op: str, problem: str | None) -> None:
    """A ValueError naming op and gdn_chunk_problem's reason, if it gave one."""
    if problem is not None:
        raise ValueError(f"{op}: {problem}")


def gdn_chunk_prefill(
    qkv: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor | None,
    num_k_heads: int,
    scale: float,
) -> Tensor:
    """Gated DeltaNet prefill of varlen sequences, chunked on tensor cores: out [T, HV, 128]
    fp16 from the conv output qkv [T, 2 H 128 + HV 128] and gates a, b [T, HV]; sequence n
    starts from the float32 state [slots, HV, 128, 128] at slot state_indices[n] ([N], or
    column 0 of [N, S]) where has_initial_state[n] (zeros otherwise) and leaves its final
    state there (reference_gdn.gdn_prefill_reference defines it)."""
    _raise_problem("gdn_chunk_prefill", gdn_chunk_problem(
        qkv, a, b, state, query_start_loc, state_indices, has_initial_state, num_k_heads))
    return _ops().gdn_chunk_prefill(
        qkv, a, b, A_log, dt_bias, state, query_start_loc, state_indices, has_initial_state,
        num_k_heads, scale,
    )


GDN_CHUNK = 64  # tokens per chunk of both prefill ops


def gdn_chunk_indices(query_start_loc: Tensor) -> Tensor:
    """[NT, 2] int32 (sequence, chunk within it) for every 64-token chunk of the sequences
    query_start_loc [N + 1] delimits, on its device: the table vLLM's GDN metadata holds
    for FLA (`chunk_indices`) when no sequence is empty (FLA's numbering skips empty ones,
    ours counts them). Reads the lengths on the host (one device sync)."""
    import torch

    lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    rows = [[n, c] for n, length in enumerate(lens)
            for c in range((int(length) + GDN_CHUNK - 1) // GDN_CHUNK)]
    return torch.tensor(rows, dtype=torch.int32).view(-1, 2).to(query_start_loc.device)


def gdn_chunk_prefill_two_pass(
    qkv: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor | None,
    num_k_heads: int,
    scale: float,
    chunk_indices: Tensor | None = None,
) -> Tensor:
    """gdn_chunk_prefill's result in two passes (csrc/gdn/chunk_two_pass.cuh): every chunk's
    W, U and masked Q K^T at once into scratch, then the state recurrence chunk by chunk.
    chunk_indices [NT, 2] int32 (gdn_chunk_indices; vLLM's metadata has it) sizes the first
    pass without a device sync; without it the wrapper makes it (one sync)."""
    _raise_problem("gdn_chunk_prefill_two_pass", gdn_chunk_problem(
        qkv, a, b, state, query_start_loc, state_indices, has_initial_state, num_k_heads))
    if chunk_indices is None:
        chunk_indices = gdn_chunk_indices(query_start_loc)
    return _ops().gdn_chunk_prefill_two_pass(
        qkv, a, b, A_log, dt_bias, state, query_start_loc, state_indices, has_initial_state,
        chunk_indices, num_k_heads, scale,
    )


def fmha_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_scale: Tensor,
    v_scale: Tensor,
    cache_strides: tuple[int, int, int],
    scale_strides: tuple[int, int, int],
    block_table: Tensor,
    query_start_loc: Tensor,
    ctx_lens: Tensor,
    block_size: int,
    max_q_len: int,
    sm_scale: float,
) -> Tensor:
    """Causal chunked-prefill attention, head_dim 256, GQA Hq = G * Hkv: out [T, Hq, 256] fp16.

    Sequence b's chunk is q/k/v rows query_start_loc[b] .. query_start_loc[b+1] - 1
    (q [T, Hq, 256], k, v [T, Hkv, 256] fp16; token and head strides free, multiples of 8),
    at absolute positions ctx_lens[b] + i; each query sees its sequence's ctx_lens[b]
    earlier tokens in the paged int8 cache and the chunk's keys up to its own position.
    Cache addressing: the int8 of (block, token in block, KV head, dim) is element
    blk * cache_strides[0] + tok * cache_strides[1] + head * cache_strides[2] + dim of
    k_cache / v_cache (counted from the tensor's first element; the strides and both bases
    multiples of 4 bytes: the kernel reads 16, 8 or 4 bytes at a time, as they allow),
    dequantised as int8 x the fp32 scale at blk * scale_strides[0] + tok * scale_strides[1]
    + head * scale_strides[2] of k_scale / v_scale: any page layout (TRITON_ATTN's too),
    K, V and scales in one page or apart. block_table [>= B, max_blocks] int32 maps token
    j // block_size to its block; query_start_loc [B + 1] and ctx_lens [B] int32 on the
    device; max_q_len (a host int, >= the longest chunk) sizes the grid without a sync.
    The kernel trusts block_table and ctx_lens to name blocks inside the caches.
    reference_fmha.fmha_prefill_reference defines the result."""
    return _ops().fmha_prefill(
        q, k, v, k_cache, v_cache, k_scale, v_scale, list(cache_strides), list(scale_strides),
        block_table, query_start_loc, ctx_lens, block_size, max_q_len, sm_scale,
    )


def fmha_tc_peak(out: Tensor, iters: int, wide: bool = False) -> None:
    """The tensor-core ceiling loop: out.numel() / 256 blocks of 8 warps, each warp `iters`
    rounds of 8 independent m8n8k4 products (wide: m16n8k16, sm_80+ only) from registers;
    one instruction is 2048 FLOPs (m16n8k16: 4096). For the benchmarks' denominators."""
    _ops().fmha_tc_peak(out, iters, wide)
