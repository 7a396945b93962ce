"""The one rule set for SM70_GPUS: which GPUs its entries name (pure).

An entry is an NVML index ("0"), a GPU-UUID ("GPU-3f0e...") or a unique prefix of one
(case-insensitive). NVML numbers GPUs in PCI bus order, which is what serving sets with
CUDA_DEVICE_ORDER=PCI_BUS_ID, so an index means the same card on both sides. Anything
else (a MIG UUID, a name) names no GPU. Doctor, plan, serve and warmup all resolve
through `resolve_gpus`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class HasIndexAndUuid(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str | None: ...


@dataclass(frozen=True)
class GpuMatch:
    """What one SM70_GPUS entry names: an index, or why it names none."""

    entry: str
    index: int | None
    problem: str | None = None
    hits: int = 1  # GPUs the entry matched: 0 none, more than 1 an ambiguous UUID prefix


def resolve_gpus(entries: Sequence[str], gpus: Sequence[HasIndexAndUuid]) -> list[GpuMatch]:
    """One match per entry, in the entries' order. A GPU named a second time is a problem
    (its index is still given, so a count of found GPUs stays right)."""
    out: list[GpuMatch] = []
    seen: set[int] = set()
    for raw in entries:
        entry = str(raw).strip()
        if entry.isdigit():
            hit = [g.index for g in gpus if g.index == int(entry)]
        elif entry.upper().startswith("GPU-"):
            hit = [g.index for g in gpus if g.uuid and g.uuid.lower().startswith(entry.lower())]
        else:
            hit = []
        if len(hit) == 1:
            problem = f"{entry} names GPU {hit[0]} twice" if hit[0] in seen else None
            seen.add(hit[0])
            out.append(GpuMatch(entry, hit[0], problem))
        elif len(hit) > 1:
            out.append(GpuMatch(entry, None, f"{entry} matches {len(hit)} GPUs", len(hit)))
        else:
            out.append(GpuMatch(entry, None, f"{entry} matches no GPU (found {len(gpus)})", 0))
    return out


def resolve_gpu_entries(
    entries: Sequence[str], gpus: Sequence[HasIndexAndUuid]
) -> tuple[list[int], list[str]]:
    """The indices the entries name, in order, and every problem (serving needs none)."""
    matches = resolve_gpus(entries, gpus)
    indices = [m.index for m in matches if m.index is not None]
    return indices, [m.problem for m in matches if m.problem]
