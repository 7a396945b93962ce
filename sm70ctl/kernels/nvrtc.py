"""Compile csrc/ kernels for sm_70 with NVRTC 12.8 from PyPI, and read their resource use.

No GPU and no CUDA 12 nvcc needed: libnvrtc.so.12 (nvidia-cuda-nvrtc-cu12) is loaded by
path through ctypes; NVRTC gives PTX and an sm_70 CUBIN; ptxas from nvidia-cuda-nvcc-cu12
(`-v`) reports registers, shared memory, stack frame and spills per kernel. The edges
(loading the library, running ptxas) are small functions; the checks against Volta's limits
are pure functions over plain data.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import struct
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Volta (sm_70) limits the kernels must respect
VOLTA_MAX_SMEM_PER_BLOCK = 96 * 1024  # opt-in maximum (static + dynamic)
VOLTA_MAX_STATIC_SMEM = 48 * 1024  # static __shared__ cannot exceed this
VOLTA_MAX_REGS_PER_THREAD = 255
VOLTA_REGS_PER_SM = 65536
# PTX that sm_70 cannot run: bf16, ldmatrix (sm_75), cp.async (sm_80), wgmma (sm_90a)
FORBIDDEN_PTX = ("bf16", "ldmatrix", "cp.async", "wgmma", "setmaxnreg", "mma.sync.aligned.m16")

CSRC = Path(__file__).resolve().parents[2] / "csrc"


class NvrtcUnavailable(RuntimeError):
    """The cuda12 extra (NVRTC 12.8, ptxas, headers) is not installed."""


class CompileFailed(RuntimeError):
    """NVRTC or ptxas rejected a kernel source; the message carries the compiler log."""


@dataclass(frozen=True)
class Toolchain:
    nvrtc_lib: Path
    ptxas: Path
    include_dirs: tuple[Path, ...]


@dataclass(frozen=True)
class Resources:
    registers: int
    static_smem: int
    stack_frame: int
    spill_stores: int
    spill_loads: int


@dataclass(frozen=True)
class Compiled:
    ptx: str
    cubin: bytes
    lowered: dict[str, str]  # name expression -> mangled kernel name
    resources: dict[str, Resources]  # mangled name -> resources


def _nvidia_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def find_toolchain() -> Toolchain:
    """Locate NVRTC, ptxas and the CUDA headers installed by the `cuda12` extra."""
    for base in _nvidia_dirs():
        lib = base / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"
        ptxas = base / "cuda_nvcc" / "bin" / "ptxas"
        rt_inc = base / "cuda_runtime" / "include"
        if lib.is_file() and ptxas.is_file() and rt_inc.is_dir():
            incs = [rt_inc, base / "cuda_cccl" / "include", base / "cuda_nvcc" / "include"]
            return Toolchain(lib, ptxas, tuple(p for p in incs if p.is_dir()))
    raise NvrtcUnavailable(
        "NVRTC 12.8 not found: install the cuda12 extra (pip install -e '.[cuda12]')"
    )


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CompileFailed(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")


def _get_bytes(lib: ctypes.CDLL, prog: ctypes.c_void_p, size_fn: str, get_fn: str) -> bytes:
    size = ctypes.c_size_t()
    _check(lib, getattr(lib, size_fn)(prog, ctypes.byref(size)), size_fn)
    buf = ctypes.create_string_buffer(size.value)
    _check(lib, getattr(lib, get_fn)(prog, buf), get_fn)
    return buf.raw[: size.value]


def nvrtc_compile(
    source: str,
    name: str,
    name_expressions: list[str],
    tc: Toolchain,
    arch: str = "sm_70",
    include_dirs: Sequence[Path] = (),
) -> tuple[str, bytes, dict[str, str]]:
    """Compile one translation unit; returns (ptx, cubin, lowered names).

    Headers are included relative to csrc/ ("gemv/gptq_gemv.cuh"); include_dirs adds more.
    """
    lib = ctypes.CDLL(str(tc.nvrtc_lib))
    prog = ctypes.c_void_p()
    _check(
        lib,
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
        "nvrtcCreateProgram",
    )
    try:
        for expr in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, expr.encode()), f"add {expr}")
        opts = [f"-arch={arch}", "-std=c++17", "-default-device", f"-I{CSRC}"]
        opts += [f"-I{d}" for d in include_dirs]
        opts += [f"-I{d}" for d in tc.include_dirs]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        log = _get_bytes(lib, prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog")
        if rc != 0:
            raise CompileFailed(f"{name}: NVRTC failed:\n{log.decode(errors='replace')}")
        ptx = _get_bytes(lib, prog, "nvrtcGetPTXSize", "nvrtcGetPTX").rstrip(b"\0").decode()
        cubin = _get_bytes(lib, prog, "nvrtcGetCUBINSize", "nvrtcGetCUBIN")
        lowered = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            _check(
                lib,
                lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)),
                f"lowered name of {expr}",
            )
            lowered[expr] = out.value.decode()
        return ptx, cubin, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_FRAME = re.compile(
    r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads"
)
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_verbose(text: str) -> dict[str, Resources]:
    """Parse `ptxas -v` output into per-kernel resources (pure)."""
    frames = {m.group(1): tuple(int(x) for x in m.group(2, 3, 4)) for m in _FRAME.finditer(text)}
    out: dict[str, Resources] = {}
    current = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = m.group(1)
            continue
        u = _USED.search(line)
        if u and current is not None:
            stack, sst, sld = frames.get(current, (0, 0, 0))
            sm = _SMEM.search(line)
            out[current] = Resources(
                int(u.group(1)), int(sm.group(1)) if sm else 0, stack, sst, sld
            )
            current = None
    return out


def ptxas_resources(ptx: str, tc: Toolchain, arch: str = "sm_70") -> dict[str, Resources]:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [str(tc.ptxas), f"-arch={arch}", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    if proc.returncode != 0:
        raise CompileFailed(f"ptxas failed:\n{proc.stderr}")
    return parse_ptxas_verbose(proc.stdout + proc.stderr)


def elf_sm(cubin: bytes) -> int:
    """The SM version a CUDA ELF (cubin) targets, from its header's e_flags (pure)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF")
    (e_machine,) = struct.unpack_from("<H", cubin, 18)
    if e_machine != 190:  # EM_CUDA
        raise ValueError(f"ELF machine {e_machine} is not EM_CUDA (190)")
    (e_flags,) = struct.unpack_from("<I", cubin, 48)
    # CUDA ELF ABI v1 keeps the SM in the low byte; the newer ABI in bits 8..15
    low, mid = e_flags & 0xFF, (e_flags >> 8) & 0xFF
    return low if low >= 20 else mid


def forbidden_instructions(ptx: str) -> list[str]:
    """Instructions in the PTX body that Volta cannot run (pure)."""
    body = "\n".join(
        line for line in ptx.splitlines() if not line.lstrip().startswith(("//", ".version"))
    )
    return [tok for tok in FORBIDDEN_PTX if tok in body]


def limit_violations(res: Resources, threads: int, dynamic_smem: int) -> list[str]:
    """Volta limits a kernel variant breaks, as readable strings (pure)."""
    problems = []
    if res.registers > VOLTA_MAX_REGS_PER_THREAD:
        problems.append(f"{res.registers} registers > {VOLTA_MAX_REGS_PER_THREAD}")
    if res.registers * threads > VOLTA_REGS_PER_SM:
        problems.append(f"{res.registers} registers x {threads} threads > {VOLTA_REGS_PER_SM}")
    if res.static_smem > VOLTA_MAX_STATIC_SMEM:
        problems.append(f"static smem {res.static_smem} > {VOLTA_MAX_STATIC_SMEM}")
    if res.static_smem + dynamic_smem > VOLTA_MAX_SMEM_PER_BLOCK:
        problems.append(
            f"smem {res.static_smem} + {dynamic_smem} dynamic > {VOLTA_MAX_SMEM_PER_BLOCK}"
        )
    if res.spill_stores or res.spill_loads:
        problems.append(f"spills: {res.spill_stores} B stored, {res.spill_loads} B loaded")
    return problems
