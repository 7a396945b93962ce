"""Probes: every side effect of the doctor (NVML, subprocesses, the file system).

Each probe returns a plain dataclass that round-trips through JSON (records.py), so a
user can record what the doctor saw (`sm70ctl doctor --record FILE`) and we can replay the
verdicts on it (`--probe-data FILE`). Probes never judge: they record what they saw, and
an error text where a query failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.doctor.config import MIB, DoctorConfig

SCHEMA_VERSION = 1
OUTPUT_LIMIT = 4000  # characters of a subprocess's stdout/stderr kept in a record

NVCC_VERSION_TIMEOUT = 10.0
SM70_PROBE_TIMEOUT = 15.0  # a tiny kernel compiles in about 0.5 s with a healthy nvcc
HOST_CC_TIMEOUT = 10.0
PYTHON_TIMEOUT = 60.0  # a cold `import torch` can take tens of seconds on slow disks

# All probes by name; `--check` runs only the probes its checks need.
PROBE_NAMES = ("nvml", "nvcc", "host_cc", "python", "disks", "shm", "limits")


# --- records ------------------------------------------------------------------------------
@dataclass
class CommandRun:
    """One subprocess run. returncode None: it could not start or did not finish."""

    argv: list[str] = field(default_factory=list)
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    timed_out: bool = False
    error: str | None = None


@dataclass
class NvccCandidate:
    source: str = ""  # SM70_CUDA_HOME, CUDA_HOME or PATH
    path: str | None = None  # the nvcc this source points at (None: PATH has none)
    exists: bool = False


@dataclass
class NvccProbe:
    candidates: list[NvccCandidate] = field(default_factory=list)
    chosen: NvccCandidate | None = None
    version_run: CommandRun | None = None
    version: str | None = None  # "12.8"
    compile_run: CommandRun | None = None  # the sm_70 probe compile
    compile_output_arch: int | None = None  # the SM number in the probe cubin's ELF header


@dataclass
class CompilerInfo:
    name: str = ""  # as given (gcc, gcc-14, /usr/bin/gcc-14)
    path: str | None = None
    kind: str | None = None  # gcc / clang / None when unknown
    version: str | None = None  # "12.2.0"
    run: CommandRun | None = None


@dataclass
class HostCcProbe:
    configured: CompilerInfo | None = None  # SM70_HOST_CC when set
    default: CompilerInfo | None = None  # `gcc` on PATH
    versioned: list[CompilerInfo] = field(default_factory=list)  # gcc-N on PATH


@dataclass
class PythonProbe:
    configured: str = ""
    path: str | None = None
    exists: bool = False
    missing: str | None = None  # why it cannot run: no such file, a directory, not executable
    run: CommandRun | None = None
    python_version: str | None = None
    torch_installed: bool | None = None
    torch_version: str | None = None
    torch_cuda: str | None = None  # torch.version.cuda
    torch_arch_list: list[str] | None = None
    torch_error: str | None = None


@dataclass
class ProcessInfo:
    pid: int = 0
    name: str | None = None
    used_mib: int | None = None


@dataclass
class GpuProbe:
    index: int = 0
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    cc_major: int | None = None
    cc_minor: int | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_reserved_mib: int | None = None
    processes: list[ProcessInfo] = field(default_factory=list)
    persistence_mode: bool | None = None
    ecc_enabled: bool | None = None
    ecc_pending: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    clocks_event_reasons: int | None = None  # NVML bitmask
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    mig_enabled: bool | None = None
    errors: dict[str, str] = field(default_factory=dict)  # query -> NVML error text


@dataclass
class PairProbe:
    a: int = 0
    b: int = 1
    nvlink_active: int | None = None  # active links from a whose far end is b
    p2p_read: str | None = None  # "ok" or the NVML refusal reason
    p2p_nvlink: str | None = None
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class NvmlProbe:
    available: bool = False
    error: str | None = None
    error_kind: str | None = None  # library_not_found, driver_not_loaded, no_permission, ...
    driver_version: str | None = None
    cuda_driver_version: int | None = None  # e.g. 12080 for 12.8
    gpus: list[GpuProbe] = field(default_factory=list)
    pairs: list[PairProbe] = field(default_factory=list)


@dataclass
class DiskProbe:
    role: str = ""  # weights / build
    configured: str = ""
    probed: str | None = None  # the path measured: the configured one or its nearest parent
    free_bytes: int | None = None
    total_bytes: int | None = None
    error: str | None = None


@dataclass
class ShmProbe:
    path: str = "/dev/shm"
    exists: bool = False
    total_bytes: int | None = None
    free_bytes: int | None = None
    error: str | None = None


@dataclass
class LimitsProbe:
    nofile_soft: int | None = None  # -1: unlimited
    nofile_hard: int | None = None
    error: str | None = None


@dataclass
class SettingsProbe:
    """How the doctor's settings were read: through sm70ctl.settings ("settings") or, when
    that module cannot load or rejects the values, straight from the variables ("fallback")."""

    source: str = "settings"
    problems: list[str] = field(default_factory=list)  # one line per broken rule
    error: str | None = None  # why sm70ctl.settings could not be used


@dataclass
class ProbeData:
    schema_version: int = SCHEMA_VERSION
    sm70ctl_version: str = ""
    created: str = ""
    platform: str = ""
    config: DoctorConfig = field(default_factory=DoctorConfig)
    probed: list[str] = field(default_factory=list)  # which probes ran
    seconds: dict[str, float] = field(default_factory=dict)
    settings: SettingsProbe | None = None
    nvml: NvmlProbe | None = None
    nvcc: NvccProbe | None = None
    host_cc: HostCcProbe | None = None
    python: PythonProbe | None = None
    disks: list[DiskProbe] | None = None
    shm: ShmProbe | None = None
    limits: LimitsProbe | None = None


# --- subprocesses -------------------------------------------------------------------------
def _trim(text: str) -> str:
    return text if len(text) <= OUTPUT_LIMIT else text[: OUTPUT_LIMIT - 20] + "\n...[truncated]"


def run_command(
    argv: list[str], timeout: float, cwd: str | None = None, env: Mapping[str, str] | None = None
) -> CommandRun:
    start = time.monotonic()
    rec = CommandRun(argv=list(argv))
    try:
        # Own session, so a timeout kills the whole tree: nvcc's children (cicc, ptxas)
        # would otherwise keep the pipes open and the wait would outlast the timeout.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            cwd=cwd,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
    except OSError as exc:
        rec.error = f"{type(exc).__name__}: {exc.strerror or exc}"
        rec.seconds = round(time.monotonic() - start, 3)
        return rec
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate()
        rec.timed_out = True
        rec.error = f"timed out after {timeout:g} s"
    else:
        rec.returncode = proc.returncode
    rec.stdout, rec.stderr = _trim(out or ""), _trim(err or "")
    rec.seconds = round(time.monotonic() - start, 3)
    return rec


def _kill_tree(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()


# --- CUDA toolkit -------------------------------------------------------------------------
def nvcc_candidates(config: DoctorConfig, environ: Mapping[str, str]) -> list[NvccCandidate]:
    """Where nvcc may come from, in order of precedence (only sources that are set)."""
    out = []
    for source, home in (
        ("SM70_CUDA_HOME", config.cuda_home),
        ("CUDA_HOME", environ.get("CUDA_HOME")),
    ):
        if home:
            path = str(Path(os.path.expanduser(home)) / "bin" / "nvcc")
            out.append(NvccCandidate(source, path, os.access(path, os.X_OK)))
    found = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
    out.append(NvccCandidate("PATH", found, found is not None))
    return out


def choose_nvcc(candidates: list[NvccCandidate]) -> NvccCandidate | None:
    """An explicit setting wins even when it is wrong (the check then says so); PATH is
    the fallback only when neither home is set."""
    for cand in candidates:
        if cand.source != "PATH":
            return cand
    return candidates[-1] if candidates and candidates[-1].exists else None


def parse_nvcc_version(text: str) -> str | None:
    m = re.search(r"release (\d+)\.(\d+)", text)
    return f"{m.group(1)}.{m.group(2)}" if m else None


PROBE_KERNEL = """\
// sm70ctl doctor: can this toolkit emit Volta code?
__global__ void sm70ctl_probe(float *x) { x[threadIdx.x] *= 2.0f; }
"""


def probe_nvcc(
    config: DoctorConfig, environ: Mapping[str, str], compile_probe: bool = True
) -> NvccProbe:
    probe = NvccProbe(candidates=nvcc_candidates(config, environ))
    probe.chosen = choose_nvcc(probe.candidates)
    if probe.chosen is None or not probe.chosen.exists or not probe.chosen.path:
        return probe
    nvcc = probe.chosen.path
    probe.version_run = run_command([nvcc, "--version"], NVCC_VERSION_TIMEOUT)
    probe.version = parse_nvcc_version(probe.version_run.stdout)
    if compile_probe:
        probe.compile_run, probe.compile_output_arch = _compile_sm70(nvcc, config.host_cc)
    return probe


def _compile_sm70(nvcc: str, host_cc: str | None) -> tuple[CommandRun, int | None]:
    # A cubin only: nvcc still runs the host compiler's preprocessor (so a host gcc it
    # rejects fails here too) but skips the slow host compile and link.
    with tempfile.TemporaryDirectory(prefix="sm70ctl-doctor-") as tmp:
        src = Path(tmp) / "probe.cu"
        out = Path(tmp) / "probe.cubin"
        src.write_text(PROBE_KERNEL, encoding="utf-8")
        argv = [nvcc, "-arch=sm_70", "-cubin", "-o", str(out), str(src)]
        if host_cc:
            argv[1:1] = ["-ccbin", host_cc]
        run = run_command(argv, SM70_PROBE_TIMEOUT, cwd=tmp)
        arch = cubin_arch(out) if run.returncode == 0 else None
        # Temp paths differ on every run; keep the record stable and readable.
        run.argv = [a.replace(tmp, "$TMP") for a in run.argv]
        run.stderr = run.stderr.replace(tmp, "$TMP")
    return run, arch


def cubin_arch(path: Path) -> int | None:
    """The SM number a cubin was built for, from its ELF64 header's e_flags."""
    try:
        data = path.read_bytes()[:64]
    except OSError:
        return None
    if data[:4] != b"\x7fELF" or len(data) < 52:
        return None
    e_flags = int.from_bytes(data[48:52], "little")
    # CUDA ELF ABI version (e_ident[8]) 8 and later keep the SM in bits 8-15; older
    # ones (what CUDA 12 emits for sm_70) in bits 0-7.
    return (e_flags >> 8) & 0xFF if data[8] >= 8 else e_flags & 0xFF


# --- host compiler ------------------------------------------------------------------------
def parse_cc_version(text: str) -> tuple[str | None, str | None]:
    """(kind, version) from the first line of `cc --version`."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    if "clang" in first.lower():
        m = re.search(r"version (\d+\.\d+(?:\.\d+)?)", first)
        return "clang", m.group(1) if m else None
    versions = re.findall(r"\b(\d+\.\d+(?:\.\d+)?)\b", first)
    if versions and ("gcc" in first.lower() or "(GCC)" in first or "g++" in first.lower()):
        return "gcc", versions[-1]
    return (None, versions[-1]) if versions else (None, None)


def compiler_info(name: str, environ: Mapping[str, str]) -> CompilerInfo:
    path = name if os.sep in name else shutil.which(name, path=environ.get("PATH", os.defpath))
    info = CompilerInfo(name=name, path=path)
    if path is None or not os.access(path, os.X_OK):
        return info
    info.run = run_command([path, "--version"], HOST_CC_TIMEOUT)
    if info.run.returncode == 0:
        info.kind, info.version = parse_cc_version(info.run.stdout)
    return info


def versioned_gcc_names(environ: Mapping[str, str]) -> list[str]:
    """gcc-N executables on PATH, one per distinct binary, newest first."""
    seen: dict[str, str] = {}
    for folder in environ.get("PATH", os.defpath).split(os.pathsep):
        try:
            entries = os.listdir(folder or ".")
        except OSError:
            continue
        for entry in sorted(entries):  # sorted: the same name wins on every run
            if re.fullmatch(r"gcc-\d+", entry):
                full = os.path.join(folder, entry)
                if os.access(full, os.X_OK):
                    seen.setdefault(os.path.realpath(full), entry)
    return sorted(set(seen.values()), key=lambda n: -int(n.split("-")[1]))


def probe_host_cc(config: DoctorConfig, environ: Mapping[str, str]) -> HostCcProbe:
    names = versioned_gcc_names(environ)
    with ThreadPoolExecutor(max_workers=4) as pool:
        configured = pool.submit(compiler_info, config.host_cc, environ) if config.host_cc else None
        default = pool.submit(compiler_info, "gcc", environ)
        versioned = [pool.submit(compiler_info, n, environ) for n in names]
        return HostCcProbe(
            configured=configured.result() if configured else None,
            default=default.result(),
            versioned=[f.result() for f in versioned],
        )


# --- the serving interpreter and its torch --------------------------------------------------
# Runs inside the serving interpreter. torch is imported there, never in our process.
# `_cuda_getArchFlags` lists the compiled archs without a GPU (get_arch_list() is empty
# when CUDA is not available).
PYTHON_PROBE_SCRIPT = r"""
import json, sys
out = {"python_version": "%d.%d.%d" % sys.version_info[:3]}
try:
    import importlib.util
    out["torch_installed"] = importlib.util.find_spec("torch") is not None
    if out["torch_installed"]:
        import torch
        out["torch_version"] = str(torch.__version__)
        out["torch_cuda"] = getattr(torch.version, "cuda", None)
        flags = getattr(torch._C, "_cuda_getArchFlags", None)
        flags = flags() if flags is not None else None
        out["torch_arch_list"] = flags.split() if flags else list(torch.cuda.get_arch_list())
except Exception as exc:
    out["torch_error"] = "%s: %s" % (type(exc).__name__, exc)
print("SM70CTL-PROBE " + json.dumps(out))
"""


def _not_runnable(path: str | None) -> str | None:
    """Why `path` cannot be run as a program, or None when it can."""
    if path is None:
        return "not found on PATH"
    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        return "a directory, not an interpreter"
    if not os.path.isfile(path):
        return "not a regular file"
    if not os.access(path, os.X_OK):
        return "not executable"
    return None


def probe_python(config: DoctorConfig, environ: Mapping[str, str]) -> PythonProbe:
    configured = config.serve_python
    probe = PythonProbe(configured=configured)
    expanded = os.path.expanduser(configured)
    path = (
        expanded
        if os.sep in expanded
        else shutil.which(expanded, path=environ.get("PATH", os.defpath))
    )
    probe.path = path
    probe.missing = _not_runnable(path)
    probe.exists = probe.missing is None
    if not probe.exists or path is None:
        return probe
    probe.run = run_command([path, "-c", PYTHON_PROBE_SCRIPT], PYTHON_TIMEOUT, env=environ)
    probe.run.argv[-1] = "<probe script>"  # the record needs what ran, not the script text
    for line in probe.run.stdout.splitlines():
        if line.startswith("SM70CTL-PROBE "):
            try:
                data = json.loads(line[len("SM70CTL-PROBE ") :])
            except ValueError:
                break
            probe.python_version = data.get("python_version")
            probe.torch_installed = data.get("torch_installed")
            probe.torch_version = data.get("torch_version")
            probe.torch_cuda = data.get("torch_cuda")
            probe.torch_arch_list = data.get("torch_arch_list")
            probe.torch_error = data.get("torch_error")
    return probe


# --- NVML -----------------------------------------------------------------------------------
def _nvml_error_kind(pynvml: Any, exc: Exception) -> str:
    for kind, name in (
        ("library_not_found", "NVMLError_LibraryNotFound"),
        ("driver_not_loaded", "NVMLError_DriverNotLoaded"),
        ("no_permission", "NVMLError_NoPermission"),
        ("not_supported", "NVMLError_NotSupported"),
    ):
        cls = getattr(pynvml, name, None)
        if cls is not None and isinstance(exc, cls):
            return kind
    return "other"


def _text_of(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def normalize_bus_id(bus_id: str | None) -> str | None:
    """ "00000000:3B:00.0" and "0000:3b:00.0" name the same device."""
    if not bus_id:
        return None
    m = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)", bus_id)
    if not m:
        return bus_id.lower()
    dom, bus, dev, fn = m.groups()
    return f"{int(dom or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16)}"


def resolve_gpus(entries: tuple[str, ...] | list[str], gpus: list[GpuProbe]) -> list[int | None]:
    """SM70_GPUS entries (indices or GPU-UUIDs, or UUID prefixes) -> NVML indices.

    NVML numbers GPUs in PCI bus order, which is what serving sets with
    CUDA_DEVICE_ORDER=PCI_BUS_ID, so an index means the same card on both sides."""
    out: list[int | None] = []
    for entry in entries:
        entry = entry.strip()
        found = None
        if entry.isdigit():
            found = next((g.index for g in gpus if g.index == int(entry)), None)
        elif entry.upper().startswith("GPU-"):
            matches = [g.index for g in gpus if g.uuid and g.uuid.lower().startswith(entry.lower())]
            found = matches[0] if len(matches) == 1 else None
        out.append(found)
    return out


def probe_nvml(config: DoctorConfig) -> NvmlProbe:
    probe = NvmlProbe()
    try:
        import pynvml  # nvidia-ml-py; imported here so the CLI starts fast
    except ImportError as exc:
        probe.error = f"nvidia-ml-py is not installed ({exc})"
        probe.error_kind = "binding_missing"
        return probe
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        probe.error = str(exc)
        probe.error_kind = _nvml_error_kind(pynvml, exc)
        return probe
    try:
        probe.available = True
        errors: dict[str, str] = {}
        probe.driver_version = _q(
            errors, "driver", lambda: _text_of(pynvml.nvmlSystemGetDriverVersion())
        )
        probe.cuda_driver_version = _q(errors, "cuda_driver", pynvml.nvmlSystemGetCudaDriverVersion)
        if errors:
            probe.error = "; ".join(f"{k}: {v}" for k, v in errors.items())
        count = _q(errors, "count", pynvml.nvmlDeviceGetCount) or 0
        handles = {}
        for i in range(count):
            gpu, handle = _probe_gpu(pynvml, i)
            probe.gpus.append(gpu)
            if handle is not None:
                handles[i] = handle
        wanted = [i for i in resolve_gpus(config.gpus, probe.gpus) if i is not None]
        for n, a in enumerate(wanted):
            for b in wanted[n + 1 :]:
                if a in handles and b in handles and a != b:
                    probe.pairs.append(_probe_pair(pynvml, a, b, handles, probe.gpus))
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    return probe


def _q(errors: dict[str, str], key: str, fn: Callable[..., Any], *args: Any) -> Any:
    """One NVML query; a refusal (not supported, no permission) is recorded, not raised."""
    try:
        return fn(*args)
    except Exception as exc:  # NVMLError, or AttributeError from an older binding
        errors[key] = str(exc) or type(exc).__name__
        return None


def _probe_gpu(pynvml: Any, index: int) -> tuple[GpuProbe, Any]:
    gpu = GpuProbe(index=index)
    e = gpu.errors
    handle = _q(e, "handle", pynvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return gpu, None
    gpu.name = _q(e, "name", lambda: _text_of(pynvml.nvmlDeviceGetName(handle)))
    gpu.uuid = _q(e, "uuid", lambda: _text_of(pynvml.nvmlDeviceGetUUID(handle)))
    gpu.pci_bus_id = _q(e, "pci", lambda: _text_of(pynvml.nvmlDeviceGetPciInfo(handle).busId))
    cc = _q(e, "compute_capability", pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    if cc:
        gpu.cc_major, gpu.cc_minor = int(cc[0]), int(cc[1])
    mem = _memory_info(pynvml, handle, e)
    if mem is not None:
        gpu.memory_total_mib = int(mem.total) // MIB
        gpu.memory_used_mib = int(mem.used) // MIB
        reserved = getattr(mem, "reserved", None)
        gpu.memory_reserved_mib = int(reserved) // MIB if reserved is not None else None
    gpu.processes = _processes(pynvml, handle, e)
    pm = _q(e, "persistence", pynvml.nvmlDeviceGetPersistenceMode, handle)
    gpu.persistence_mode = None if pm is None else bool(pm)
    ecc = _q(e, "ecc_mode", pynvml.nvmlDeviceGetEccMode, handle)
    if ecc is not None:
        gpu.ecc_enabled, gpu.ecc_pending = bool(ecc[0]), bool(ecc[1])
        unc = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        gpu.ecc_uncorrected_volatile = _q(
            e,
            "ecc_volatile",
            pynvml.nvmlDeviceGetTotalEccErrors,
            handle,
            unc,
            pynvml.NVML_VOLATILE_ECC,
        )
        gpu.ecc_uncorrected_aggregate = _q(
            e,
            "ecc_aggregate",
            pynvml.nvmlDeviceGetTotalEccErrors,
            handle,
            unc,
            pynvml.NVML_AGGREGATE_ECC,
        )
    reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    if reasons is not None:
        gpu.clocks_event_reasons = _q(e, "clocks_event_reasons", reasons, handle)
    gpu.pcie_gen_current = _q(e, "pcie_gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
    gpu.pcie_gen_max = _q(e, "pcie_gen_max", pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
    gpu.pcie_width_current = _q(e, "pcie_width", pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
    gpu.pcie_width_max = _q(e, "pcie_width_max", pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle)
    mig = _q(e, "mig", pynvml.nvmlDeviceGetMigMode, handle)
    gpu.mig_enabled = None if mig is None else bool(mig[0])
    return gpu, handle


def _memory_info(pynvml: Any, handle: Any, errors: dict[str, str]) -> Any:
    # v2 reports driver-reserved memory apart from `used`, like nvidia-smi does; an idle
    # card then shows (nearly) 0 MiB used, which is what the busy threshold assumes.
    v2 = getattr(pynvml, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
        except Exception:  # old driver or binding: fall back to v1
            pass
    return _q(errors, "memory", pynvml.nvmlDeviceGetMemoryInfo, handle)


def _processes(pynvml: Any, handle: Any, errors: dict[str, str]) -> list[ProcessInfo]:
    seen: dict[int, ProcessInfo] = {}
    for key, fn_name in (
        ("compute_processes", "nvmlDeviceGetComputeRunningProcesses"),
        ("graphics_processes", "nvmlDeviceGetGraphicsRunningProcesses"),
    ):
        fn = getattr(pynvml, fn_name, None)
        procs = _q(errors, key, fn, handle) if fn is not None else None
        for p in procs or []:
            pid = int(p.pid)
            used = getattr(p, "usedGpuMemory", None)
            info = seen.setdefault(pid, ProcessInfo(pid=pid))
            if used is not None and info.used_mib is None:
                info.used_mib = int(used) // MIB
    for info in seen.values():
        info.name = _process_name(pynvml, info.pid)
    return sorted(seen.values(), key=lambda p: -(p.used_mib or 0))


def _process_name(pynvml: Any, pid: int) -> str | None:
    try:
        return _text_of(pynvml.nvmlSystemGetProcessName(pid))
    except Exception:
        pass
    try:  # NVML cannot always see names (containers); /proc often can
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def _p2p_status(pynvml: Any, code: int | None) -> str | None:
    if code is None:
        return None
    names = {
        "NVML_P2P_STATUS_OK": "ok",
        "NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED": "chipset_not_supported",
        "NVML_P2P_STATUS_GPU_NOT_SUPPORTED": "gpu_not_supported",
        "NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED": "topology_not_supported",
        "NVML_P2P_STATUS_DISABLED_BY_REGKEY": "disabled_by_regkey",
        "NVML_P2P_STATUS_NOT_SUPPORTED": "not_supported",
    }
    for const, name in names.items():
        if getattr(pynvml, const, None) == code:
            return name
    return f"unknown ({code})"


def _probe_pair(
    pynvml: Any, a: int, b: int, handles: dict[int, Any], gpus: list[GpuProbe]
) -> PairProbe:
    pair = PairProbe(a=a, b=b)
    e = pair.errors
    ha, hb = handles[a], handles[b]
    read = _q(e, "p2p_read", pynvml.nvmlDeviceGetP2PStatus, ha, hb, pynvml.NVML_P2P_CAPS_INDEX_READ)
    pair.p2p_read = _p2p_status(pynvml, read)
    nvl = _q(
        e, "p2p_nvlink", pynvml.nvmlDeviceGetP2PStatus, ha, hb, pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    )
    pair.p2p_nvlink = _p2p_status(pynvml, nvl)
    target = normalize_bus_id(gpus[b].pci_bus_id)
    active = 0
    for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(ha, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = _text_of(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(ha, link).busId)
        except Exception as exc:
            # Links past the card's last one answer "invalid argument"; "not supported"
            # means no NVLink at all. Either way, stop counting.
            if link == 0:
                e["nvlink"] = str(exc) or type(exc).__name__
            break
        if normalize_bus_id(remote) == target:
            active += 1
    pair.nvlink_active = active
    return pair


# --- files and limits ---------------------------------------------------------------------------
def nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def probe_disk(role: str, configured: str) -> DiskProbe:
    probe = DiskProbe(role=role, configured=configured)
    try:
        where = nearest_existing(Path(os.path.expanduser(configured)))
        usage = shutil.disk_usage(where)
    except OSError as exc:
        probe.error = f"{type(exc).__name__}: {exc.strerror or exc}"
        return probe
    probe.probed = str(where)
    probe.free_bytes, probe.total_bytes = usage.free, usage.total
    return probe


def probe_shm(path: str = "/dev/shm") -> ShmProbe:
    probe = ShmProbe(path=path, exists=os.path.isdir(path))
    if not probe.exists:
        return probe
    try:
        usage = shutil.disk_usage(path)
    except OSError as exc:
        probe.error = f"{type(exc).__name__}: {exc.strerror or exc}"
        return probe
    probe.total_bytes, probe.free_bytes = usage.total, usage.free
    return probe


def probe_limits() -> LimitsProbe:
    try:
        import resource
    except ImportError:  # not on POSIX
        return LimitsProbe(error="resource module not available")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    return LimitsProbe(
        nofile_soft=-1 if soft == inf else soft, nofile_hard=-1 if hard == inf else hard
    )


# --- all of them ----------------------------------------------------------------------------
def collect(
    config: DoctorConfig, environ: Mapping[str, str], only: set[str] | None = None
) -> ProbeData:
    """Run the probes (all, or those named in `only`) concurrently and return their data."""
    import platform
    from datetime import datetime, timezone

    from sm70ctl import __version__

    wanted = [n for n in PROBE_NAMES if only is None or n in only]
    jobs: dict[str, Callable[[], Any]] = {
        "nvml": lambda: probe_nvml(config),
        "nvcc": lambda: probe_nvcc(config, environ),
        "host_cc": lambda: probe_host_cc(config, environ),
        "python": lambda: probe_python(config, environ),
        "disks": lambda: [
            probe_disk("weights", config.weights_dir),
            probe_disk("build", config.build_dir),
        ],
        "shm": probe_shm,
        "limits": probe_limits,
    }
    data = ProbeData(
        sm70ctl_version=__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        platform=platform.platform(),
        config=config,
        probed=wanted,
    )

    def timed(name: str) -> tuple[str, Any, float]:
        start = time.monotonic()
        result = jobs[name]()
        return name, result, round(time.monotonic() - start, 3)

    # Threads: every slow probe waits on a subprocess or the driver, not on Python.
    with ThreadPoolExecutor(max_workers=len(wanted) or 1) as pool:
        for name, result, seconds in pool.map(timed, wanted):
            setattr(data, name, result)
            data.seconds[name] = seconds
    return data


def asdict_probe(data: ProbeData) -> dict[str, Any]:
    from sm70ctl.doctor.records import to_dict

    return to_dict(data)


def load_probe_dict(raw: Any) -> ProbeData:
    """ProbeData from a recorded dict; raises records.RecordError on the wrong shape."""
    from sm70ctl.doctor.records import RecordError, from_dict

    if isinstance(raw, dict) and isinstance(raw.get("probes"), dict) and "checks" in raw:
        raw = raw["probes"]  # a whole `doctor --json` report holds the probe data too
    if not isinstance(raw, dict) or "schema_version" not in raw:
        raise RecordError("no schema_version")
    if raw["schema_version"] != SCHEMA_VERSION:
        raise RecordError(
            f"schema_version {raw['schema_version']!r}; this sm70ctl reads {SCHEMA_VERSION}"
        )
    return from_dict(ProbeData, raw)
