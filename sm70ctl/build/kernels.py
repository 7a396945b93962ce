"""Which csrc/ files `sm70ctl build` compiles: vllm_patch.ops.sources's lists, reused.

The translation units and the include folder are those of the ops loader (`vllm_patch.ops`),
so the library `sm70ctl build` installs is the one the loader would build itself; the kernel
headers (every .cuh under csrc/) are what the NVRTC check compiles for sm_70 and what the
compile step lists as its inputs.
"""

from __future__ import annotations

from pathlib import Path

from vllm_patch.ops import sources


def kernel_sources(csrc: Path) -> list[Path]:
    """The pure-CUDA kernel headers, every .cuh under csrc/ (sorted by path)."""
    return sorted(p for p in csrc.rglob("*.cuh") if p.is_file())


def binding_sources(csrc: Path) -> list[Path]:
    """The extension's translation units (csrc/torch_bindings/*.cu and *.cpp)."""
    return sources.translation_units(csrc)


def include_dirs(csrc: Path) -> list[Path]:
    return sources.include_dirs(csrc)
