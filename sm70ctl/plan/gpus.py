"""Which GPUs the plan is for: `--gpus NxSIZE`, NVML, or the reference pair.

The NVML probe (sm70ctl.devices.nvml) is the only side effect here; SM70_GPUS entries are
resolved by the rule serve and doctor use (sm70ctl.devices.selection).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sm70ctl.devices.selection import resolve_gpus as resolve_entries
from sm70ctl.errors import Sm70Error, UsageError
from sm70ctl.plan.plan import Gpu

# What NVML reports as total memory for a Tesla V100-SXM2-32GB (32,510.5 MiB): the
# driver keeps part of the 32 GiB of HBM2 for itself and shows the rest.
V100_32GB_TOTAL = 34_089_730_048
REFERENCE_NAME = "Tesla V100-SXM2-32GB (reference)"

# No entry for "": a bare number is refused (`--gpus 2x16` once meant 16 bytes per GPU);
# a byte count says so with B.
_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_MAX_BYTES = 1 << 50
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_COUNT = re.compile(r"^\s*(\d+)\s*[xX*]\s*(.+)$")


@dataclass(frozen=True)
class _Listed:
    """An NVML row as the SM70_GPUS resolver reads it."""

    index: int
    uuid: str | None


@dataclass(frozen=True)
class GpuSource:
    gpus: list[Gpu]
    source: str  # "--gpus", "nvml", "reference"
    note: str


def parse_size(text: str) -> int:
    """'32GiB' -> 34359738368; '16GB' -> 16000000000; 'v100' -> NVML's V100-32GB total."""
    if text.strip().lower() in ("v100", "v100-32gb", "v100-sxm2-32gb"):
        return V100_32GB_TOTAL
    m = _SIZE.match(text)
    hint = "write sizes like 32GiB, 16GB, 34089730048B, or v100 (NVML's V100-32GB total)"
    if m and not m.group(2):
        raise UsageError(
            f"--gpus: {text!r} has no unit: a size needs one (B, KiB, MiB, GiB, TiB, KB, MB, "
            "GB, TB)", hint=f"{hint}; e.g. {m.group(1)}GiB")
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"--gpus: {text!r} is not a memory size", hint=hint)
    number = float(m.group(1)) * _UNITS[m.group(2).lower()]
    # a digit string too long for a float becomes inf; no GPU has more than 1 PiB
    if not math.isfinite(number) or number > _MAX_BYTES:
        raise UsageError(f"--gpus: {text!r} is more than 1 PiB per GPU")
    value = math.floor(number)
    if value <= 0:
        raise UsageError(f"--gpus: {text!r} must be more than 0 bytes")
    return value


def parse_gpus(spec: str) -> list[Gpu]:
    """'2x32GiB' or '32GiB,16GiB' (one size per GPU) -> GPUs 0..n-1."""
    sizes: list[int] = []
    for part in spec.split(","):
        m = _COUNT.match(part)
        count, size = (int(m.group(1)), m.group(2)) if m else (1, part)
        if not 1 <= count <= 64:
            raise UsageError(f"--gpus: {part!r}: count must be 1..64")
        sizes += [parse_size(size)] * count
    return [Gpu(i, f"GPU {i} ({s:,} B)", s) for i, s in enumerate(sizes)]


def probe_nvml() -> list[dict[str, int | str]] | None:
    """GPUs as NVML reports them (index, name, uuid, total bytes), or None without NVML:
    the one NVML probe (sm70ctl.devices.nvml) reduced to what the plan reads."""
    from sm70ctl.devices.nvml import probe_nvml as probe

    nvml = probe()
    if not nvml.available:
        return None
    out: list[dict[str, int | str]] = [
        {"index": g.index, "name": g.name or f"GPU {g.index}", "uuid": g.uuid or "",
         "total": g.memory_total_bytes}
        for g in nvml.gpus if g.memory_total_bytes is not None
    ]
    return out or None


def reference_gpus(n: int) -> list[Gpu]:
    return [Gpu(i, REFERENCE_NAME, V100_32GB_TOTAL) for i in range(n)]


def resolve_gpus(spec: str | None, needed: int,
                 nvml: list[dict[str, int | str]] | None,
                 selected: Sequence[str] = ()) -> GpuSource:
    """Pick the GPUs (pure given the probe's result): --gpus, else NVML, else reference.

    With NVML, `selected` (SM70_GPUS: indices or GPU-UUIDs) picks the cards serve would
    use, in that order; without it the first ones are taken."""
    if spec is not None:
        return GpuSource(parse_gpus(spec), "--gpus", f"as given: --gpus {spec}")
    if nvml:
        devices = nvml
        if selected:
            by_index = {int(d["index"]): d for d in nvml}
            seen = [_Listed(i, str(d.get("uuid") or "") or None) for i, d in by_index.items()]
            matches = resolve_entries(selected, seen)
            bad = next((m for m in matches if m.problem), None)
            if bad is not None:
                why = f"NVML has no GPU {bad.entry!r}" if bad.hits == 0 else bad.problem
                raise Sm70Error(
                    f"SM70_GPUS={','.join(selected)}: {why} (indices 0..{len(nvml) - 1})",
                    hint="set SM70_GPUS to indices or UUIDs from `nvidia-smi -L`, or "
                         "plan other cards with --gpus",
                )
            devices = [by_index[m.index] for m in matches if m.index is not None]
        gpus = [Gpu(int(d["index"]), str(d["name"]), int(d["total"])) for d in devices]
        which = f" (SM70_GPUS={','.join(selected)})" if selected else ""
        return GpuSource(gpus, "nvml", f"{len(gpus)} GPU(s) read through NVML{which}")
    return GpuSource(
        reference_gpus(needed), "reference",
        f"no NVML and no --gpus: the reference {needed} x Tesla V100-SXM2-32GB "
        f"({V100_32GB_TOTAL:,} B each, NVML's total for that card)",
    )
