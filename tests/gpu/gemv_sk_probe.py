"""Call torch.ops.sm70.gptq_gemv's stream-K path with one invalid use; print the error.

python3 tests/gpu/gemv_sk_probe.py rows|kernel|tc-k   (a child of test_kernels_gpu.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sm70ctl.kernels.loader import load_extension


def call(case: str) -> None:
    qw = torch.zeros(8, 128, dtype=torch.uint8, device="cuda")
    sz = torch.ones(8, 1, 2, dtype=torch.float16, device="cuda")
    if case == "rows":  # stream-K takes one row
        x = torch.zeros(2, 128, device="cuda").half()
        torch.ops.sm70.gptq_gemv(x, qw, sz, 128, None, 0, 4)
    elif case == "tc-k":  # the tensor-core kernels need K % 128 == 0
        qw = torch.zeros(8, 144, dtype=torch.uint8, device="cuda")
        sz = torch.ones(8, 9, 2, dtype=torch.float16, device="cuda")
        x = torch.zeros(3, 144, device="cuda").half()
        torch.ops.sm70.gptq_gemv(x, qw, sz, 16, None, 0, 10)
    else:  # no such kernel id
        x = torch.zeros(1, 128, device="cuda").half()
        torch.ops.sm70.gptq_gemv(x, qw, sz, 128, None, 0, 99)


def main() -> int:
    load_extension()
    try:
        call(sys.argv[1])
    except RuntimeError as exc:
        print("REJECTED:", str(exc).splitlines()[0], flush=True)
        return 0
    print("ACCEPTED", flush=True)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
