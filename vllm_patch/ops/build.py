"""How the ops library is compiled and named: one place for the flags and the identity.

A library is only good for the runtime it was built against (the C++ ABI of torch, its CUDA
build, the Python ABI) and for the sources it was built from, so its file name carries a key
over exactly those (`library_key`). The loader looks for that name among prebuilt libraries;
`sm70ctl build` (through sm70ctl/build/compile_kernels.py) and the loader's own JIT build both
call `build_library`, so the two cannot drift apart in flags or naming.

Importing this module does not import torch; `runtime_identity` and `build_library` do.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

from vllm_patch.ops import sources

LIBRARY_PREFIX = "sm70_ops_"
# nvcc flags of ours on top of torch's; TORCH_CUDA_ARCH_LIST (from the environment) picks the
# -gencode flags. CI compiles the extension for sm_70 with these too (test_extension_nvcc.py).
EXTRA_CUDA_CFLAGS = ("-O3", "--expt-relaxed-constexpr", "-lineinfo")
EXTRA_CFLAGS = ("-O3",)
IDENTITY_FIELDS = ("os", "torch", "cuda", "python", "source_hash")


def library_key(identity: dict[str, str]) -> str:
    """16 hex digits over the identity fields and our flags (pure)."""
    missing = [f for f in IDENTITY_FIELDS if not identity.get(f)]
    if missing:
        raise ValueError(f"library identity lacks {', '.join(missing)}")
    items = {f: identity[f] for f in IDENTITY_FIELDS}
    items["flags"] = " ".join(EXTRA_CUDA_CFLAGS + EXTRA_CFLAGS)
    text = json.dumps(items, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def library_name(key: str) -> str:
    """The extension name (also the file stem): sm70_ops_<key>."""
    return f"{LIBRARY_PREFIX}{key}"


def host_identity() -> dict[str, str]:
    """OS and Python ABI of this interpreter (no torch)."""
    return {
        "os": f"{platform.system().lower()}-{platform.machine()}",
        "python": sys.implementation.cache_tag or f"py{sys.version_info[0]}{sys.version_info[1]}",
    }


def runtime_identity(csrc: Path | None = None) -> dict[str, str]:
    """What a library must match here: OS, torch, torch's CUDA, Python, the sources' hash."""
    import torch

    return {
        **host_identity(),
        "torch": str(torch.__version__),
        "cuda": str(torch.version.cuda or "none"),
        "source_hash": sources.source_hash(csrc),
    }


def build_library(
    out_dir: Path,
    csrc: Path | None = None,
    *,
    verbose: bool = False,
    nvcc_threads: int | None = None,
) -> Path:
    """Compile csrc/ into out_dir/sm70_ops_<key>.so (loading it into this process, as
    torch.utils.cpp_extension does) and write its identity beside it as .json."""
    from torch.utils.cpp_extension import load

    root = csrc if csrc is not None else sources.csrc_dir()
    identity = runtime_identity(root)
    name = library_name(library_key(identity))
    build_dir = Path(out_dir) / f"{name}.obj"
    build_dir.mkdir(parents=True, exist_ok=True)
    cuda_flags = list(EXTRA_CUDA_CFLAGS)
    if nvcc_threads:
        cuda_flags.append(f"--threads={nvcc_threads}")  # parallel gencode; same output
    load(
        name=name,
        sources=[str(p) for p in sources.translation_units(root)],
        extra_include_paths=[str(p) for p in sources.include_dirs(root)],
        extra_cflags=list(EXTRA_CFLAGS),
        extra_cuda_cflags=cuda_flags,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=verbose,
    )
    lib = Path(out_dir) / f"{name}.so"
    os.replace(build_dir / f"{name}.so", lib)
    meta = {**identity, "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST", "")}
    lib.with_suffix(".json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return lib
