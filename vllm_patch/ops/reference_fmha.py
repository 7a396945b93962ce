"""Pure PyTorch definition of torch.ops.sm70.fmha_prefill (chunked-prefill attention over the
paged int8 KV cache plus the chunk's own fp16 K/V), and the per-token-head int8 quantiser
the tests fill caches with. Runs on any device; computes in float64.

Addressing (the op's, see vllm_patch.ops.kernels.fmha_prefill): the int8 value of (block,
token in block, KV head, dim) sits at element blk * cs[0] + tok * cs[1] + head * cs[2] + dim
of k_cache / v_cache (counted from the tensor's first element), its fp32 scale at
blk * ss[0] + tok * ss[1] + head * ss[2] of k_scale / v_scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HEAD_DIM = 256


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 codes [..., D], float32 scales [...]): scale = max|x| / 127 over
    the last dim, code = round(x / scale) clamped to [-127, 127]; an all-zero row stores
    scale 0 (the rule of the int8 KV write)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return codes, scale


def _flat(t: torch.Tensor, span: int) -> torch.Tensor:
    """The first `span` elements of t's memory as a 1-D view (t may be a strided view)."""
    return torch.as_strided(t, (span,), (1,), t.storage_offset())


def gather_context(
    cache: torch.Tensor,
    scale: torch.Tensor,
    cache_strides: Sequence[int],
    scale_strides: Sequence[int],
    blocks: torch.Tensor,
    ctx: int,
    block_size: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """The dequantised context [ctx, Hkv, 256] float64 of one sequence whose block-table
    row is `blocks`."""
    dev = cache.device
    if ctx == 0:
        return torch.zeros(0, num_kv_heads, HEAD_DIM, dtype=torch.float64, device=dev)
    j = torch.arange(ctx, device=dev)
    blk = blocks.to(dev).long()[j // block_size]
    off = j % block_size
    heads = torch.arange(num_kv_heads, device=dev)
    cs, ss = [int(s) for s in cache_strides], [int(s) for s in scale_strides]
    row = blk * cs[0] + off * cs[1]  # [ctx]
    elem = row[:, None, None] + heads[None, :, None] * cs[2] + torch.arange(HEAD_DIM, device=dev)
    srow = blk * ss[0] + off * ss[1]
    selem = srow[:, None] + heads[None, :] * ss[2]
    codes = _flat(cache, int(elem.max()) + 1)[elem].double()
    scales = _flat(scale, int(selem.max()) + 1)[selem].double()
    return codes * scales[..., None]


def fmha_prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    cache_strides: Sequence[int],
    scale_strides: Sequence[int],
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_size: int,
    sm_scale: float,
) -> torch.Tensor:
    """out [T, Hq, 256] float64: for sequence b, its q_len = qsl[b+1] - qsl[b] query tokens
    (q rows qsl[b] ..) at absolute positions ctx .. ctx + q_len - 1 (ctx = ctx_lens[b])
    attend causally to the ctx dequantised cache tokens and to the chunk's own k/v rows;
    query head h reads KV head h // (Hq / Hkv)."""
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq ({hq}) must be a multiple of Hkv ({hkv})")
    group = hq // hkv
    qsl = [int(x) for x in query_start_loc.tolist()]
    ctxs = [int(x) for x in ctx_lens.tolist()]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, ctx in enumerate(ctxs):
        q0, q1 = qsl[b], qsl[b + 1]
        n = q1 - q0
        if n == 0:
            continue
        kc = gather_context(k_cache, k_scale, cache_strides, scale_strides, block_table[b],
                            ctx, block_size, hkv).to(q.device)
        vc = gather_context(v_cache, v_scale, cache_strides, scale_strides, block_table[b],
                            ctx, block_size, hkv).to(q.device)
        keys = torch.cat([kc, k[q0:q1].double()], 0)  # [ctx + n, Hkv, D]
        vals = torch.cat([vc, v[q0:q1].double()], 0)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
        qq = q[q0:q1].double().transpose(0, 1)  # [Hq, n, D]
        s = torch.matmul(qq, keys.transpose(1, 2)) * sm_scale  # [Hq, n, L]
        pos = ctx + torch.arange(n, device=q.device)
        key = torch.arange(ctx + n, device=q.device)
        s = s.masked_fill(key[None, None, :] > pos[None, :, None], float("-inf"))
        out[q0:q1] = torch.matmul(torch.softmax(s, dim=-1), vals).transpose(0, 1)
    return out


def attention_flops(q_lens: Sequence[int], ctx_lens: Sequence[int], num_q_heads: int) -> int:
    """Multiply-add FLOPs (2 per MAC, QK^T and PV) of the causal chunked prefill: query
    token t of a chunk after ctx cached tokens sees ctx + t + 1 keys (pure)."""
    keys = sum(n * c + n * (n + 1) // 2 for n, c in zip(q_lens, ctx_lens, strict=True))
    return 4 * HEAD_DIM * num_q_heads * keys
