"""Toolchain verdicts (pure) and MAX_JOBS arithmetic."""

from __future__ import annotations

import pytest

from sm70ctl.build.lock import Toolchain
from sm70ctl.build.toolchain import (
    GIB,
    ToolchainProbe,
    max_jobs,
    parse_nvcc_release,
    toolchain_problems,
)

WANT = Toolchain(cuda="12.8", gcc_min="11.4", gcc_max_major=14, python="3.12",
                 cuda_arch_list="7.0")


def probe(nvcc: str = "/cuda/bin/nvcc", release: str = "12.8", cc: str = "12.2.0"):
    return ToolchainProbe(nvcc, release, "/cuda", "gcc", cc, 16 * GIB)


def test_parse_nvcc_release() -> None:
    text = "Cuda compilation tools, release 13.0, V13.0.88\nBuild cuda_13.0.r13.0/compiler"
    assert parse_nvcc_release(text) == "13.0"
    assert parse_nvcc_release("garbage") == ""


@pytest.mark.parametrize(
    ("p", "arch", "expect"),
    [
        (probe(), "7.0", []),
        (probe(release="12.9"), "7.0", ["nvcc 12.9 is not the pinned CUDA 12.8"]),
        (probe(release="13.0"), "7.0",
         ["nvcc 13.0 cannot emit sm_70 (CUDA 13 dropped Volta); the lock wants CUDA 12.8"]),
        (probe(release="13.0"), "8.0", ["nvcc 13.0 is not the pinned CUDA 12.8"]),
        (probe(nvcc="", release=""), "7.0",
         ["no nvcc found in SM70_CUDA_HOME=/cuda; the lock wants CUDA 12.8"]),
        (probe(release=""), "7.0", ["/cuda/bin/nvcc --version did not report a CUDA release"]),
        (probe(cc="11.3.0"), "7.0", ["host gcc 11.3.0 is older than 11.4"]),
        (probe(cc="11.4.0"), "7.0", []),
        (probe(cc="14.2.0"), "7.0", []),
        (probe(cc="15.1.0"), "7.0",
         ["host gcc 15.1.0 is newer than CUDA 12.8's nvcc accepts (major <= 14)"]),
        (probe(cc=""), "7.0", ["host compiler 'gcc' not found (SM70_HOST_CC)"]),
    ],
)
def test_toolchain_problems(p: ToolchainProbe, arch: str, expect: list[str]) -> None:
    assert toolchain_problems(p, WANT, arch) == expect


@pytest.mark.parametrize(
    ("setting", "mem", "cpus", "expect"),
    [(3, 1 * GIB, 64, 3), (0, 24 * GIB, 64, 4), (0, 24 * GIB, 2, 2), (0, 1 * GIB, 8, 1),
     (0, 0, 8, 1), (0, 128 * GIB, 16, 16)],
)
def test_max_jobs(setting: int, mem: int, cpus: int, expect: int) -> None:
    assert max_jobs(setting, mem, cpus) == expect
