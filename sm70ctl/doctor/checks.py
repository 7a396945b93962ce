"""Verdicts: pure functions from (DoctorConfig, ProbeData) to check results.

Nothing here touches the machine, so every verdict is tested on recorded probe data
(tests/data/doctor/*.json). Each check names the probes it needs, so `--check ID` runs
only those.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from sm70ctl.devices.nvml import GpuProbe, NvmlProbe
from sm70ctl.devices.selection import resolve_gpus
from sm70ctl.devices.topology import link_kind  # the one link rule, shared with serving
from sm70ctl.doctor.config import BUILD_FREE_BYTES, GB, WEIGHTS_FREE_BYTES, DoctorConfig
from sm70ctl.doctor.probes import ProbeData

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
STATUSES = (PASS, WARN, FAIL, SKIP)

MIN_DRIVER = 570  # CUDA 12.8 needs a 570 driver
REFERENCE_DRIVER = 580
CUDA_WANTED = (12, 8)
GCC_MIN = (11, 4)
GCC_MAX_MAJOR = 14  # CUDA 12.8's host_config.h rejects gcc 15
PYTHON_WANTED = (3, 12)
VOLTA = (7, 0)
GPU_MIN_TOTAL_MIB = 31 * 1024  # a 32 GB V100 reports 32768 MiB (32510 with ECC pages)
SHM_MIN_BYTES = 1 * 1024**3
SHM_WANT_BYTES = 4 * 1024**3
NOFILE_WANT = 65536

NO_DRIVER = "NVML not available (no NVIDIA driver)"
FIX_DRIVER = "install the NVIDIA driver (>= 570), then check `nvidia-smi`"

# NVML clocks event (throttle) reason bits: an ABI constant, named here so recorded
# bitmasks can be read without the binding.
CLOCK_EVENT_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that mean the card cannot hold its clocks (cooling, power delivery).
CLOCK_EVENTS_BAD = {
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
}


@dataclass(frozen=True)
class CheckResult:
    id: str
    title: str
    status: str
    observed: str
    expected: str
    fix: str = ""  # one line; empty when there is nothing to do

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


Verdict = tuple[str, str, str]  # status, observed, fix (expected comes from the registry)
CheckFn = Callable[[DoctorConfig, ProbeData], Verdict]


@dataclass(frozen=True)
class Check:
    id: str
    title: str
    expected: str
    probes: tuple[str, ...]
    fn: CheckFn


REGISTRY: list[Check] = []


def check(id: str, title: str, expected: str, probes: tuple[str, ...]):
    def add(fn: CheckFn) -> CheckFn:
        REGISTRY.append(Check(id, title, expected, probes, fn))
        return fn

    return add


# --- helpers -----------------------------------------------------------------------------
def version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    m = re.match(r"(\d+(?:\.\d+)*)", text.strip())
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def gb(n: int | None) -> str:
    return "?" if n is None else f"{n / GB:.1f} GB"


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024**3:.1f} GiB"


def worst(statuses: Iterable[str]) -> str:
    order = {PASS: 0, SKIP: 0, WARN: 1, FAIL: 2}
    result = PASS
    for s in statuses:
        if order[s] > order[result]:
            result = s
    return result


def not_probed(name: str) -> Verdict:
    return SKIP, f"{name} was not probed", ""


def nvml_down(nvml: NvmlProbe) -> Verdict:
    if nvml.error_kind in ("library_not_found", "driver_not_loaded"):
        return FAIL, NO_DRIVER, FIX_DRIVER
    if nvml.error_kind == "binding_missing":
        return FAIL, f"NVML not available: {nvml.error}", "pip install nvidia-ml-py"
    return (
        FAIL,
        f"NVML not available: {nvml.error}",
        "check `nvidia-smi`; reload the driver or reboot",
    )


def serving_gpus(config: DoctorConfig, nvml: NvmlProbe) -> list[GpuProbe]:
    by_index = {g.index: g for g in nvml.gpus}
    matches = resolve_gpus(config.gpus, nvml.gpus)
    return [by_index[m.index] for m in matches if m.index is not None]


def label(gpu: GpuProbe) -> str:
    return f"GPU{gpu.index}"


def per_gpu(
    config: DoctorConfig, data: ProbeData, judge: Callable[[GpuProbe], tuple[str, str, str]]
) -> Verdict:
    """Run `judge` on each serving GPU; the worst status wins, observations are joined."""
    if data.nvml is None:
        return not_probed("NVML")
    if not data.nvml.available:
        return nvml_down(data.nvml)
    gpus = serving_gpus(config, data.nvml)
    if not gpus:
        return SKIP, "none of the configured GPUs was found (see gpu.count)", ""
    results = [judge(g) for g in gpus]
    status = worst(r[0] for r in results)
    observed = "; ".join(f"{label(g)}: {r[1]}" for g, r in zip(gpus, results, strict=False))
    fixes = [r[2] for r in results if r[0] == status and r[2]]
    return status, observed, fixes[0] if fixes else ""


# --- settings ---------------------------------------------------------------------------------
@check("settings.valid", "SM70_* settings", "the settings load and pass their rules", ("settings",))
def settings_valid(config: DoctorConfig, data: ProbeData) -> Verdict:
    st = data.settings
    if st is None:
        return not_probed("settings")
    if st.problems:
        n = len(st.problems)
        head = f"{n} problem{'s' if n != 1 else ''}: "
        return (
            FAIL,
            head + "; ".join(st.problems),
            "`sm70ctl env check` lists them; fix each variable",
        )
    if st.source != "settings":
        return (
            WARN,
            f"settings module unavailable ({st.error}); read SM70_* directly",
            ("reinstall sm70ctl with its dependencies: pip install -e ."),
        )
    return PASS, "loaded", ""


# --- driver -------------------------------------------------------------------------------
@check("driver.nvml", "NVML", "NVML loads and answers", ("nvml",))
def nvml_available(config: DoctorConfig, data: ProbeData) -> Verdict:
    nvml = data.nvml
    if nvml is None:
        return not_probed("NVML")
    if not nvml.available:
        return nvml_down(nvml)
    return PASS, f"NVML answers; {len(nvml.gpus)} GPU(s) visible", ""


@check(
    "driver.version",
    "NVIDIA driver",
    f">= {MIN_DRIVER} (CUDA 12.8 needs it; the reference runs {REFERENCE_DRIVER})",
    ("nvml",),
)
def driver_version(config: DoctorConfig, data: ProbeData) -> Verdict:
    nvml = data.nvml
    if nvml is None:
        return not_probed("NVML")
    if not nvml.available:
        return nvml_down(nvml)
    v = version_tuple(nvml.driver_version)
    if v is None:
        return (
            FAIL,
            f"driver version unreadable ({nvml.error or nvml.driver_version!r})",
            FIX_DRIVER,
        )
    observed = f"driver {nvml.driver_version}"
    if nvml.cuda_driver_version:
        cv = nvml.cuda_driver_version
        observed += f" (supports CUDA up to {cv // 1000}.{cv % 1000 // 10})"
    if v[0] < MIN_DRIVER:
        return (
            FAIL,
            observed,
            f"upgrade the NVIDIA driver to {MIN_DRIVER} or newer ({REFERENCE_DRIVER} is tested)",
        )
    return PASS, observed, ""


# --- CUDA toolkit ---------------------------------------------------------------------------
@check(
    "cuda.nvcc",
    "CUDA toolkit (nvcc)",
    "nvcc 12.8 (SM70_CUDA_HOME, then CUDA_HOME, then PATH); 13+ cannot emit sm_70",
    ("nvcc",),
)
def cuda_nvcc(config: DoctorConfig, data: ProbeData) -> Verdict:
    nvcc = data.nvcc
    if nvcc is None:
        return not_probed("nvcc")
    install = "install CUDA 12.8 and set SM70_CUDA_HOME=/usr/local/cuda-12.8"
    chosen = nvcc.chosen
    if chosen is None:
        return FAIL, "no nvcc (SM70_CUDA_HOME and CUDA_HOME unset, none on PATH)", install
    if not chosen.exists:
        return (
            FAIL,
            f"{chosen.source} points at {chosen.path}, which does not exist",
            (f"fix {chosen.source} (it must hold bin/nvcc) or {install}"),
        )
    where = f"{chosen.path} (from {chosen.source})"
    run = nvcc.version_run
    v = version_tuple(nvcc.version)
    if v is None:
        why = (
            (run.error or run.stderr.strip().splitlines()[-1:] or ["no version line"])
            if run
            else ["not run"]
        )
        why_text = why if isinstance(why, str) else why[0]
        return FAIL, f"{where}: `nvcc --version` failed: {why_text}", install
    observed = f"{where}: CUDA {nvcc.version}"
    if v[0] >= 13:
        return FAIL, f"{observed}; CUDA {v[0]} dropped Volta and cannot emit sm_70", install
    if v[0] < 12:
        return FAIL, f"{observed}; vLLM needs CUDA 12", install
    if v[:2] != CUDA_WANTED:
        return WARN, f"{observed}; the stack is built and tested with 12.8", install
    return PASS, observed, ""


@check(
    "cuda.sm70-probe", "sm_70 probe compile", "nvcc -arch=sm_70 compiles a tiny kernel", ("nvcc",)
)
def cuda_sm70_probe(config: DoctorConfig, data: ProbeData) -> Verdict:
    nvcc = data.nvcc
    if nvcc is None:
        return not_probed("nvcc")
    run = nvcc.compile_run
    if run is None:
        return SKIP, "no nvcc to run (see cuda.nvcc)", ""
    fix = "use a CUDA 12.8 toolkit (SM70_CUDA_HOME) with gcc 11.4 to 14 (SM70_HOST_CC)"
    if run.timed_out:
        return FAIL, f"nvcc timed out after {run.seconds:.1f} s", fix
    if run.returncode is None:
        return FAIL, f"nvcc could not start: {run.error}", fix
    if run.returncode != 0:
        return (
            FAIL,
            f"nvcc exit {run.returncode}: {compile_error(run.stderr + run.stdout)}",
            (compile_fix(run.stderr + run.stdout) or fix),
        )
    arch = nvcc.compile_output_arch
    if arch is not None and arch != 70:
        return FAIL, f"compiled, but the cubin is for sm_{arch}", fix
    return PASS, f"compiled for sm_70 in {run.seconds:.1f} s", ""


def compile_error(output: str, limit: int = 160) -> str:
    """The line of nvcc's output that says why, shortened to fit a table cell."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    line = next((ln for ln in lines if "fatal" in ln or "error" in ln), lines[0] if lines else "")
    if "#error --" in line:  # host_config.h: keep the sentence, drop the path
        line = line[line.index("#error --") + len("#error --") :].strip()
        line = line.split(" The nvcc flag")[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def compile_fix(output: str) -> str | None:
    if "Unsupported gpu architecture" in output:
        return "this nvcc cannot target Volta: install CUDA 12.8 and set SM70_CUDA_HOME"
    if "unsupported GNU version" in output or "unsupported clang version" in output:
        return "nvcc rejects the host compiler: set SM70_HOST_CC to gcc 11.4 to 14 (see host.gcc)"
    return None


# --- host compiler --------------------------------------------------------------------------
def gcc_supported(version: str | None) -> bool:
    v = version_tuple(version)
    return v is not None and v[:2] >= GCC_MIN and v[0] <= GCC_MAX_MAJOR


@check(
    "host.gcc",
    "Host compiler",
    f"gcc {GCC_MIN[0]}.{GCC_MIN[1]} to {GCC_MAX_MAJOR} (CUDA 12.8 rejects newer); "
    "SM70_HOST_CC overrides",
    ("host_cc",),
)
def host_gcc(config: DoctorConfig, data: ProbeData) -> Verdict:
    cc = data.host_cc
    if cc is None:
        return not_probed("host compiler")
    good = [c for c in cc.versioned if c.kind == "gcc" and gcc_supported(c.version)]
    suggest = (
        f"set SM70_HOST_CC={good[0].name} ({good[0].version})"
        if good
        else "install gcc 12, 13 or 14 (e.g. apt install gcc-12 g++-12) and set SM70_HOST_CC=gcc-12"
    )
    if cc.configured is not None:
        c = cc.configured
        if c.path is None or c.run is None:
            return FAIL, f"SM70_HOST_CC={c.name}: not found", suggest
        if c.kind != "gcc":
            return (
                FAIL,
                f"SM70_HOST_CC={c.name}: {c.kind or 'unknown compiler'} {c.version or ''}".strip(),
                ("nvcc for this stack is tested with gcc; " + suggest),
            )
        if not gcc_supported(c.version):
            return FAIL, f"SM70_HOST_CC={c.name}: gcc {c.version}", suggest
        return PASS, f"SM70_HOST_CC={c.name}: gcc {c.version}", ""
    d = cc.default
    others = ", ".join(f"{c.name} ({c.version})" for c in cc.versioned if c.version)
    also = f"; installed: {others}" if others else ""
    if d is None or d.path is None or d.run is None:
        if good:
            return WARN, f"no `gcc` on PATH{also}", suggest
        return FAIL, f"no gcc found{also}", suggest
    if d.kind == "gcc" and gcc_supported(d.version):
        return PASS, f"gcc {d.version} ({d.path}){also}", ""
    observed = (
        f"gcc {d.version} ({d.path}){also}"
        if d.kind == "gcc"
        else f"`gcc` is {d.kind or 'unknown'} {d.version}"
    )
    if good:
        return WARN, f"{observed}; the default is outside 11.4-14", suggest
    return FAIL, f"{observed}; CUDA 12.8 needs gcc 11.4 to 14", suggest


# --- serving interpreter and torch -------------------------------------------------------------
@check("serve.python", "Serving Python", "SM70_SERVE_PYTHON runs Python 3.12", ("python",))
def serve_python(config: DoctorConfig, data: ProbeData) -> Verdict:
    py = data.python
    if py is None:
        return not_probed("serving Python")
    fix = "run `sm70ctl build` (it creates the serving environment) or set SM70_SERVE_PYTHON"
    if not py.exists:
        # records from before `missing` existed say only that it was not usable
        return FAIL, f"SM70_SERVE_PYTHON={py.configured}: {py.missing or 'not found'}", fix
    run = py.run
    if run is None or py.python_version is None:
        why = "no result"
        if run is not None:
            if run.timed_out or run.error:
                why = run.error or "timed out"
            else:
                tail = [ln for ln in run.stderr.splitlines() if ln.strip()]
                why = f"exit {run.returncode}" + (f": {tail[-1].strip()}" if tail else "")
        return FAIL, f"{py.path}: {why}", fix
    v = version_tuple(py.python_version) or ()
    observed = f"{py.path}: Python {py.python_version}"
    if v[:2] != PYTHON_WANTED:
        return (
            WARN,
            f"{observed}; the lock file pins cp312 wheels",
            "rebuild the serving environment with Python 3.12",
        )
    return PASS, observed, ""


def _torch_ready(data: ProbeData) -> Verdict | None:
    py = data.python
    if py is None:
        return not_probed("serving Python")
    if py.python_version is None:
        return SKIP, "no working serving Python (see serve.python)", ""
    if py.torch_error:
        return (
            FAIL,
            f"import torch failed: {py.torch_error}",
            "reinstall torch with `sm70ctl build`",
        )
    if not py.torch_installed:
        return FAIL, "torch is not installed", "run `sm70ctl build` (it installs the pinned torch)"
    return None


@check("serve.torch", "torch", "torch installed in the serving environment", ("python",))
def serve_torch(config: DoctorConfig, data: ProbeData) -> Verdict:
    early = _torch_ready(data)
    if early is not None:
        return early
    return PASS, f"torch {data.python.torch_version}", ""  # type: ignore[union-attr]


@check("serve.torch-sm70", "torch has sm_70", "'sm_70' in torch.cuda.get_arch_list()", ("python",))
def serve_torch_sm70(config: DoctorConfig, data: ProbeData) -> Verdict:
    early = _torch_ready(data)
    if early is not None:
        return SKIP if early[0] == FAIL else early[0], early[1], ""
    py = data.python
    assert py is not None
    archs = py.torch_arch_list or []
    shown = " ".join(archs) if archs else "none (a CPU-only build)"
    if "sm_70" not in archs:
        return (
            FAIL,
            f"torch {py.torch_version} archs: {shown}",
            (
                "install a torch build with sm_70 (cu126 wheels for 2.11+, or 2.10 and older); "
                "without it V100 fails with 'no kernel image is available'"
            ),
        )
    return PASS, f"torch {py.torch_version} archs: {shown}", ""


@check("serve.torch-cuda", "torch CUDA", "torch built for CUDA 12.x", ("python",))
def serve_torch_cuda(config: DoctorConfig, data: ProbeData) -> Verdict:
    early = _torch_ready(data)
    if early is not None:
        return SKIP if early[0] == FAIL else early[0], early[1], ""
    py = data.python
    assert py is not None
    fix = "install the pinned CUDA 12 torch with `sm70ctl build`"
    if not py.torch_cuda:
        return FAIL, f"torch {py.torch_version} is a CPU-only build", fix
    v = version_tuple(py.torch_cuda) or (0,)
    if v[0] != 12:
        return (
            FAIL,
            f"torch {py.torch_version} built for CUDA {py.torch_cuda}; Volta needs a CUDA 12 build",
            fix,
        )
    return PASS, f"torch {py.torch_version} built for CUDA {py.torch_cuda}", ""


# --- GPUs -----------------------------------------------------------------------------------------
@check("gpu.count", "GPU count", "every SM70_GPUS entry is a GPU on this machine", ("nvml",))
def gpu_count(config: DoctorConfig, data: ProbeData) -> Verdict:
    nvml = data.nvml
    if nvml is None:
        return not_probed("NVML")
    if not nvml.available:
        return nvml_down(nvml)
    resolved = resolve_gpus(config.gpus, nvml.gpus)
    missing = [m.entry for m in resolved if m.index is None]
    shown = ",".join(config.gpus)
    found = len(config.gpus) - len(missing)
    observed = f"SM70_GPUS={shown}: {found} of {len(config.gpus)} found; {len(nvml.gpus)} visible"
    if missing:
        return (
            FAIL,
            observed + f"; not found: {', '.join(missing)}",
            ("set SM70_GPUS to indices or GPU-UUIDs listed by `nvidia-smi -L`"),
        )
    if not config.gpus:
        return FAIL, "SM70_GPUS is empty", "set SM70_GPUS=0,1"
    return PASS, observed, ""


def _arch(gpu: GpuProbe) -> tuple[str, str, str]:
    if gpu.cc_major is None:
        return FAIL, "compute capability unreadable", "check `nvidia-smi -q`"
    cc = f"{gpu.cc_major}.{gpu.cc_minor}"
    if (gpu.cc_major, gpu.cc_minor) != VOLTA:
        return (
            FAIL,
            f"{gpu.name}: compute capability {cc}; this stack needs 7.0",
            "use V100 (sm_70) GPUs",
        )
    total = gpu.memory_total_mib or 0
    if total < GPU_MIN_TOTAL_MIB:
        return (
            FAIL,
            f"{gpu.name}: compute capability {cc}, {total} MiB; the memory plan needs 32 GB",
            ("use V100 32 GB cards"),
        )
    return PASS, f"{gpu.name}: compute capability {cc}, {total} MiB", ""


@check("gpu.arch", "GPU model", "compute capability 7.0 with 32 GB", ("nvml",))
def gpu_arch(config: DoctorConfig, data: ProbeData) -> Verdict:
    return per_gpu(config, data, _arch)


@check(
    "gpu.memory",
    "GPU memory in use",
    "< SM70_GPU_BUSY_MIB (500 MiB) in use on each GPU",
    ("nvml",),
)
def gpu_memory(config: DoctorConfig, data: ProbeData) -> Verdict:
    def judge(gpu: GpuProbe) -> tuple[str, str, str]:
        used = gpu.memory_used_mib
        if used is None:
            return WARN, "memory use unreadable", "check `nvidia-smi`"
        if used < config.gpu_busy_mib:
            return PASS, f"{used} MiB used", ""
        if gpu.processes:
            holders = ", ".join(
                f"pid {p.pid} ({p.name or '?'}"
                + (f", {p.used_mib} MiB)" if p.used_mib is not None else ")")
                for p in gpu.processes
            )
        else:
            holders = "no process visible (another container or PID namespace)"
        pids = " ".join(str(p.pid) for p in gpu.processes)
        fix = f"stop {'pid ' + pids if pids else 'what holds it'} or pick other GPUs with SM70_GPUS"
        return FAIL, f"{used} MiB used >= {config.gpu_busy_mib} MiB, held by {holders}", fix

    return per_gpu(config, data, judge)


@check("gpu.persistence", "Persistence mode", "on (no driver re-init between runs)", ("nvml",))
def gpu_persistence(config: DoctorConfig, data: ProbeData) -> Verdict:
    def judge(gpu: GpuProbe) -> tuple[str, str, str]:
        if gpu.persistence_mode is None:
            return PASS, "not reported", ""
        if gpu.persistence_mode:
            return PASS, "on", ""
        return WARN, "off", "sudo nvidia-smi -pm 1 (or enable nvidia-persistenced)"

    return per_gpu(config, data, judge)


@check("gpu.ecc", "ECC", "ECC on, no uncorrected errors", ("nvml",))
def gpu_ecc(config: DoctorConfig, data: ProbeData) -> Verdict:
    def judge(gpu: GpuProbe) -> tuple[str, str, str]:
        if gpu.ecc_enabled is None:
            return PASS, "ECC not supported", ""
        vol, agg = gpu.ecc_uncorrected_volatile or 0, gpu.ecc_uncorrected_aggregate or 0
        if vol > 0:
            return (
                FAIL,
                f"{vol} uncorrected ECC errors since the last driver load",
                ("reset the GPU (nvidia-smi -r) or reboot; replace the card if errors return"),
            )
        pending = "" if gpu.ecc_pending == gpu.ecc_enabled else " (change pending a reboot)"
        if not gpu.ecc_enabled:
            return WARN, f"ECC off{pending}", "sudo nvidia-smi -e 1, then reboot"
        if agg > 0:
            return (
                WARN,
                f"ECC on; {agg} uncorrected errors over the card's life",
                ("watch `nvidia-smi -q -d PAGE_RETIREMENT`; recurring errors mean a failing card"),
            )
        return PASS, f"ECC on, 0 uncorrected errors{pending}", ""

    return per_gpu(config, data, judge)


def clock_event_names(mask: int) -> list[str]:
    names = [name for bit, name in CLOCK_EVENT_BITS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_BITS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return names


@check("gpu.throttle", "Clock events", "no thermal, power-brake or hardware slowdown", ("nvml",))
def gpu_throttle(config: DoctorConfig, data: ProbeData) -> Verdict:
    def judge(gpu: GpuProbe) -> tuple[str, str, str]:
        if gpu.clocks_event_reasons is None:
            return PASS, "not reported", ""
        names = clock_event_names(gpu.clocks_event_reasons)
        bad = [n for n in names if n in CLOCK_EVENTS_BAD]
        shown = ", ".join(names) if names else "none"
        if bad:
            return (
                WARN,
                f"clocks held down: {shown}",
                "check cooling, fans and power cables; `nvidia-smi -q -d PERFORMANCE`",
            )
        return PASS, shown, ""

    return per_gpu(config, data, judge)


@check("gpu.pcie", "PCIe link", "trained at its full width (V100: gen3 x16)", ("nvml",))
def gpu_pcie(config: DoctorConfig, data: ProbeData) -> Verdict:
    def judge(gpu: GpuProbe) -> tuple[str, str, str]:
        gen, gen_max = gpu.pcie_gen_current, gpu.pcie_gen_max
        width, width_max = gpu.pcie_width_current, gpu.pcie_width_max
        if width is None or width_max is None:
            return PASS, "not reported", ""
        # The current generation drops at idle to save power; the width does not.
        shown = f"gen{gen} x{width} (max gen{gen_max} x{width_max})"
        if width < width_max:
            return (
                WARN,
                f"{shown}: link trained narrower than the card supports",
                ("reseat the card or check the slot/riser; see `nvidia-smi -q -d PCIE`"),
            )
        if gen_max is not None and gen_max < 3:
            return WARN, f"{shown}: below PCIe gen3", "move the card to a gen3 (or newer) slot"
        return PASS, shown, ""

    return per_gpu(config, data, judge)


ALLREDUCE = {
    "nvlink": "all-reduce in fp16 over NVLink",
    "pcie_p2p": "all-reduce with the 12-bit exchange over PCIe P2P",
    "none": "no P2P: serving sets NCCL_P2P_DISABLE=1 and all-reduce goes through host memory",
}


@check(
    "gpu.interconnect",
    "GPU pair link",
    "NVLink between the serving pair (fp16 all-reduce); PCIe P2P works (12-bit exchange)",
    ("nvml",),
)
def gpu_interconnect(config: DoctorConfig, data: ProbeData) -> Verdict:
    nvml = data.nvml
    if nvml is None:
        return not_probed("NVML")
    if not nvml.available:
        return nvml_down(nvml)
    gpus = serving_gpus(config, nvml)
    if len(gpus) < 2:
        return SKIP, f"{len(gpus)} serving GPU found; no pair to link", ""
    a, b = gpus[0].index, gpus[1].index
    pair = next((p for p in nvml.pairs if {p.a, p.b} == {a, b}), None)
    if pair is None:
        return WARN, f"GPU{a}-GPU{b}: link not probed", "run `nvidia-smi topo -m`"
    kind = link_kind(pair)
    where = f"GPU{a}-GPU{b}"
    if kind == "nvlink":
        n = pair.nvlink_active or 0
        links = f"{n} active NVLink link(s)" if n else "NVLink P2P (through a switch)"
        return PASS, f"{where}: {links}; {ALLREDUCE[kind]}", ""
    if kind == "pcie_p2p":
        return PASS, f"{where}: PCIe with P2P, no NVLink; {ALLREDUCE[kind]}", ""
    return (
        WARN,
        f"{where}: PCIe without P2P ({pair.p2p_read or 'unknown'}); {ALLREDUCE[kind]}",
        (
            "enable P2P (disable PCIe ACS / IOMMU passthrough in BIOS) or serve on an NVLink pair; "
            "P2P cut a 128K prefill from 157 s to 103 s"
        ),
    )


@check("gpu.mig", "MIG", "MIG off", ("nvml",))
def gpu_mig(config: DoctorConfig, data: ProbeData) -> Verdict:
    def judge(gpu: GpuProbe) -> tuple[str, str, str]:
        if gpu.mig_enabled is None:
            return PASS, "not supported (off)", ""
        if gpu.mig_enabled:
            return FAIL, "MIG on", f"sudo nvidia-smi -i {gpu.index} -mig 0, then reset the GPU"
        return PASS, "off", ""

    return per_gpu(config, data, judge)


# --- disk and limits ---------------------------------------------------------------------------
def _disk(data: ProbeData, role: str, need: int, setting: str) -> Verdict:
    if data.disks is None:
        return not_probed("disk")
    disk = next((d for d in data.disks if d.role == role), None)
    if disk is None:
        return not_probed(f"{role} disk")
    if disk.error or disk.free_bytes is None:
        return FAIL, f"{setting}={disk.configured}: {disk.error or 'unreadable'}", f"fix {setting}"
    where = disk.configured
    if disk.probed and disk.probed != _expand(disk.configured):
        where += f" (measured at {disk.probed}, its nearest existing parent)"
    observed = f"{gb(disk.free_bytes)} free for {where}"
    if disk.free_bytes < need:
        return (
            FAIL,
            observed,
            f"free {gb(need - disk.free_bytes)} or point {setting} at a larger disk",
        )
    return PASS, observed, ""


def _expand(path: str) -> str:
    import os.path

    return os.path.abspath(os.path.expanduser(path))


@check(
    "disk.weights",
    "Disk for weights",
    f">= {gb(WEIGHTS_FREE_BYTES)} free in SM70_WEIGHTS_DIR",
    ("disks",),
)
def disk_weights(config: DoctorConfig, data: ProbeData) -> Verdict:
    return _disk(data, "weights", WEIGHTS_FREE_BYTES, "SM70_WEIGHTS_DIR")


@check(
    "disk.build",
    "Disk for the build",
    f">= {gb(BUILD_FREE_BYTES)} free in SM70_BUILD_DIR",
    ("disks",),
)
def disk_build(config: DoctorConfig, data: ProbeData) -> Verdict:
    return _disk(data, "build", BUILD_FREE_BYTES, "SM70_BUILD_DIR")


@check(
    "disk.shm",
    "/dev/shm",
    f">= {gib(SHM_WANT_BYTES)} free (NCCL and vLLM's shared-memory queues)",
    ("shm",),
)
def disk_shm(config: DoctorConfig, data: ProbeData) -> Verdict:
    shm = data.shm
    if shm is None:
        return not_probed("/dev/shm")
    fix = "in a container: --shm-size=16g or --ipc=host; else remount /dev/shm larger"
    if not shm.exists or shm.free_bytes is None:
        return FAIL, f"{shm.path}: {shm.error or 'missing'}", fix
    observed = f"{gib(shm.free_bytes)} free of {gib(shm.total_bytes)}"
    if shm.free_bytes < SHM_MIN_BYTES:
        return FAIL, observed, fix
    if shm.free_bytes < SHM_WANT_BYTES:
        return WARN, observed, fix
    return PASS, observed, ""


@check(
    "limits.nofile",
    "Open-files limit",
    f"hard limit >= {NOFILE_WANT} (vLLM raises its soft limit)",
    ("limits",),
)
def limits_nofile(config: DoctorConfig, data: ProbeData) -> Verdict:
    lim = data.limits
    if lim is None:
        return not_probed("limits")
    if lim.nofile_soft is None or lim.nofile_hard is None:
        return SKIP, lim.error or "not readable", ""

    def show(n: int) -> str:
        return "unlimited" if n < 0 else str(n)

    observed = f"soft {show(lim.nofile_soft)}, hard {show(lim.nofile_hard)}"
    if 0 <= lim.nofile_hard < NOFILE_WANT:
        return (
            WARN,
            observed,
            f"raise it: `ulimit -Hn {NOFILE_WANT}` / LimitNOFILE={NOFILE_WANT} in the unit",
        )
    return PASS, observed, ""


# --- running them ---------------------------------------------------------------------------
CHECK_IDS = tuple(c.id for c in REGISTRY)
GROUPS = tuple(dict.fromkeys(i.split(".")[0] for i in CHECK_IDS))


def select(ids: Iterable[str] | None) -> list[Check]:
    """The checks named by ids or group names (driver, cuda, host, serve, gpu, disk,
    limits), in registry order. Unknown names raise ValueError listing them."""
    if not ids:
        return list(REGISTRY)
    wanted = list(ids)
    unknown = [i for i in wanted if i not in CHECK_IDS and i not in GROUPS]
    if unknown:
        raise ValueError(", ".join(i if i.strip() else repr(i) for i in unknown))
    return [c for c in REGISTRY if c.id in wanted or c.id.split(".")[0] in wanted]


def probes_needed(checks: Iterable[Check]) -> set[str]:
    return {p for c in checks for p in c.probes}


def run_checks(
    config: DoctorConfig, data: ProbeData, checks: Iterable[Check] | None = None
) -> list[CheckResult]:
    out = []
    for c in REGISTRY if checks is None else checks:
        status, observed, fix = c.fn(config, data)
        out.append(
            CheckResult(c.id, c.title, status, observed, c.expected, fix if status != PASS else "")
        )
    return out


def summarize(results: list[CheckResult], strict: bool = False) -> dict:
    counts = {s: sum(1 for r in results if r.status == s) for s in STATUSES}
    failing = [r.id for r in results if r.status == FAIL or (strict and r.status == WARN)]
    status = FAIL if failing else (WARN if counts[WARN] else PASS)
    return {
        "status": status,
        "exit_code": 1 if failing else 0,
        "strict": strict,
        "counts": counts,
        "failing": failing,
        "warnings": [r.id for r in results if r.status == WARN],
    }
