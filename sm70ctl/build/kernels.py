"""Which csrc/ files `sm70ctl build` compiles: the kernels package's own lists, reused.

The kernel headers are the `csrc/kernels/*.cuh` files that tests/test_kernels_compile.py
compiles one by one with NVRTC 12.8 for sm_70; the translation units and include folder
are those of `sm70ctl.kernels.loader` (the torch extension). Reading both from one place
keeps the build and the CI check on the same list.
"""

from __future__ import annotations

from pathlib import Path

KERNEL_GLOB = "kernels/*.cuh"


def kernel_sources(csrc: Path) -> list[Path]:
    """The pure-CUDA kernel headers (each compiles for sm_70 on its own)."""
    return sorted(p for p in csrc.glob(KERNEL_GLOB) if p.is_file())


def binding_sources(csrc: Path) -> list[Path]:
    """The extension's translation units, as the kernels loader declares them."""
    from sm70ctl.kernels import loader

    return [csrc / p.relative_to(loader.CSRC) for p in loader.extension_sources()]


def include_dirs(csrc: Path) -> list[Path]:
    return [csrc / "kernels"]
