"""CPU measurement of what vllm_patch/gdn/int16_scratch.py's `run_on_scratch` allocates, run
by tests/test_plan_gdn_scratch.py in the serving venv (it needs torch only; it holds no
tests itself).

    python plan_gdn_scratch_probe.py REQUEST.json RESULT.json

Every tensor the call allocates is recorded: a dispatch mode sees each op's outputs, and a
storage counts from its first output until the last tensor on it is gone; the result is the
peak of the bytes live at once and what is still live when the call returns. The ops are
the ones a CUDA step runs (gather, cast, multiply, round, clamp, scatter), whose outputs
have the same sizes on either device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _measure(request: dict[str, Any]) -> dict[str, Any]:
    import dataclasses
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_patch.gdn import int16_scratch

    class Live(TorchDispatchMode):
        def __init__(self, before: set[int]) -> None:
            super().__init__()
            self.before, self.groups = before, {}
            self.live = self.peak = 0

        def _gone(self, ptr: int) -> None:
            group = self.groups[ptr]
            group[0] -= 1
            if group[0] == 0:
                self.live -= group[1]
                del self.groups[ptr]

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if not isinstance(t, torch.Tensor):
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.before or t.untyped_storage().nbytes() == 0:
                    continue
                if ptr not in self.groups:
                    self.groups[ptr] = [0, t.untyped_storage().nbytes()]
                    self.live += self.groups[ptr][1]
                    self.peak = max(self.peak, self.live)
                self.groups[ptr][0] += 1
                weakref.finalize(t, self._gone, ptr)
            return out

    @dataclasses.dataclass
    class Meta:
        non_spec_state_indices_tensor: Any
        spec_state_indices_tensor: Any

    hv, dv, dk, channels, cols = request["shape"]
    out: dict[str, Any] = {}
    for name, (plain, spec) in request["layouts"].items():
        gen = torch.Generator().manual_seed(0)
        n = request["pool_slots"]
        conv = torch.randn(n, channels, cols, generator=gen).to(torch.float16)
        codes = torch.randint(-32767, 32768, (n, hv, dv, dk), generator=gen,
                              dtype=torch.int16)
        scale = torch.rand(n, hv, dv, generator=gen)
        meta = Meta(None if plain is None else torch.tensor(plain, dtype=torch.int32),
                    None if spec is None else torch.tensor(spec, dtype=torch.int32))
        given = [conv, codes, scale] + [t for t in (meta.non_spec_state_indices_tensor,
                                                    meta.spec_state_indices_tensor)
                                        if t is not None]
        mode = Live({t.untyped_storage().data_ptr() for t in given})
        with torch.no_grad(), mode:
            slots = int16_scratch.run_on_scratch(
                conv, codes, scale, meta, lambda c, s, m: s.mul_(0.5))
        out[name] = {"slots": slots, "peak": mode.peak, "left": mode.live,
                     "entries": sum(t.numel() for t in given[3:])}
    return out


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(_measure(request)))
