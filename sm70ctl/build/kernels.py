"""The list of our csrc/ kernel sources: one definition for the build and the CI check.

`sm70ctl build` compiles exactly these (through the torch bindings that include them),
and tests/test_kernels_compile.py compiles the same list with NVRTC 12.8 for sm_70.
"""

from __future__ import annotations

from pathlib import Path

KERNEL_GLOBS = ("kernels/*.cuh", "kernels/*.cu")
BINDING_GLOBS = ("torch_bindings/*.cpp", "torch_bindings/*.cu", "torch_bindings/*.h")


def kernel_sources(csrc: Path) -> list[Path]:
    """Pure-CUDA kernel files (each must compile for sm_70 on its own)."""
    return sorted({p for g in KERNEL_GLOBS for p in csrc.glob(g) if p.is_file()})


def binding_sources(csrc: Path) -> list[Path]:
    """Host-side torch bindings: the translation units the extension is built from."""
    return sorted({p for g in BINDING_GLOBS for p in csrc.glob(g) if p.is_file()})
