"""The build compiles the same kernel list as the NVRTC check, with the settings' env."""

from __future__ import annotations

from pathlib import Path

from sm70ctl.build import kernels
from sm70ctl.build.plan import BuildConfig, _compile_env
from sm70ctl.build.toolchain import GIB, ToolchainProbe
from sm70ctl.kernels import loader, nvrtc, variants

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def test_kernel_list_matches_the_nvrtc_check_and_the_loader() -> None:
    names = [p.name for p in kernels.kernel_sources(CSRC)]
    assert names == sorted(p.name for p in (nvrtc.CSRC / "kernels").glob("*.cuh"))
    assert set(variants.headers()) <= set(names)
    assert kernels.binding_sources(CSRC) == loader.extension_sources()
    assert all(p.is_file() for p in kernels.binding_sources(CSRC))


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
