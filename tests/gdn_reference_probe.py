"""Run vllm_patch.ops.reference_gdn on JSON input; print JSON (a child process).

    PYTHON_WITH_TORCH tests/gdn_reference_probe.py < request.json

Exists so tests/test_gdn_reference.py can check the references from CI's tool environment,
which has no torch: the child runs where torch is (the serving environment). Request:
{"op": "recurrent" | "conv_update" | "conv_prefill", "args": {name: {"dtype", "data"}},
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


def main() -> int:
    req = json.load(sys.stdin)
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
