"""Run vllm_patch.ops.reference's GPTQ functions on JSON input; print JSON (a child process).

    PYTHON_WITH_TORCH tests/ops_reference_probe.py < request.json

Exists so tests/test_ops_reference_gptq.py can check the reference from CI's tool
environment, which has no torch: the child runs where torch is (the serving environment).
Request: {"k", "n", "group", "zero_offset", "codes" [K][N], "zeros" [K/G][N], "scales"
[K/G][N], "qweight" [K/4][N], "qzeros" [K/G][N/4], "lm_head" [N][K]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_patch.ops import reference as ref


def main() -> int:
    req = json.load(sys.stdin)
    g, off = req["group"], req["zero_offset"]
    codes = torch.tensor(req["codes"], dtype=torch.uint8)
    zeros = torch.tensor(req["zeros"], dtype=torch.int64)
    scales = torch.tensor(req["scales"], dtype=torch.float32).half()
    qweight, qzeros, _ = ref.pack_gptq_int8(codes, zeros, scales, zero_offset=off)
    # the hand-packed checkpoint tensors, as a loader would read them
    hq = torch.tensor(req["qweight"], dtype=torch.int64).to(torch.int32)
    hz = torch.tensor(req["qzeros"], dtype=torch.int64).to(torch.int32)
    w = ref.dequant_gptq_int8(hq, hz, scales, g, zero_offset=off)
    qw, sz = ref.repack_gptq_int8(hq, hz, scales, g, zero_offset=off)
    lm_w = torch.tensor(req["lm_head"], dtype=torch.float32).half()
    lm_qw, lm_sz, lm_g = ref.quantize_lm_head_int8(lm_w)
    out = {
        "qweight": qweight.tolist(),
        "qzeros": qzeros.tolist(),
        "dtypes": [str(qweight.dtype), str(qzeros.dtype)],
        "w": w.tolist(),
        "qw": qw.tolist(),
        "sz": sz.float().tolist(),
        "sz_dtype": str(sz.dtype),
        "lm_qw": lm_qw.tolist(),
        "lm_sz": lm_sz.float().tolist(),
        "lm_group": lm_g,
        "lm_dequant": ref.dequant_repacked(lm_qw, lm_sz, lm_g).tolist(),
    }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
