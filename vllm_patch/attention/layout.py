"""The KV page as TRITON_ATTN lays it out for `int8_per_token_head`, seen through the views our
ops take (torch only, no vLLM).

vLLM 0.22.1 allocates each full-attention layer's cache as (num_blocks, 2, block_size, Hkv,
256 + 4) int8 (TritonAttentionBackend.get_kv_cache_shape; the hybrid allocator shares the
page with Gated DeltaNet state): K then V of a block side by side, each (token, head) row 256
codes and its fp32 scale in the row's last 4 bytes. Our backend keeps exactly that layout, so
vLLM's Triton prefill kernel and our kernels read the same bytes and the memory plan is the
stock one. torch.ops.sm70.kv_int8_write / paged_decode take K and V as [num_blocks, Hkv,
block_size, 256] views and the scales as [num_blocks, Hkv, block_size] views with any
strides: here those are transposes of the cache and of the scale views.

Rows of 260 bytes start only 4-byte aligned, so on this layout the decode kernel loads each
thread's 16 bytes of a row as four 4-byte words instead of one 16-byte load (the same bytes
and sectors, four times the load instructions; csrc/attention/decode_common.cuh).
"""

from __future__ import annotations

import torch

HEAD_SIZE = 256
SCALE_BYTES = 4  # one float32 per (token, head) row, in the row's padding


def check_page(kv_cache: torch.Tensor) -> None:
    """The layer's cache must be TRITON_ATTN's int8_per_token_head page."""
    shape = tuple(kv_cache.shape)
    if (kv_cache.dtype != torch.int8 or kv_cache.dim() != 5 or shape[1] != 2
            or shape[4] != HEAD_SIZE + SCALE_BYTES or kv_cache.stride(4) != 1):
        raise ValueError(
            f"KV cache {shape} {kv_cache.dtype}: SM70_PAGED expects TRITON_ATTN's "
            f"int8_per_token_head page (num_blocks, 2, block_size, Hkv, "
            f"{HEAD_SIZE + SCALE_BYTES}) int8 with contiguous rows")


def scale_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 scales of K and V, [num_blocks, block_size, Hkv] each: the last 4 bytes of
    every row read as one float (the same bytes TritonAttentionImpl's scale views name)."""
    check_page(kv_cache)
    words = kv_cache.view(torch.float32)  # [..., 65]: word 64 of a row is its scale
    last = HEAD_SIZE // SCALE_BYTES
    return words[:, 0, :, :, last], words[:, 1, :, :, last]


def op_views(kv_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v, k_scale, v_scale) as the sm70 ops take them: [num_blocks, Hkv, block_size, 256]
    int8 and [num_blocks, Hkv, block_size] float32 views of the same memory."""
    check_page(kv_cache)
    k = kv_cache[:, 0, :, :, :HEAD_SIZE].transpose(1, 2)
    v = kv_cache[:, 1, :, :, :HEAD_SIZE].transpose(1, 2)
    return k, v, k_scale.transpose(1, 2), v_scale.transpose(1, 2)


def fmha_views(kv_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int],
                          tuple[int, int, int]]:
    """(k_cache, v_cache, cache_strides, scale_strides) for fmha_prefill: the K and V halves
    of the page (each counted from its own first byte), their [block, token, head] strides
    and those of the [num_blocks, block_size, Hkv] scale views (TritonAttentionImpl's)."""
    check_page(kv_cache)
    k, v = kv_cache[:, 0], kv_cache[:, 1]
    if tuple(k_scale.stride()) != tuple(v_scale.stride()):
        raise ValueError(f"K and V scale strides differ: {k_scale.stride()} "
                         f"vs {v_scale.stride()}")
    cs = (int(k.stride(0)), int(k.stride(1)), int(k.stride(2)))
    ss = (int(k_scale.stride(0)), int(k_scale.stride(1)), int(k_scale.stride(2)))
    return k, v, cs, ss


def new_page(num_blocks: int, block_size: int, num_kv_heads: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed cache in that layout (tests and benchmarks)."""
    return torch.zeros(num_blocks, 2, block_size, num_kv_heads, HEAD_SIZE + SCALE_BYTES,
                       dtype=torch.int8, device=device)
