"""What one tensor-parallel rank keeps of a correction's A [rank, K] and B [N, rank] (pure).

The rule follows the base layer's own split, so the correction needs no communication of
its own:
- column-parallel (q/k/v, gate/up, the GDN input projections): the rank computes only its
  output features, so A stays whole and B keeps the rows of the rank's output features,
  taken block by block as vLLM lays them out (`layout.Block`);
- row-parallel (o_proj, out_proj, down_proj): the rank sees only its slice of the input
  features, so A keeps those columns and B stays whole; each rank's (x_r A_r^T) B^T is a
  partial product, and the all-reduce that already sums the base layer's partial outputs
  sums these too.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.layout import COLUMN, Block, Correction

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Shard:
    """Half-open index ranges: A's columns and B's rows one rank keeps, in order."""

    a_cols: Ranges
    b_rows: Ranges

    def a_shape(self, rank: int) -> tuple[int, int]:
        return (rank, sum(hi - lo for lo, hi in self.a_cols))

    def b_shape(self, rank: int) -> tuple[int, int]:
        return (sum(hi - lo for lo, hi in self.b_rows), rank)


def _merge(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def block_ranges(blocks: tuple[Block, ...], tp: int, tp_rank: int, what: str) -> Ranges:
    """The features of `blocks` rank `tp_rank` of `tp` keeps: each block split into equal
    runs of whole heads; a block with fewer heads than ranks (and `replicate`) gives each
    group of tp / heads ranks the same head."""
    out: list[tuple[int, int]] = []
    start = 0
    for b in blocks:
        if b.units % tp == 0:
            per = b.units // tp
            lo = start + tp_rank * per * b.unit
            out.append((lo, lo + per * b.unit))
        elif b.replicate and tp % b.units == 0:
            head = tp_rank // (tp // b.units)
            out.append((start + head * b.unit, start + (head + 1) * b.unit))
        else:
            rule = ("divide the ranks or be divisible by them" if b.replicate
                    else "be divisible by it")
            raise ClefError(f"{what}: {b.units} heads cannot be split over TP={tp} "
                            f"(the count must {rule})")
        start += b.features
    return _merge(out)


def shard(c: Correction, tp: int, tp_rank: int) -> Shard:
    """What rank `tp_rank` of `tp` keeps of correction `c`."""
    if tp < 1 or not 0 <= tp_rank < tp:
        raise ClefError(f"tensor parallel rank {tp_rank} of {tp} is not a rank")
    if c.parallel == COLUMN:
        return Shard(((0, c.in_features),),
                     block_ranges(c.n_blocks, tp, tp_rank, f"{c.stem} (output features)"))
    return Shard(block_ranges(c.k_blocks, tp, tp_rank, f"{c.stem} (input features)"),
                 ((0, c.out_features),))


def shard_bytes(c: Correction, rank: int, tp: int, elem_bytes: int = 2) -> int:
    """Bytes of A and B one rank holds (every rank holds the same amount)."""
    s = shard(c, tp, 0)
    (ra, ka), (nb, rb) = s.a_shape(rank), s.b_shape(rank)
    return (ra * ka + nb * rb) * elem_bytes


def slice_offsets(group: list[Correction], tp: int) -> list[tuple[int, int]]:
    """Where each slice's corrected rows sit in its fused layer's output on one rank.

    vLLM's merged column-parallel layers lay one rank's output out as the rank's part of
    each slice in slice order (qkv_proj: q, k, v; in_proj_qkvz: in_proj_qkv's q, k, v, then
    z), so slice i's rows start where the slices before it end. `group` is one fused
    layer's corrections in slice order (`layout.fused_slices`)."""
    out: list[tuple[int, int]] = []
    pos = 0
    for c in group:
        n = shard(c, tp, 0).b_shape(1)[0]
        out.append((pos, pos + n))
        pos += n
    return out
