"""Call each sm70 op with one invalid input per case; print what it said (a child process).

    python3 tests/gpu/reject_probe.py CASE ...   (a child of test_ops_surface_gpu.py: a
    crash in one op must not end the test run)

Prints one line per case: `CASE REJECTED <first line of the error>` or `CASE ACCEPTED`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_patch.ops import kernels
from vllm_patch.ops.loader import load_ops


def gemv(m: int, k: int, g: int, n: int = 8, bias: int | None = None) -> Callable[[], object]:
    def call() -> object:
        qw = torch.zeros(n, k, dtype=torch.uint8, device="cuda")
        sz = torch.ones(n, max(1, k // g), 2, dtype=torch.float16, device="cuda")
        x = torch.zeros(m, k, device="cuda").half()
        b = None if bias is None else torch.zeros(bias, device="cuda").half()
        return torch.ops.sm70.gptq_gemv(x, qw, sz, g, b)

    return call


def decode(qn: int, hq: int = 12, splits: int = 1) -> Callable[[], object]:
    def call() -> object:
        kc = torch.zeros(4, 2, 16, 256, dtype=torch.int8, device="cuda")
        ks = torch.ones(4, 2, 16, device="cuda")
        q = torch.zeros(qn, hq, 256, device="cuda").half()
        tables = torch.zeros(1, 4, dtype=torch.int32, device="cuda")
        seq = torch.tensor([8], dtype=torch.int32, device="cuda")
        return torch.ops.sm70.paged_decode(q, kc, kc, ks, ks, tables, seq, qn, 0.0625, splits)

    return call


CASES: dict[str, Callable[[], object]] = {
    "gemv-rows": gemv(9, 128, 128),  # at most 8 rows
    "gemv-group": gemv(1, 128, 100),  # group_size a multiple of 16 dividing K
    "gemv-k": gemv(1, 72, 8),  # K a multiple of 16
    "gemv-bias": gemv(2, 128, 128, bias=7),  # bias of N elements
    "decode-qn": decode(5),  # 1..4 query rows per sequence
    "decode-gqa": decode(1, hq=8),  # 6 query heads per KV head
    "decode-splits": decode(1, splits=0),  # at least one split
    "arch-path": lambda: torch.ops.sm70.set_arch_path("sm75"),
}


def main() -> int:
    load_ops()
    assert kernels.arch_path() == "native"
    for case in sys.argv[1:] or list(CASES):
        try:
            CASES[case]()
            torch.cuda.synchronize()
        except RuntimeError as exc:
            print(case, "REJECTED", str(exc).strip().splitlines()[0], flush=True)
            continue
        print(case, "ACCEPTED", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
