"""Run a few sm70 kernels once each on representative shapes, for `ncu` to profile.

    ncu --clock-control none -k regex:'gptq_gemv|paged_decode_kernel' \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python3 tests/gpu/profile_kernels.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_patch.ops import reference as ref
from vllm_patch.ops.loader import load_ops


def main() -> None:
    load_ops()
    n, k = 7168, 5120
    qw = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda")
    sz = torch.rand(n, k // 128, 2, device="cuda").half()
    x = torch.randn(1, k, device="cuda").half()
    for _ in range(3):
        torch.ops.sm70.gptq_gemv(x, qw, sz, 128, None)
    ctx, bs = 262144, 16
    nb = ctx // bs
    kc = torch.randint(-127, 128, (nb, 2, bs, 256), dtype=torch.int8, device="cuda")
    vc = torch.randint(-127, 128, (nb, 2, bs, 256), dtype=torch.int8, device="cuda")
    ks = torch.rand(nb, 2, bs, device="cuda")
    vs = torch.rand(nb, 2, bs, device="cuda")
    table = torch.randperm(nb, device="cuda").int()[None]
    seq = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 12, 256, device="cuda").half()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = int(torch.ops.sm70.paged_decode_blocks_per_sm(1))
    splits = ref.decode_num_splits(ctx, 1, 2, sms, max_splits=256, ctas_per_sm=blocks)
    for _ in range(3):
        torch.ops.sm70.paged_decode(q, kc, vc, ks, vs, table, seq, 1, 0.0625, splits)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
