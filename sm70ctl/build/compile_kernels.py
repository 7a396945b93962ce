"""Compile csrc/ into the torch extension library; run by the serving interpreter.

    SERVE_PYTHON compile_kernels.py --out DIR --source F.cu ... --include DIR ...

Runs inside the serving environment (it needs that environment's torch, whose ABI the
library must match); `sm70ctl build` passes the sources and include folders of
`sm70ctl.kernels.loader` and sets TORCH_CUDA_ARCH_LIST, CUDA_HOME, CC and MAX_JOBS.
The result is DIR/sm70_kernels.so, loaded by vllm_patch through torch.ops.load_library.
Standalone on purpose: the serving environment need not have sm70ctl's dependencies.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--source", action="append", default=[])
    ap.add_argument("--include", action="append", default=[])
    args = ap.parse_args()
    missing = [s for s in args.source if not Path(s).is_file()]
    if not args.source or missing:
        print(f"error: no extension sources to build ({missing or 'none given'})",
              file=sys.stderr)
        return 1
    from torch.utils.cpp_extension import load

    # TORCH_CUDA_ARCH_LIST (from the environment) picks the -gencode flags; these are the
    # kernels loader's own flags, so a build here matches a JIT build there.
    flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    threads = os.environ.get("NVCC_THREADS")
    if threads:
        flags.append(f"--threads={threads}")
    build = args.out / "obj"
    build.mkdir(parents=True, exist_ok=True)
    load(name="sm70_kernels", sources=args.source, extra_include_paths=args.include,
         extra_cuda_cflags=flags, extra_cflags=["-O3"], build_directory=str(build),
         is_python_module=False, verbose=True)
    os.replace(build / "sm70_kernels.so", args.out / "sm70_kernels.so")
    print(f"built {args.out / 'sm70_kernels.so'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
