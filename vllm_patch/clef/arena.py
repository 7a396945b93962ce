"""How many bytes one rank's Clef shards take on its GPU: one allocation for all of them (pure).

Attached as one tensor per A and B (372 of them at the reference shapes), the shards took
more than their own bytes from PyTorch's caching allocator, measured on the H200
(`tests/gpu/results/h200_clef_layers.json`, step `memory`): a large-pool block is handed
out unsplit when its remainder would be at most 1 MiB, so a tensor just under a 2 MiB
multiple takes the whole multiple. The loader therefore makes one allocation per rank and
places every shard in it (`clef_correction.ShardArena`):
- each shard starts at a multiple of ALIGN bytes (what cudaMalloc gives a tensor of its
  own, so the kernels' vector loads see the same alignment);
- the allocation is a multiple of SEGMENT bytes (2 MiB: the allocator rounds a large
  segment to it), so the allocator hands out exactly that many bytes.
`sm70ctl plan` counts with this rule (sm70ctl/plan/clef.py calls `arena_bytes` on its own
tensor table; tests/test_clef_plan.py holds that table equal to the format's shards), so the
plan's figure is what the run allocates.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from vllm_patch.clef.layout import corrections
from vllm_patch.clef.model_dims import ModelDims
from vllm_patch.clef.sharding import shard

ALIGN = 256
SEGMENT = 2 << 20
FP16 = 2


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the next shard start."""
    return _round_up(nbytes, ALIGN)


def placed_bytes(shard_bytes: Iterable[int]) -> int:
    """The room shards of these sizes take, placed in order: what the allocation must hold."""
    return sum(aligned(n) for n in shard_bytes)


def arena_bytes(shard_bytes: Iterable[int]) -> int:
    """The one allocation that holds shards of these sizes (what the plan counts)."""
    return _round_up(placed_bytes(shard_bytes), SEGMENT)


def shard_sizes(d: ModelDims, rank: int, tp: int,
                layers: Collection[int] | None = None) -> list[int]:
    """Bytes of each A and B shard one rank of `tp` holds (every rank holds the same), for
    the corrected linears of `layers` (None: every Clef layer; a pipeline stage passes its
    own)."""
    out: list[int] = []
    for c in corrections(d):
        if layers is not None and c.layer not in layers:
            continue
        s = shard(c, tp, 0)
        (ra, ka), (nb, rb) = s.a_shape(rank), s.b_shape(rank)
        out += [ra * ka * FP16, nb * rb * FP16]
    return out
