"""Which GPUs the plan is for: `--gpus NxSIZE`, NVML, or the reference pair.

The NVML probe is the only side effect here; it returns plain data and imports pynvml
lazily, so the CLI starts fast and works on machines without a driver.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

from sm70ctl.errors import UsageError
from sm70ctl.plan.plan import Gpu

# What NVML reports as total memory for a Tesla V100-SXM2-32GB (32,510.5 MiB): the
# driver keeps part of the 32 GiB of HBM2 for itself and shows the rest.
V100_32GB_TOTAL = 34_089_730_048
REFERENCE_NAME = "Tesla V100-SXM2-32GB (reference)"

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_COUNT = re.compile(r"^\s*(\d+)\s*[xX*]\s*(.+)$")


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
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(
            f"--gpus: {text!r} is not a memory size",
            hint="write sizes like 32GiB, 16GB, 34089730048, or v100 (NVML's V100-32GB total)",
        )
    value = math.floor(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise UsageError(f"--gpus: {text!r} must be more than 0 bytes")
    return value


def parse_gpus(spec: str) -> list[Gpu]:
    """'2x32GiB' or '32GiB,16GiB' (one size per GPU) -> GPUs 0..n-1."""
    sizes: list[int] = []
    for part in spec.split(","):
        m = _COUNT.match(part)
        count, size = (int(m.group(1)), m.group(2)) if m else (1, part)
        if count < 1 or count > 64:
            raise UsageError(f"--gpus: {part!r}: count must be 1..64")
        sizes += [parse_size(size)] * count
    return [Gpu(i, f"GPU {i} ({s:,} B)", s) for i, s in enumerate(sizes)]


def probe_nvml() -> list[dict[str, int | str]] | None:
    """GPUs as NVML reports them (index, name, total bytes), or None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        out: list[dict[str, int | str]] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            out.append({"index": i, "name": name,
                        "total": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)})
        return out or None
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def reference_gpus(n: int) -> list[Gpu]:
    return [Gpu(i, REFERENCE_NAME, V100_32GB_TOTAL) for i in range(n)]


def resolve_gpus(spec: str | None, needed: int,
                 nvml: list[dict[str, int | str]] | None) -> GpuSource:
    """Pick the GPUs (pure given the probe's result): --gpus, else NVML, else reference."""
    if spec:
        return GpuSource(parse_gpus(spec), "--gpus", f"as given: --gpus {spec}")
    if nvml:
        gpus = [Gpu(int(d["index"]), str(d["name"]), int(d["total"])) for d in nvml]
        return GpuSource(gpus, "nvml", f"{len(gpus)} GPU(s) read through NVML")
    return GpuSource(
        reference_gpus(needed), "reference",
        f"no NVML and no --gpus: the reference {needed} x Tesla V100-SXM2-32GB "
        f"({V100_32GB_TOTAL:,} B each, NVML's total for that card)",
    )
