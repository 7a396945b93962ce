"""Compile csrc/ into the ops library the loader finds as prebuilt; run by the serving Python.

    SERVE_PYTHON compile_kernels.py --out DIR --csrc CSRC

Runs inside the serving environment (it needs that environment's torch, whose ABI the
library must match); `sm70ctl build` sets TORCH_CUDA_ARCH_LIST, CUDA_HOME, CC, MAX_JOBS and
NVCC_THREADS. The build itself is `vllm_patch.ops.build.build_library`, the function the
loader's own JIT build calls, so the flags, translation units and the library's name
(sm70_ops_<key>.so, keyed by OS, torch, CUDA, Python and source hash) come from one place;
`sm70ctl build` installs DIR/*.so into vllm_patch/_lib/. Standalone on purpose: the serving
environment need not have sm70ctl's dependencies, and the vllm_patch package beside this
file is imported from its folder, not from whatever the serving environment has installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_patch"


def _import_ops_build(package_dir: Path) -> ModuleType:
    """vllm_patch.ops.build from package_dir (the copy that ships with this sm70ctl)."""
    spec = importlib.util.spec_from_file_location(
        "vllm_patch", package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"no vllm_patch package at {package_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_patch"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("vllm_patch.ops.build")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--csrc", type=Path, required=True)
    args = ap.parse_args(argv)
    csrc = args.csrc
    if not (csrc / "torch_bindings").is_dir():
        print(f"error: no kernel sources to build (--csrc {csrc} has no torch_bindings/ "
              "folder)", file=sys.stderr)
        return 1
    ops_build = _import_ops_build(PACKAGE)
    threads = os.environ.get("NVCC_THREADS")
    args.out.mkdir(parents=True, exist_ok=True)
    lib = ops_build.build_library(args.out, csrc, verbose=True,
                                  nvcc_threads=int(threads) if threads else None)
    print(f"built {lib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
