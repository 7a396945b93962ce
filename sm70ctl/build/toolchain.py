"""The compile toolchain: probe nvcc, the host compiler and free memory; judge them.

`probe_toolchain` touches the machine and returns plain data; `toolchain_problems` and
`max_jobs` are pure and tested on every case.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sm70ctl.build.lock import Toolchain

GIB = 1 << 30
BYTES_PER_NVCC_JOB = 6 * GIB  # vLLM's heavy translation units take 4-8 GB each


@dataclass(frozen=True)
class ToolchainProbe:
    nvcc: str  # path, or "" when none was found
    nvcc_release: str  # e.g. "12.8", or ""
    cuda_home: str
    host_cc: str
    host_cc_version: str  # e.g. "12.2.0", or ""
    mem_available: int  # bytes


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def parse_nvcc_release(text: str) -> str:
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else ""


def probe_toolchain(cuda_home: str, host_cc: str) -> ToolchainProbe:
    nvcc = ""
    if cuda_home:
        cand = Path(cuda_home) / "bin" / "nvcc"
        nvcc = str(cand) if cand.is_file() else ""
    else:
        nvcc = shutil.which("nvcc") or ""
        if nvcc:
            cuda_home = str(Path(nvcc).resolve().parent.parent)
    release = ""
    if nvcc:
        try:
            res = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                 timeout=30, check=False)
            release = parse_nvcc_release(res.stdout + res.stderr)
        except (OSError, subprocess.TimeoutExpired):
            release = ""
    cc = host_cc or "gcc"
    cc_version = ""
    cc_path = shutil.which(cc) or (cc if Path(cc).is_file() else "")
    if cc_path:
        try:
            res = subprocess.run([cc_path, "-dumpfullversion", "-dumpversion"],
                                 capture_output=True, text=True, timeout=30, check=False)
            cc_version = res.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            cc_version = ""
    return ToolchainProbe(nvcc, release, cuda_home, cc_path or cc, cc_version, _mem_available())


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def toolchain_problems(p: ToolchainProbe, want: Toolchain, arch_list: str) -> list[str]:
    """Why this toolchain cannot build the pinned sources for `arch_list` (empty: fine)."""
    problems: list[str] = []
    wants_volta = any(a.strip().startswith("7.0") for a in arch_list.split(";") if a.strip())
    if not p.nvcc:
        where = f"in SM70_CUDA_HOME={p.cuda_home}" if p.cuda_home else "on PATH"
        problems.append(f"no nvcc found {where}; the lock wants CUDA {want.cuda}")
    elif not p.nvcc_release:
        problems.append(f"{p.nvcc} --version did not report a CUDA release")
    else:
        have = _version_tuple(p.nvcc_release)
        if wants_volta and have >= (13,):
            problems.append(
                f"nvcc {p.nvcc_release} cannot emit sm_70 (CUDA 13 dropped Volta); "
                f"the lock wants CUDA {want.cuda}"
            )
        elif have[:2] != _version_tuple(want.cuda)[:2]:
            problems.append(f"nvcc {p.nvcc_release} is not the pinned CUDA {want.cuda}")
    if not p.host_cc_version:
        problems.append(f"host compiler {p.host_cc!r} not found (SM70_HOST_CC)")
    else:
        v = _version_tuple(p.host_cc_version)
        if v < _version_tuple(want.gcc_min):
            problems.append(f"host gcc {p.host_cc_version} is older than {want.gcc_min}")
        elif v and v[0] > want.gcc_max_major:
            problems.append(
                f"host gcc {p.host_cc_version} is newer than CUDA {want.cuda}'s nvcc accepts "
                f"(major <= {want.gcc_max_major})"
            )
    return problems


def max_jobs(setting: int, mem_available: int, cpus: int) -> int:
    """MAX_JOBS: the setting when > 0, else what free memory allows, capped by CPUs."""
    if setting > 0:
        return setting
    by_mem = mem_available // BYTES_PER_NVCC_JOB
    return max(1, min(cpus, by_mem))
