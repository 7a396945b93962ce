"""The chunked prefill's error bounds, shared by tests/gpu/test_gdn_chunk_gpu.py (which
derives them in its docstring) and the CPU check of the derivation in
tests/test_gdn_chunk_reference.py (a float64 emulation of the kernel's fp16 roundings must
fit them with room, and a decay applied one token late must not). No torch import: the
functions take tensors and use only their methods.
"""

from __future__ import annotations

from typing import Any

HEAD = 128
SCALE = HEAD**-0.5  # the q scale the tests pass (dk^-0.5)
OUT_TOL = 2e-3  # of scale x M per output element
STATE_TOL = 2e-3  # of M per state element
FP16_U = 2.0**-11
SUBNORMAL = 2.0**-24  # fp16's subnormal step: outputs that decayed to nothing


def magnitude(final_state: Any, initial_state: Any | None, v_abs: Any) -> Any:
    """M per value head [HV]: the largest state row norm (final, and initial when the
    sequence starts from one) plus the largest |v| of the sequence (v_abs [L, HV, dv])."""
    rows = final_state.norm(dim=-1).amax(dim=-1)
    if initial_state is not None:
        rows = rows.maximum(initial_state.norm(dim=-1).amax(dim=-1))
    return rows + v_abs.amax(dim=(0, 2)).to(rows.dtype)


def out_bound(want: Any, m: Any) -> Any:
    """Elementwise bound on |out - want| for want [L, HV, dv], M [HV]."""
    return FP16_U * want.abs() + OUT_TOL * SCALE * m.view(1, -1, 1) + SUBNORMAL


def state_bound(m: Any) -> Any:
    """Bound on |state - want| per element of a [HV, dv, dk] state."""
    return STATE_TOL * m.view(-1, 1, 1)
