"""The whole torch extension (every translation unit in csrc/torch_bindings: schemas,
bindings, launchers and every kernel) compiles for sm_70 with a real CUDA 12 nvcc, not only
the kernel headers through NVRTC (test_kernels_compile.py).

The nvcc is the CUDA 12.4 tree .ci/setup.d/40-cuda12-nvcc.sh assembles in build/ci (CUDA 13,
the machine's own, cannot emit sm_70); torch's headers come from the CPU torch of the serving
environment (.serve-venv, .ci/setup.d/20-serve-env.sh). The translation units, include
folder and our nvcc flags are the ops loader's (vllm_patch.ops), so what CI compiles is what
a GPU machine builds. Without nvcc or torch the test skips, except under CI=true, where it
fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from sm70ctl.kernels.variants import VARIANTS
from vllm_patch.ops import build, sources

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
NVCC = ROOT / "build" / "ci" / "cuda-12.4" / "bin" / "nvcc"
SERVE_PY = ROOT / ".serve-venv" / "bin" / "python"
EXTENSION_NAME = "sm70_ops_ci"
# ours on top of what torch.utils.cpp_extension passes for every source (asked of the
# serving torch below, so the flags follow its version instead of being copied here)
OUR_FLAGS = [f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}", "-std=c++17", "-Xcompiler", "-fPIC"]


def missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} (CI must provide it)")
    pytest.skip(what)


def torch_build_flags() -> list[str]:
    """The serving torch's include paths, common nvcc flags and C++ ABI define."""
    code = (
        "import json, torch, torch.utils.cpp_extension as c; print(json.dumps(["
        "*('-I' + p for p in c.include_paths()), *c.COMMON_NVCC_FLAGS, "
        "'-DTORCH_API_INCLUDE_EXTENSION_H', "
        "f'-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}']))"
    )
    out = subprocess.run(
        [str(SERVE_PY), "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout)


def compile_unit(unit: Path, obj: Path, flags: list[str], stub: Path) -> None:
    cuda = unit.suffix == ".cu"
    cmd = [
        str(NVCC),
        *(["-gencode", "arch=compute_70,code=sm_70"] if cuda else []),
        *flags,
        *OUR_FLAGS,
        *(build.EXTRA_CUDA_CFLAGS if cuda else build.EXTRA_CFLAGS),
        *(f"-I{d}" for d in sources.include_dirs(CSRC)),
        f"-I{stub}",
        "-c",
        str(unit),
        "-o",
        str(obj),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"{unit.name}:\n{proc.stderr[-4000:]}"


def test_torch_extension_compiles_for_sm70_with_nvcc12(tmp_path: Path) -> None:
    if not NVCC.is_file():
        missing(f"no CUDA 12 nvcc at {NVCC} (made by .ci/setup.d/40-cuda12-nvcc.sh)")
    if not SERVE_PY.is_file():
        missing(f"no {SERVE_PY} with torch (made by .ci/setup.d/20-serve-env.sh)")
    units = sources.translation_units(CSRC)
    assert {u.suffix for u in units} == {".cu", ".cpp"}, units
    # CPU wheels of torch leave out this generated header, which the c10/cuda headers the
    # bindings include (CUDAGuard, CUDAStream) read for one build option; an empty one
    # means the default (no CUDA-side allocator config macros).
    stub = tmp_path / "stub"
    (stub / "c10" / "cuda" / "impl").mkdir(parents=True)
    (stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
    flags = torch_build_flags()
    names: set[str] = set()
    for unit in units:
        obj = tmp_path / f"{unit.stem}{unit.suffix.replace('.', '_')}.o"
        compile_unit(unit, obj, flags, stub)
        if unit.suffix != ".cu":
            continue
        # each object's device code is sm_70 SASS only
        dump = subprocess.run(
            [str(NVCC.with_name("cuobjdump")), "-elf", str(obj)],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
        archs = set(re.findall(r"arch = (sm_\d+)", dump))
        assert archs == {"sm_70"}, (unit.name, archs)
        names |= set(re.findall(r"\.text\.(\S+)", dump))
    # every kernel the extension launches is in one of the objects
    kernels = {v.expr.split("<")[0].removeprefix("sm70::") for v in VARIANTS}
    absent = sorted(k for k in kernels if not any(k in n for n in names))
    assert not absent, f"kernels missing from the sm_70 objects: {absent}"
    print(f"compiled {len(units)} translation units for sm_70 with {NVCC}: {len(names)} kernels")
