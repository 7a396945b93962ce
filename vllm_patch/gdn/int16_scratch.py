"""Prefill steps on an int16 pool: vLLM's FLA path on a float32 copy of the step's slots.

FLA's chunk kernel and vLLM's Triton conv read the pool as float32 / model dtype; they
cannot read int16 codes, and our chunked prefill is not written. So for a step with a
prefill row (and the decode rows vLLM batches with it) the layer gathers exactly the slots
the step's index tensors name, dequantises their recurrent rows into a float32 scratch
(the conv rows are copied as they are), hands vLLM's `_forward_core` that scratch with the
indices renumbered into it, and stores the scratch back afterwards: conv rows copied, the
recurrent rows requantised per row (one int16 rounding per step, the same store a decode
step makes, so the drift bound of docs/gdn.md holds). A row that was only read comes back
with the same codes (requantising a dequantised row is exact: its largest code is 32767).

Cost, per GDN layer and step with a prefill: 4 B x HV x 128 x 128 of scratch per slot
named (TP=2: 1.5 MiB; an MTP row names 1 + k slots), transient (the caching allocator
reuses it layer after layer; the plan counts the requantise's peak, about 4.6 MiB a slot
at TP=2 with its temporaries: sm70ctl/plan/gdn_scratch.py), and the gather, dequantise,
requantise and scatter passes over those slots, small against a prefill chunk's FLA work.

Negative indices (vLLM's PAD_SLOT_ID) stay negative, so the kernels skip them as before; the
null block 0 is always part of the scratch, at row 0, so it stays 0 and no real slot is
renumbered to 0 (our kernels skip slot 0 as padding: without this the step's lowest slot
was silently left out on our prefill ops).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from vllm_patch.ops.reference_gdn import state_int16_quantize

# The kernels' scheme, one definition (step = max|row| / 32767, codes rounded to nearest).
quantize_rows = state_int16_quantize


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)


def step_slots(meta: Any) -> torch.Tensor:
    """The distinct non-negative slots the step's index tensors name, sorted (int64), with
    the null block 0 always first: renumbered, a real slot then never becomes 0, which our
    kernels (like vLLM's null block) skip as padding."""
    parts = [t.reshape(-1) for t in (meta.non_spec_state_indices_tensor,
                                     meta.spec_state_indices_tensor) if t is not None]
    if not parts:
        return torch.empty(0, dtype=torch.int64)
    flat = torch.cat(parts).to(torch.int64)
    null = torch.zeros(1, dtype=torch.int64, device=flat.device)
    return torch.unique(torch.cat([null, flat[flat >= 0]]))


def renumber(indices: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor | None:
    """`indices` as positions in `slots` (sorted), negatives kept, dtype and shape kept."""
    if indices is None:
        return None
    idx = indices.to(torch.int64)
    pos = torch.searchsorted(slots.to(idx.device), idx.clamp(min=0))
    return torch.where(idx >= 0, pos, idx).to(indices.dtype)


def run_on_scratch(conv: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, meta: Any,
                   run: Callable[[torch.Tensor, torch.Tensor, Any], None]) -> int:
    """Call run(conv_scratch, fp32_state_scratch, renumbered_meta) and store the result back
    into the pool views conv / codes / scale in place; returns the number of slots."""
    slots = step_slots(meta).to(codes.device)
    conv_s = conv[slots].contiguous()
    state_s = dequantize_rows(codes[slots], scale[slots]).contiguous()
    meta_s = dataclasses.replace(
        meta,
        non_spec_state_indices_tensor=renumber(meta.non_spec_state_indices_tensor, slots),
        spec_state_indices_tensor=renumber(meta.spec_state_indices_tensor, slots))
    run(conv_s, state_s, meta_s)
    conv[slots] = conv_s
    new_codes, new_scale = quantize_rows(state_s)
    codes[slots] = new_codes
    scale[slots] = new_scale
    return int(slots.numel())
