"""Run vllm_patch.ops.reference_gdn on JSON input; print JSON (a child process).

    PYTHON_WITH_TORCH tests/gdn_reference_probe.py < request.json

Exists so tests/test_gdn_reference.py can check the references from CI's tool environment,
which has no torch: the child runs where torch is (the serving environment). Request:
{"op": "recurrent" | "conv_update" | "conv_prefill" | "drift", "args": {name: {"dtype", "data"}},
"kwargs": {...plain values}}; the reply holds the output and every tensor argument after
the call (the references update their state arguments in place).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_patch.ops import reference_gdn as ref

OPS = {
    "recurrent": ref.gdn_recurrent_reference,
    "conv_update": ref.conv1d_update_reference,
    "conv_prefill": ref.conv1d_prefill_reference,
}


def tensor(spec: dict | None) -> torch.Tensor | None:
    if spec is None:
        return None
    return torch.tensor(spec["data"], dtype=getattr(torch, spec["dtype"]))


def drift(req: dict) -> dict:
    """One sequence decoded token by token with a float64 state and with an int16 state
    (both through the reference); per step, the largest row error of the int16 state in L2
    norm over the bound the docs give: the sum over its stores of sqrt(dk) s / 2."""
    a = {name: tensor(spec) for name, spec in req["args"].items()}
    hv, dv, dk = a["state"].shape[1:]
    s64 = torch.zeros(2, hv, dv, dk, dtype=torch.float64)
    s64[1] = a["state"][0]
    codes, scale = ref.state_int16_quantize(s64)
    bound = (dk**0.5) * scale.double()[1] / 2  # the initial state's own rounding
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    idx = torch.tensor([1], dtype=torch.int32)
    ratios, errors = [], []
    for t in range(a["qkv"].shape[0]):
        step = [a[k][t : t + 1] for k in ("qkv", "a", "b")]
        for state, sc in ((s64, None), (codes, scale)):
            ref.gdn_recurrent_reference(*step, a["A_log"], a["dt_bias"], state, qsl, idx, None,
                                        req["kwargs"]["num_k_heads"], state_scale=sc)
        bound = bound + (dk**0.5) * scale.double()[1] / 2
        err = (ref.state_int16_dequantize(codes, scale)[1] - s64[1]).norm(dim=-1)  # [HV, dv]
        ratios.append(float((err / bound).max()))
        errors.append(float(err.max()))
    return {"ratios": ratios, "errors": errors}


def main() -> int:
    req = json.load(sys.stdin)
    if req["op"] == "drift":
        json.dump(drift(req), sys.stdout)
        return 0
    args = {name: tensor(spec) for name, spec in req["args"].items()}
    out = OPS[req["op"]](**args, **req.get("kwargs", {}))
    reply = {"out": out.tolist(), "dtype": str(out.dtype)}
    reply["after"] = {
        name: (None if t is None else t.to(torch.float64).tolist()) for name, t in args.items()
    }
    json.dump(reply, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
