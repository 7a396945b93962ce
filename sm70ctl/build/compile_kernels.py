"""Compile csrc/ into the torch extension library; run by the serving interpreter.

    SERVE_PYTHON compile_kernels.py --csrc CSRC --out DIR

Runs inside the serving environment (it needs that environment's torch, whose ABI the
library must match); `sm70ctl build` calls it with TORCH_CUDA_ARCH_LIST, CUDA_HOME, CC
and MAX_JOBS set. The result is DIR/sm70_kernels.so, loaded by vllm_patch through
torch.ops.load_library. Standalone on purpose: it cannot import sm70ctl.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

KERNEL_GLOBS = ("kernels/*.cuh", "kernels/*.cu")  # keep in step with sm70ctl/build/kernels.py
BINDING_GLOBS = ("torch_bindings/*.cpp", "torch_bindings/*.cu")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csrc", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sources = sorted(str(p) for g in BINDING_GLOBS for p in args.csrc.glob(g))
    if not sources:
        print(f"error: {args.csrc}/torch_bindings has no .cpp/.cu sources to build",
              file=sys.stderr)
        return 1
    from torch.utils.cpp_extension import load

    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "7.0")
    flags = [f"-gencode=arch=compute_{arch.replace('.', '')},code=sm_{arch.replace('.', '')}",
             "-O3", "--use_fast_math", "-std=c++17"]
    threads = os.environ.get("NVCC_THREADS")
    if threads:
        flags.append(f"--threads={threads}")
    build = args.out / "obj"
    build.mkdir(parents=True, exist_ok=True)
    load(name="sm70_kernels", sources=sources, extra_include_paths=[str(args.csrc)],
         extra_cuda_cflags=flags, extra_cflags=["-O3", "-std=c++17"],
         build_directory=str(build), is_python_module=False, verbose=True)
    lib = build / "sm70_kernels.so"
    os.replace(lib, args.out / "sm70_kernels.so")
    print(f"built {args.out / 'sm70_kernels.so'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
