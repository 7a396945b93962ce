"""The one NVML probe: every GPU the driver sees, its state, and the links between a set of
them. It returns plain dataclasses (the doctor records them as JSON) and imports pynvml
lazily, so the CLI starts fast and works on machines without a driver.

Users: the doctor (everything), serve's and warmup's pre-flight (which GPUs, how busy),
the memory plan (names and total bytes).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.devices.selection import resolve_gpus

MIB = 1024 * 1024


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
    memory_total_bytes: int | None = None  # exact: the memory plan budgets in bytes
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


def probe_nvml(selected: Sequence[str] = ()) -> NvmlProbe:
    """Every GPU NVML sees, in its (PCI bus) order, and the P2P/NVLink state between each
    pair of the `selected` ones (SM70_GPUS entries). Never raises: a failed query is
    recorded as an error text."""
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
        wanted = [m.index for m in resolve_gpus(selected, probe.gpus) if m.index is not None]
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
        gpu.memory_total_bytes = int(mem.total)
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
