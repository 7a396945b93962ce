"""Which rows of one batch are Clef's, and which path a corrected linear layer takes (pure).

vLLM lays a batch out request by request: request i's scheduled tokens are the rows
query_start_loc[i] .. query_start_loc[i + 1] of every linear layer's input, and the rows
after the last request up to the padded count (CUDA-graph padding) belong to nobody. So the
per-row mask is built once per batch from that layout and the set of Clef requests; every
corrected layer reads the same mask (`clef_token_ranges`, `row_mask_bytes`).

The path (`choose_path`):
- PLAIN: the layer's own dispatch, no correction: layers without a correction, and eager
  batches without a Clef row (chat-only batches pay nothing);
- ADDED (the default for every corrected call): the layer's own dispatch for all rows (the
  GEMV at <= 8 rows, sm70_gptq's GEMV slices or dequantised cuBLAS GEMM above), then the
  correction (x A^T) B^T computed for the masked rows and added. A chat row is computed by
  the very kernel a chat-only batch of the same size uses, so its bits are the same; sending
  a mixed batch to another kernel (the int8 GEMM) would change the chat rows' rounding.
  At <= 8 rows the two small GEMMs read A and B once, as any kernel must.
- FUSED (the fused mode, `fused=True`, above the GEMV's rows): the int8 GEMM with the
  correction in the same launch (`int8_gemm_lowrank`, row_mask), one launch per slice of a
  fused layer. Chat rows keep their bits only if chat-only batches of that layer run the
  same int8 GEMM, so in this mode a corrected layer's plain calls above the GEMV do too;
  since sm70_gptq serves rows above the GEMV with cuBLAS on dequantised slices (faster
  than the int8 GEMM's m8n8k4 tiles), the mode is off by default.
- During CUDA-graph capture the corrected path is captured whatever this batch holds: a
  replay runs no Python, so the mask (a device buffer the replays read) must decide, and a
  graph captured PLAIN would skip the correction of any Clef row replayed through it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.layout import CLEF_LAYERS, Correction, corrections, fused_slices
from vllm_patch.clef.model_dims import ModelDims
from vllm_patch.clef.sharding import Ranges, shard, slice_offsets

PLAIN, FUSED, ADDED = "plain", "fused", "added"
_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.([a-z_]+\.[a-z_]+)$")


def clef_token_ranges(query_start_loc: Sequence[int], is_clef: Sequence[bool],
                      num_tokens: int) -> tuple[tuple[int, int], ...]:
    """The rows of a batch that belong to Clef requests, as merged half-open ranges.

    `query_start_loc` has one entry per request plus one (vLLM's layout, starting at 0),
    `is_clef` one flag per request, `num_tokens` the padded row count of the forward."""
    if len(query_start_loc) != len(is_clef) + 1:
        raise ClefError(f"query_start_loc has {len(query_start_loc)} entries for "
                        f"{len(is_clef)} requests (it needs requests + 1)")
    if query_start_loc[0] != 0:
        raise ClefError(f"query_start_loc starts at {query_start_loc[0]}, not 0")
    out: list[tuple[int, int]] = []
    for i, flag in enumerate(is_clef):
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if hi < lo:
            raise ClefError(f"query_start_loc decreases at request {i} ({lo} -> {hi})")
        if not flag or hi == lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    if int(query_start_loc[-1]) > num_tokens:
        raise ClefError(f"the batch's {query_start_loc[-1]} scheduled tokens exceed its "
                        f"{num_tokens} rows")
    return tuple(out)


def row_mask_bytes(ranges: Sequence[tuple[int, int]], num_tokens: int) -> bytes:
    """One byte per row: 1 for a Clef row, 0 for a chat row or padding."""
    mask = bytearray(num_tokens)
    for lo, hi in ranges:
        mask[lo:hi] = b"\x01" * (hi - lo)
    return bytes(mask)


def choose_path(corrected: bool, rows: int, gemv_max_rows: int, any_clef: bool,
                capturing: bool, quantized: bool = True, fused: bool = False) -> str:
    """PLAIN, FUSED or ADDED for one call of a linear layer (see the module's docstring);
    FUSED only in the fused mode (`fused`), above the GEMV's rows, for int8 layers."""
    if not corrected or rows == 0 or not (any_clef or capturing):
        return PLAIN
    if quantized and fused and rows > gemv_max_rows:
        return FUSED
    return ADDED


@dataclass(frozen=True)
class SlicePlan:
    """One slice of a corrected layer on one rank: its correction, what of A and B the rank
    keeps, and the output columns [out_lo, out_hi) of the layer it corrects."""

    correction: Correction
    a_cols: Ranges
    b_rows: Ranges
    out_lo: int
    out_hi: int


def parse_prefix(prefix: str) -> tuple[int, str] | None:
    """(decoder layer, module under it) of a vLLM layer prefix such as
    `language_model.model.layers.40.mlp.gate_up_proj`; None for anything else."""
    m = _PREFIX.search(prefix)
    if m is None or prefix.split(".")[0] in ("mtp", "visual"):
        return None
    return int(m.group(1)), m.group(2)


def layer_plan(d: ModelDims, prefix: str, tp: int, tp_rank: int,
               output_size: int | None = None) -> tuple[SlicePlan, ...]:
    """The slices of the vLLM layer at `prefix` on rank `tp_rank` of `tp`, in output order;
    () for a layer Clef does not correct. `output_size` (the layer's output features on
    this rank) is checked against the slices when given."""
    where = parse_prefix(prefix)
    if where is None or where[0] not in CLEF_LAYERS:
        return ()
    group = fused_slices(corrections(d)).get(where)
    if not group:
        return ()
    bounds = slice_offsets(group, tp)
    plans = tuple(SlicePlan(c, s.a_cols, s.b_rows, lo, hi)
                  for c, (lo, hi), s in zip(group, bounds, (shard(c, tp, tp_rank)
                                                            for c in group), strict=True))
    if output_size is not None and plans[-1].out_hi != output_size:
        raise ClefError(f"layer {prefix}: {output_size} output features on this rank, but "
                        f"Clef's slices ({', '.join(c.module for c in group)}) cover "
                        f"{plans[-1].out_hi} at TP={tp}")
    return plans
