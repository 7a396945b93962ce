"""Load-time conversions into our kernels' layout, done in slices to bound the peak memory.

`vllm_patch.ops.reference` defines the conversions (`repack_gptq_int8`,
`quantize_lm_head_int8`); they widen every code to int64/float32 on the way, several times
the layer's size at once (a 17408 x 5120 gate_up layer needs about 1.6 GB, the 124,160 x 5120
lm_head of one TP=2 rank about 7.6 GB). Both are independent per output row, so running them
on slices of output rows gives the same bytes with the peak of one slice. Imports torch only
(no vLLM), so CPU tests check it against the unsliced references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

REPACK_COLS = 4096  # output columns per slice (a multiple of 4: qzeros packs 4 per int32)
LM_HEAD_ROWS = 16384


def repack_gptq_sliced(
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    group_size: int,
    zero_offset: int,
    cols: int = REPACK_COLS,
) -> tuple[Tensor, Tensor]:
    """`reference.repack_gptq_int8` over slices of `cols` output columns: (qw [N, K], sz)."""
    import torch

    from vllm_patch.ops.reference import repack_gptq_int8

    if cols % 4:
        raise ValueError(f"cols={cols} must be a multiple of 4 (packed zeros)")
    n = qweight.shape[1]
    k = qweight.shape[0] * 4
    qw = torch.empty((n, k), dtype=torch.uint8, device=qweight.device)
    sz = torch.empty((n, k // group_size, 2), dtype=torch.float16, device=qweight.device)
    for c0 in range(0, n, cols):
        c1 = min(n, c0 + cols)
        q, s = repack_gptq_int8(
            qweight[:, c0:c1], qzeros[:, c0 // 4 : (c1 + 3) // 4], scales[:, c0:c1],
            group_size, zero_offset,
        )
        qw[c0:c1] = q
        sz[c0:c1] = s
    return qw, sz


def quantize_lm_head_sliced(
    weight: Tensor, rows: int = LM_HEAD_ROWS
) -> tuple[Tensor, Tensor, int]:
    """`reference.quantize_lm_head_int8` over slices of `rows` rows: (qw, sz, group_size)."""
    import torch

    from vllm_patch.ops.reference import quantize_lm_head_int8

    n, k = weight.shape
    qw = torch.empty((n, k), dtype=torch.uint8, device=weight.device)
    sz = torch.empty((n, 1, 2), dtype=torch.float16, device=weight.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        q, s, _ = quantize_lm_head_int8(weight[r0:r1])
        qw[r0:r1] = q
        sz[r0:r1] = s
    return qw, sz, k
