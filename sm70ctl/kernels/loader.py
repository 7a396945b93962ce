"""Build and load the torch extension that registers torch.ops.sm70.* (GPU machines).

torch.utils.cpp_extension compiles csrc/torch_bindings/sm70_ops.cu with the kernel headers
for the architectures in TORCH_CUDA_ARCH_LIST (7.0 on V100 with a CUDA 12 toolkit; 9.0 on
the H200 test machine, whose CUDA 13 cannot emit sm_70). Importing this module does not
import torch; `load_extension()` does.
"""

from __future__ import annotations

import os
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
EXTENSION_NAME = "sm70_kernels"
# nvcc flags of ours on top of torch's; CI compiles the extension for sm_70 with them too
# (tests/test_extension_nvcc.py)
EXTRA_CUDA_CFLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
_loaded = False


def extension_sources() -> list[Path]:
    return [CSRC / "torch_bindings" / "sm70_ops.cu"]


def build_dir() -> Path:
    base = os.environ.get("SM70_KERNELS_BUILD_DIR") or str(
        Path.home() / ".cache" / "sm70ctl" / "torch_ext"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_extension(verbose: bool = False) -> None:
    """Compile (cached by torch) and load the extension; idempotent."""
    global _loaded
    if _loaded:
        return
    from torch.utils.cpp_extension import load

    load(
        name=EXTENSION_NAME,
        sources=[str(p) for p in extension_sources()],
        extra_include_paths=[str(CSRC / "kernels")],
        extra_cflags=["-O3"],
        extra_cuda_cflags=list(EXTRA_CUDA_CFLAGS),
        build_directory=str(build_dir()),
        is_python_module=False,
        verbose=verbose,
    )
    _loaded = True
