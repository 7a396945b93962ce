"""Plain-PyTorch reference implementations of the sm70 ops, and the load-time repacks.

These define what the CUDA kernels must compute; the GPU tests compare against them. They
run anywhere torch runs (CPU included) and favour clarity over speed.

GPTQ int8 format (desc_act false, as the reference checkpoint uses):
  qweight [K/4, N] int32: byte j (little-endian) of qweight[i, n] is the code of row 4i+j
  qzeros  [K/G, N/4] int32: byte j of qzeros[g, i] is the stored zero of column 4i+j
  scales  [K/G, N] fp16
  w[k, n] = scales[k // G, n] * (code[k, n] - (zero[k // G, n] + zero_offset))
zero_offset is 1 for the classic ("v1") checkpoints, which store zero - 1.
"""

from __future__ import annotations

import math

import torch

QWEN_GQA_GROUP = 6
HEAD_DIM = 256


# ---------------------------------------------------------------- GPTQ int8 weights
def _unpack_bytes(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 tensor -> uint8 codes, the 4 bytes of each word expanded along `dim`."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    parts = [((p >> (8 * j)) & 0xFF) for j in range(4)]
    stacked = torch.stack(parts, dim=dim + 1)  # [..., 4] next to dim
    shape = list(packed.shape)
    shape[dim] *= 4
    return stacked.reshape(shape).to(torch.uint8)


def _pack_bytes(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 codes -> int32 words holding 4 consecutive codes along `dim` (inverse)."""
    c = codes.to(torch.int64)
    shape = list(c.shape)
    shape[dim] //= 4
    shape.insert(dim + 1, 4)
    c = c.reshape(shape)
    word = sum((c.select(dim + 1, j) << (8 * j)) for j in range(4))
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def pack_gptq_int8(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, zero_offset: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Build GPTQ checkpoint tensors from codes [K, N] (0..255), zeros [K/G, N], scales."""
    qweight = _pack_bytes(codes, 0)
    stored = (zeros.to(torch.int64) - zero_offset).clamp(0, 255).to(torch.uint8)
    qzeros = _pack_bytes(stored, 1)
    return qweight, qzeros, scales.to(torch.float16)


def dequant_gptq_int8(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 128,
    zero_offset: int = 1,
) -> torch.Tensor:
    """W [K, N] in float32 from GPTQ int8 tensors."""
    codes = _unpack_bytes(qweight, 0).to(torch.float32)  # [K, N]
    zeros = _unpack_bytes(qzeros, 1).to(torch.float32) + zero_offset  # [K/G, N]
    k = codes.shape[0]
    g = torch.arange(k, device=codes.device) // group_size
    return scales.to(torch.float32)[g] * (codes - zeros[g])


def repack_gptq_int8(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 128,
    zero_offset: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ int8 -> the GEMV layout: qw [N, K] uint8 codes, sz [N, K/G, 2] fp16 (scale, zero).

    Output-major codes let a warp stream one output row's K codes with 16-byte loads; the
    zero (stored + offset, exact in fp16) sits beside its scale so one 4-byte load fetches
    both. Runs on whatever device the inputs are on (load time, once per weight).
    """
    codes = _unpack_bytes(qweight, 0)  # [K, N]
    zeros = _unpack_bytes(qzeros, 1).to(torch.float32) + zero_offset  # [K/G, N]
    if codes.shape[0] % group_size:
        raise ValueError(f"K={codes.shape[0]} is not a multiple of group_size={group_size}")
    qw = codes.t().contiguous()
    sz = torch.stack([scales.to(torch.float32).t(), zeros.t()], dim=-1).to(torch.float16)
    return qw, sz.contiguous()


def dequant_repacked(qw: torch.Tensor, sz: torch.Tensor, group_size: int) -> torch.Tensor:
    """W^T [N, K] in float32 from the GEMV layout."""
    k = qw.shape[1]
    g = torch.arange(k, device=qw.device) // group_size
    scale = sz[..., 0].to(torch.float32)[:, g]
    zero = sz[..., 1].to(torch.float32)[:, g]
    return scale * (qw.to(torch.float32) - zero)


def quantize_lm_head_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Symmetric per-row int8 for the lm_head [N, K]: returns (qw, sz, group_size=K).

    Codes are stored as q + 128 with zero 128, so the GEMV kernel serves it unchanged.
    """
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale).clamp(-127, 127)
    qw = (q + 128).to(torch.uint8).contiguous()
    sz = torch.stack([scale, torch.full_like(scale, 128.0)], dim=-1).to(torch.float16)
    return qw, sz.contiguous(), weight.shape[1]


def gemv_reference(
    x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x W (+ bias) in float64, W given as W^T [N, K] (any float dtype)."""
    y = x.to(torch.float64) @ w_t.to(torch.float64).t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y


# ---------------------------------------------------------------- int8 KV cache
def kv_int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, head) symmetric int8 of x [..., D]: (codes int8, scale float32 [...])."""
    f = x.to(torch.float32)
    amax = f.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(f * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def kv_int8_write_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, H, D] at their slots (in place); slots < 0 are skipped."""
    block_size = k_cache.shape[2]
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        q, s = kv_int8_quantize(src)
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            blk, off = divmod(slot, block_size)
            cache[blk, :, off] = q[t]
            scale[blk, :, off] = s[t]


def gather_kv(
    cache: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor, ctx: int
) -> torch.Tensor:
    """Dequantised [ctx, H, D] float32 for one sequence."""
    block_size = cache.shape[2]
    nblk = (ctx + block_size - 1) // block_size
    blocks = block_table[:nblk].long()
    c = cache[blocks].to(torch.float32) * scale[blocks].unsqueeze(-1)  # [nblk, H, bs, D]
    return c.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:ctx]


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_per_seq: int,
    sm_scale: float,
) -> torch.Tensor:
    """Attention of q [B*QN, Hq, D] over the dequantised paged cache, float32 result.

    Query row i of a sequence with context L sits at position L - QN + i and sees keys
    0..L - QN + i (causal among the QN new tokens, which are already in the cache).
    """
    hq = q.shape[1]
    hkv = k_cache.shape[1]
    group = hq // hkv
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, ctx in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, k_scale, block_tables[b], ctx)  # [L, Hkv, D]
        v = gather_kv(v_cache, v_scale, block_tables[b], ctx)
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qb = q[b * q_per_seq : (b + 1) * q_per_seq].to(torch.float32)  # [QN, Hq, D]
        s = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale  # [Hq, QN, L]
        pos = torch.arange(ctx, device=q.device)
        limit = ctx - q_per_seq + torch.arange(q_per_seq, device=q.device)
        s = s.masked_fill(pos[None, None, :] > limit[None, :, None], -math.inf)
        p = torch.softmax(s, dim=-1)
        out[b * q_per_seq : (b + 1) * q_per_seq] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def decode_num_splits(
    max_context: int,
    batch: int,
    kv_heads: int,
    sm_count: int,
    max_splits: int = 64,
    min_tokens_per_split: int = 256,
    ctas_per_sm: int = 2,
) -> int:
    """num_splits for paged_decode so the grid is one full wave of resident blocks.

    The op runs num_splits x batch blocks per KV head and cuts the batch's tokens into
    equal chunks over them (a long context batched with short ones gets most blocks).
    Every block does the same work, so a grid of 1.3 waves costs two block durations; the
    largest count whose grid still fits the resident blocks at once is the fastest.
    ctas_per_sm: decode blocks resident per SM, as
    torch.ops.sm70.paged_decode_blocks_per_sm reports it: 2 on V100 (47 KB of static shared
    memory each, 96 KB per SM); on the H200's m16n8k16 path 4 for QN <= 2, 3 for QN = 4.
    """
    slots = max(1, ctas_per_sm) * max(1, sm_count)
    want = max(1, slots // max(1, batch * kv_heads))
    by_len = max(1, math.ceil(max_context / min_tokens_per_split))
    return max(1, min(max_splits, want, by_len))


# ---------------------------------------------------------------- low-rank GEMM
def lowrank_reference(
    x: torch.Tensor,
    w_t: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    row_mask: torch.Tensor | None,
) -> torch.Tensor:
    """y = x W + mask * ((x A) B) (+ bias) in float64; W as W^T [N, K], A [K, r], B [r, N]."""
    y = gemv_reference(x, w_t, bias)
    if a is not None and b is not None and a.shape[1] > 0:
        corr = (x.to(torch.float64) @ a.to(torch.float64)) @ b.to(torch.float64)
        if row_mask is not None:
            corr = corr * row_mask.to(torch.float64).unsqueeze(1)
        y = y + corr
    return y
