"""Call torch.ops.sm70.gptq_gemv with one invalid input; print the error (child process).

python3 tests/gpu/reject_probe.py rows|group|sk-rows|kernel|tc-k   (a child of
test_kernels_gpu.py: a crash must not end the test run)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_patch.ops.loader import load_ops

# case: (M, K, group_size, kernel)
CASES = {
    "rows": (9, 128, 128, 0),  # at most 8 rows
    "group": (1, 128, 100, 0),  # group_size a multiple of 16 dividing K
    "sk-rows": (2, 128, 128, 4),  # stream-K takes one row
    "kernel": (1, 128, 128, 99),  # no such kernel id
    "tc-k": (3, 144, 16, 10),  # the tensor-core kernels need K % 128 == 0
}


def main() -> int:
    load_ops()
    m, k, g, kernel = CASES[sys.argv[1]]
    qw = torch.zeros(8, k, dtype=torch.uint8, device="cuda")
    sz = torch.ones(8, max(1, k // g), 2, dtype=torch.float16, device="cuda")
    x = torch.zeros(m, k, device="cuda").half()
    try:
        torch.ops.sm70.gptq_gemv(x, qw, sz, g, None, 0, kernel)
    except RuntimeError as exc:
        print("REJECTED:", str(exc).splitlines()[0], flush=True)
        return 0
    print("ACCEPTED", flush=True)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
