"""Call torch.ops.sm70.gptq_gemv with one invalid input; print the error (child process).

python3 tests/gpu/reject_probe.py rows|group
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sm70ctl.kernels.loader import load_extension

CASES = {"rows": (9, 128), "group": (1, 100)}


def main() -> int:
    load_extension()
    m, g = CASES[sys.argv[1]]
    qw = torch.zeros(8, 128, dtype=torch.uint8, device="cuda")
    sz = torch.zeros(8, 1, 2, dtype=torch.float16, device="cuda")
    x = torch.zeros(m, 128, device="cuda").half()
    try:
        torch.ops.sm70.gptq_gemv(x, qw, sz, g, None)
    except RuntimeError as exc:
        print("REJECTED:", str(exc).splitlines()[0], flush=True)
        return 0
    print("ACCEPTED", flush=True)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
