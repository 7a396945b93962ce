"""Probes: every side effect of the doctor (NVML, subprocesses, the file system).

Each probe returns a plain dataclass that round-trips through JSON (records.py), so a
user can record what the doctor saw (`sm70ctl doctor --record FILE`) and we can replay the
verdicts on it (`--probe-data FILE`). Probes never judge: they record what they saw, and
an error text where a query failed.
"""

from __future__ import annotations

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

from sm70ctl.devices.nvml import NvmlProbe, probe_nvml
from sm70ctl.doctor.config import DoctorConfig

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
    """The SM number a cubin was built for (None: unreadable or not a CUDA ELF). The header
    rule is the kernel checker's (`sm70ctl.kernels.nvrtc.elf_sm`), so both agree."""
    from sm70ctl.kernels.nvrtc import elf_sm

    try:
        data = path.read_bytes()[:64]
    except OSError:
        return None
    if len(data) < 52:
        return None
    try:
        return elf_sm(data)
    except ValueError:
        return None


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


_PYTHON_FACTS = ("python_version", "torch_installed", "torch_version", "torch_cuda",
                 "torch_arch_list", "torch_error")


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
            # The serving interpreter's output is input like a file: parsed bounded and
            # type-checked, an odd line ignored as if the probe had printed nothing.
            from sm70ctl.doctor.records import RecordError, from_dict
            from sm70ctl.errors import Sm70Error
            from sm70ctl.readers import parse_json

            try:
                data = parse_json(line[len("SM70CTL-PROBE ") :], what="python probe",
                                  name=str(path))
                if not isinstance(data, dict):
                    break
                facts = from_dict(PythonProbe, {k: data[k] for k in _PYTHON_FACTS if k in data})
            except (Sm70Error, RecordError):
                break
            for key in _PYTHON_FACTS:
                setattr(probe, key, getattr(facts, key))
    return probe


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
        "nvml": lambda: probe_nvml(config.gpus),
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
