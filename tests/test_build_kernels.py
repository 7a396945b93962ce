"""The build compiles what the ops loader would (one list, one set of flags), with the
settings' env."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sm70ctl.build import compile_kernels, kernels
from sm70ctl.build.plan import BuildConfig, _compile_env
from sm70ctl.build.toolchain import GIB, ToolchainProbe
from sm70ctl.kernels import variants
from vllm_patch.ops import build, sources

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"


def test_kernel_list_is_the_loaders_and_covers_the_nvrtc_headers() -> None:
    rel = {p.relative_to(CSRC).as_posix() for p in kernels.kernel_sources(CSRC)}
    assert rel == {p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*.cuh")}
    # every header the NVRTC check compiles is one of the build's inputs
    assert set(variants.headers()) <= rel, rel
    assert kernels.binding_sources(CSRC) == sources.translation_units(CSRC)
    assert kernels.include_dirs(CSRC) == sources.include_dirs(CSRC)
    assert all(p.is_file() for p in kernels.binding_sources(CSRC))


def test_compile_script_refuses_a_folder_without_bindings(tmp_path: Path, capsys) -> None:
    assert compile_kernels.main(["--out", str(tmp_path / "o"), "--csrc", str(tmp_path)]) == 1
    assert "no kernel sources to build" in capsys.readouterr().err


def test_compile_script_builds_with_the_ops_build_shipped_beside_it(tmp_path: Path) -> None:
    """In the serving Python it imports vllm_patch.ops.build from the package next to it (not
    an installed one), so its flags and library names are the loader's."""
    code = (
        "import json, runpy, sys; ck = runpy.run_path(sys.argv[1]); "
        "m = ck['_import_ops_build'](ck['PACKAGE']); "
        "print(json.dumps([m.__file__, list(m.EXTRA_CUDA_CFLAGS), m.library_name('k'), "
        "sorted(n for n in sys.modules if n.startswith('sm70ctl') or n == 'torch')]))"
    )
    script = Path(compile_kernels.__file__)
    out = subprocess.run([sys.executable, "-I", "-c", code, str(script)], capture_output=True,
                         text=True, timeout=60, check=True, cwd=tmp_path).stdout
    path, flags, name, imported = json.loads(out)
    assert imported == []  # standalone: no sm70ctl (nor torch) needed to get this far
    assert Path(path) == ROOT / "vllm_patch" / "ops" / "build.py"
    assert flags == list(build.EXTRA_CUDA_CFLAGS) and name == build.library_name("k")


def _cfg(**kw) -> BuildConfig:
    base = dict(build_dir=Path("/b"), serve_python=Path("/s/python"), project_root=Path("/p"),
                series=())
    base.update(kw)
    return BuildConfig(**base)


def test_compile_env_carries_the_build_settings() -> None:
    probe = ToolchainProbe("/cuda/bin/nvcc", "12.8", "/cuda", "gcc-13", "13.2.0", 24 * GIB)
    env = _compile_env(_cfg(cuda_arch_list="7.0", max_jobs=3, nvcc_threads=4,
                            host_cc="/usr/bin/gcc-13"), probe)
    assert env["TORCH_CUDA_ARCH_LIST"] == "7.0"
    assert (env["MAX_JOBS"], env["NVCC_THREADS"]) == ("3", "4")
    assert env["CUDA_HOME"] == "/cuda" and env["PATH"].startswith("/cuda/bin:")
    assert (env["CC"], env["CXX"]) == ("/usr/bin/gcc-13", "/usr/bin/g++-13")
    auto = _compile_env(_cfg(max_jobs=0), probe)
    assert 1 <= int(auto["MAX_JOBS"]) <= 4  # 24 GiB free at 6 GiB a job, capped by CPUs
    assert "CC" not in auto
