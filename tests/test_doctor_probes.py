"""The doctor's probes, run for real on this machine: nvcc, gcc, a Python subprocess,
pynvml, the disk. Executables the tests write (fake toolkits, interpreters) are real
programs run through the same subprocess path.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from sm70ctl.devices import nvml
from sm70ctl.doctor import checks as ck
from sm70ctl.doctor import probes as pr
from sm70ctl.doctor.config import DoctorConfig
from sm70ctl.doctor.records import to_dict

IN_CI = os.environ.get("CI") == "true"


def need(condition: bool, why: str) -> None:
    """Skip locally when the machine lacks something; fail in CI, which must have it."""
    if not condition:
        if IN_CI:
            pytest.fail(f"CI machine lacks: {why}")
        pytest.skip(why)


def script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_nvcc(home: Path, release: str, body: str = "") -> Path:
    banner = f"Cuda compilation tools, release {release}, V{release}.0"
    return script(
        home / "bin" / "nvcc",
        f'case "$1" in --version) echo "{banner}";; *) {body or "exit 0"};; esac\n',
    )


ENV = {"PATH": os.environ.get("PATH", os.defpath)}


# --- nvcc ------------------------------------------------------------------------------------
def test_real_nvcc_runs_the_sm70_probe():
    nvcc = shutil.which("nvcc")
    need(nvcc is not None, "an nvcc on PATH (this machine kind has CUDA 13.0 in /usr/local/bin)")
    probe = pr.probe_nvcc(DoctorConfig(), {"PATH": os.environ["PATH"]})
    assert probe.chosen is not None and probe.chosen.source == "PATH"
    assert os.path.realpath(probe.chosen.path) == os.path.realpath(nvcc)
    assert probe.version_run.returncode == 0 and probe.version is not None
    run = probe.compile_run
    assert run is not None and run.argv[1:3] == ["-arch=sm_70", "-cubin"]
    assert "$TMP/probe.cu" in run.argv  # no temp path leaks into the record
    major = int(probe.version.split(".")[0])
    verdict = {r.id: r for r in ck.run_checks(DoctorConfig(), pr.ProbeData(nvcc=probe))}
    if major >= 13:
        # CUDA 13 really refuses Volta; the probe ran it and says so.
        assert run.returncode not in (0, None)
        assert "Unsupported gpu architecture 'sm_70'" in run.stderr
        assert verdict["cuda.sm70-probe"].status == "fail"
        assert "Unsupported gpu architecture 'sm_70'" in verdict["cuda.sm70-probe"].observed
        assert verdict["cuda.nvcc"].status == "fail"
    else:
        assert run.returncode == 0 and probe.compile_output_arch == 70
        assert verdict["cuda.sm70-probe"].status == "pass"


def test_cubin_arch_of_a_real_cubin(tmp_path):
    nvcc = shutil.which("nvcc")
    need(nvcc is not None, "an nvcc on PATH")
    src = tmp_path / "k.cu"
    src.write_text(pr.PROBE_KERNEL)
    # sm_75 is the oldest arch both CUDA 12 and 13 emit.
    subprocess.run(
        [nvcc, "-arch=sm_75", "-cubin", "-o", str(tmp_path / "k.cubin"), str(src)],
        check=True,
        timeout=60,
    )
    assert pr.cubin_arch(tmp_path / "k.cubin") == 75


def _nvrtc12() -> Path | None:
    try:
        import nvidia.cuda_nvrtc as pkg  # from the cuda12 extra (NVRTC 12.8)
    except ImportError:
        return None
    found = sorted(Path(next(iter(pkg.__path__))).glob("lib/libnvrtc.so.12*"))
    return found[0] if found else None


def test_cubin_arch_of_a_cuda12_cubin(tmp_path):
    """CUDA 12 writes the SM elsewhere in the ELF header than CUDA 13: check the reader on
    a real sm_70 cubin from NVRTC 12.8 (what a CUDA 12.8 nvcc emits)."""
    import ctypes

    path = _nvrtc12()
    need(path is not None, "NVRTC 12 (pip install -e .[cuda12])")
    lib = ctypes.CDLL(str(path))
    prog = ctypes.c_void_p()
    src = pr.PROBE_KERNEL.encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"probe.cu", 0, None, None) == 0
    assert lib.nvrtcCompileProgram(prog, 1, (ctypes.c_char_p * 1)(b"-arch=sm_70")) == 0
    size = ctypes.c_size_t()
    assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) == 0
    buf = ctypes.create_string_buffer(size.value)
    assert lib.nvrtcGetCUBIN(prog, buf) == 0
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    (tmp_path / "probe.cubin").write_bytes(buf.raw)
    assert pr.cubin_arch(tmp_path / "probe.cubin") == 70


def test_cubin_arch_header_layouts(tmp_path):
    def elf(abi: int, flags: int, machine: int = 190) -> Path:
        head = bytearray(64)
        head[:4], head[4], head[8] = b"\x7fELF", 2, abi
        head[18:20] = machine.to_bytes(2, "little")
        head[48:52] = flags.to_bytes(4, "little")
        p = tmp_path / f"{abi}-{flags}-{machine}.cubin"
        p.write_bytes(bytes(head))
        return p

    assert pr.cubin_arch(elf(7, 0x00460546)) == 70  # CUDA 12: SM in the low byte
    assert pr.cubin_arch(elf(8, 0x06004604)) == 70  # CUDA 13 ABI: SM in bits 8-15
    assert pr.cubin_arch(tmp_path / "missing") is None
    assert pr.cubin_arch(elf(7, 0x00460546, machine=62)) is None  # an x86-64 ELF, not a cubin
    (tmp_path / "text").write_text("not an elf at all, but long enough to have a header....")
    assert pr.cubin_arch(tmp_path / "text") is None


def test_nvcc_precedence(tmp_path):
    sm70_home, cuda_home, path_dir = tmp_path / "sm70", tmp_path / "cuda", tmp_path / "path"
    fake_nvcc(sm70_home, "12.8")
    fake_nvcc(cuda_home, "12.6")
    fake_nvcc(path_dir, "13.0")
    env = {"PATH": f"{path_dir / 'bin'}:{ENV['PATH']}", "CUDA_HOME": str(cuda_home)}
    both = pr.probe_nvcc(DoctorConfig(cuda_home=str(sm70_home)), env, compile_probe=False)
    assert [c.source for c in both.candidates] == ["SM70_CUDA_HOME", "CUDA_HOME", "PATH"]
    assert (both.chosen.source, both.version) == ("SM70_CUDA_HOME", "12.8")
    only_cuda = pr.probe_nvcc(DoctorConfig(), env, compile_probe=False)
    assert (only_cuda.chosen.source, only_cuda.version) == ("CUDA_HOME", "12.6")
    only_path = pr.probe_nvcc(DoctorConfig(), {"PATH": env["PATH"]}, compile_probe=False)
    assert (only_path.chosen.source, only_path.version) == ("PATH", "13.0")
    # An explicit setting that points nowhere is reported, not silently replaced.
    wrong = pr.probe_nvcc(DoctorConfig(cuda_home=str(tmp_path / "nope")), env, compile_probe=False)
    assert wrong.chosen.source == "SM70_CUDA_HOME" and not wrong.chosen.exists
    assert wrong.version_run is None
    none = pr.probe_nvcc(DoctorConfig(), {"PATH": str(tmp_path / "empty")})
    assert none.chosen is None and none.compile_run is None


def test_sm70_probe_timeout_and_host_cc(tmp_path, monkeypatch):
    monkeypatch.setattr(pr, "SM70_PROBE_TIMEOUT", 0.5)
    home = tmp_path / "cuda"
    fake_nvcc(home, "12.8", body="sleep 300")  # never finishes on its own
    probe = _returns(lambda: pr.probe_nvcc(DoctorConfig(cuda_home=str(home),
                                                         host_cc="gcc-13"), ENV))
    assert probe.compile_run.timed_out
    assert probe.compile_run.argv[1:3] == ["-ccbin", "gcc-13"]
    r = ck.run_checks(DoctorConfig(), pr.ProbeData(nvcc=probe), ck.select(["cuda.sm70-probe"]))[0]
    assert r.status == "fail" and "timed out" in r.observed


def test_timeout_kills_grandchildren_holding_the_pipes(tmp_path):
    # Like nvcc's cicc/ptxas: a child that outlives its parent and keeps stdout open.
    prog = script(tmp_path / "tool", "sleep 300 &\nsleep 300\n")
    run = _returns(lambda: pr.run_command([str(prog)], timeout=0.5))
    assert run.timed_out and run.returncode is None


def _returns(call: Any, limit: float = 60.0) -> Any:
    """call()'s result; fails if it has not returned within `limit` seconds, which only a
    timeout that did not stop the tool (or its children holding the pipes) can cause."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        pytest.fail(f"still waiting after {limit:g} s: the timeout did not stop the tool")
    return result[0]


def test_sm70_probe_failure_output_is_recorded(tmp_path):
    home = tmp_path / "cuda"
    fake_nvcc(
        home,
        "12.8",
        body="echo \"nvcc fatal   : Unsupported gpu architecture 'sm_70'\" >&2; exit 1",
    )
    probe = pr.probe_nvcc(DoctorConfig(cuda_home=str(home)), ENV)
    assert probe.compile_run.returncode == 1
    assert "Unsupported gpu architecture" in probe.compile_run.stderr


@pytest.mark.parametrize(
    "text,version",
    [
        ("Cuda compilation tools, release 12.8, V12.8.93", "12.8"),
        ("release 13.0, V13.0.88", "13.0"),
        ("nope", None),
    ],
)
def test_parse_nvcc_version(text, version):
    assert pr.parse_nvcc_version(text) == version


# --- host compiler ---------------------------------------------------------------------------
def test_real_gcc():
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc on PATH")
    want = subprocess.run(
        [gcc, "-dumpfullversion"], capture_output=True, text=True, check=True
    ).stdout.strip()
    probe = pr.probe_host_cc(DoctorConfig(), ENV)
    assert probe.default.kind == "gcc" and probe.default.version == want
    assert probe.configured is None
    names = pr.versioned_gcc_names(ENV)
    assert [c.name for c in probe.versioned] == names
    for c in probe.versioned:
        assert c.kind == "gcc" and c.version


def test_host_cc_setting_and_versioned_scan(tmp_path):
    gcc = shutil.which("gcc")
    need(gcc is not None, "gcc on PATH")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for n, v in (("gcc-99", "99.1.0"), ("gcc-7", "7.5.0")):
        script(bin_dir / n, f'echo "{n} (Fake) {v}"; echo "Copyright (C) 2026"\n')
    script(bin_dir / "gcc-ar-99", "exit 0\n")  # not a compiler: must be ignored
    (tmp_path / "bin2").mkdir()
    os.symlink(bin_dir / "gcc-7", tmp_path / "bin2" / "gcc-7")  # same binary twice on PATH
    env = {"PATH": f"{bin_dir}:{tmp_path / 'bin2'}:{ENV['PATH']}"}
    names = pr.versioned_gcc_names(env)
    assert names[0] == "gcc-99" and names[-1] == "gcc-7" and names.count("gcc-7") == 1
    assert "gcc-ar-99" not in names
    probe = pr.probe_host_cc(DoctorConfig(host_cc=str(bin_dir / "gcc-99")), env)
    assert probe.configured.path == str(bin_dir / "gcc-99")
    assert (probe.configured.kind, probe.configured.version) == ("gcc", "99.1.0")
    found = {c.name: c.version for c in probe.versioned}
    assert (found["gcc-99"], found["gcc-7"]) == ("99.1.0", "7.5.0")
    r = ck.run_checks(DoctorConfig(), pr.ProbeData(host_cc=probe), ck.select(["host.gcc"]))[0]
    assert r.status == "fail" and "SM70_HOST_CC=" in r.observed
    missing = pr.probe_host_cc(DoctorConfig(host_cc="gcc-does-not-exist"), env)
    assert missing.configured.path is None and missing.configured.run is None


@pytest.mark.parametrize(
    "banner,expected",
    [
        ("gcc (Debian 12.2.0-14+deb12u1) 12.2.0", ("gcc", "12.2.0")),
        ("gcc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0", ("gcc", "11.4.0")),
        ("gcc (GCC) 15.2.1 20250813", ("gcc", "15.2.1")),
        ("gcc-14 (Ubuntu 14.2.0-4ubuntu2~24.04) 14.2.0", ("gcc", "14.2.0")),
        ("Ubuntu clang version 18.1.3 (1ubuntu1)", ("clang", "18.1.3")),
        ("Apple clang version 15.0.0 (clang-1500.3.9.4)", ("clang", "15.0.0")),
        ("icc (ICC) 2021.10.0 20230609", (None, "2021.10.0")),
        ("", (None, None)),
    ],
)
def test_parse_cc_version(banner, expected):
    assert pr.parse_cc_version(banner + "\nCopyright (C) 2023\n") == expected


# --- the serving interpreter -----------------------------------------------------------------
def test_real_python_without_torch(tmp_path):
    # The test venv's own interpreter has no torch: a real "not installed" answer.
    env = {**ENV, "PYTHONPATH": str(tmp_path)}
    probe = pr.probe_python(DoctorConfig(serve_python=sys.executable), env)
    assert probe.exists and probe.run.returncode == 0
    assert probe.python_version == "{}.{}.{}".format(*sys.version_info[:3])
    assert probe.torch_installed is False and probe.torch_arch_list is None
    assert probe.run.argv == [sys.executable, "-c", "<probe script>"]
    assert "torch" not in sys.modules  # never imported in our own process


def test_real_python_with_a_torch_package(tmp_path):
    # A minimal `torch` package with the attributes the probe reads, so the real probe
    # script runs its torch branch in a real interpreter.
    pkg = tmp_path / "torch"
    (pkg / "cuda").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "__version__ = '2.10.0+cu128'\nfrom torch import version, cuda, _C\n"
    )
    (pkg / "version.py").write_text("cuda = '12.8'\n")
    (pkg / "_C.py").write_text("def _cuda_getArchFlags():\n    return 'sm_70 sm_80 sm_90'\n")
    (pkg / "cuda" / "__init__.py").write_text("def get_arch_list():\n    return []\n")
    env = {**ENV, "PYTHONPATH": str(tmp_path)}
    probe = pr.probe_python(DoctorConfig(serve_python=sys.executable), env)
    assert probe.torch_installed is True
    assert (probe.torch_version, probe.torch_cuda) == ("2.10.0+cu128", "12.8")
    assert probe.torch_arch_list == ["sm_70", "sm_80", "sm_90"]
    # A torch whose import raises is reported, not fatal.
    (pkg / "__init__.py").write_text(
        "raise OSError('libcudnn.so.9: cannot open shared object file')\n"
    )
    broken = pr.probe_python(DoctorConfig(serve_python=sys.executable), env)
    assert broken.torch_error.startswith("OSError: libcudnn.so.9")
    assert broken.python_version is not None


def test_python_missing_and_failing(tmp_path):
    missing = pr.probe_python(DoctorConfig(serve_python=str(tmp_path / "nope" / "python")), ENV)
    assert not missing.exists and missing.run is None and missing.missing == "no such file"
    # a folder or a file without the x bit was reported as "not found" too
    plain = tmp_path / "plain"
    plain.write_text("")
    why = {}
    for given in (tmp_path, plain, tmp_path / "nope"):
        p = pr.probe_python(DoctorConfig(serve_python=str(given)), ENV)
        observed = ck.run_checks(DoctorConfig(), pr.ProbeData(python=p),
                                 ck.select(["serve.python"]))[0].observed
        why[given] = (p.exists, observed)
    assert why[tmp_path] == (False, f"SM70_SERVE_PYTHON={tmp_path}: a directory, not an "
                                    "interpreter")
    assert why[plain] == (False, f"SM70_SERVE_PYTHON={plain}: not executable")
    assert why[tmp_path / "nope"][1].endswith(": no such file")
    bare = pr.probe_python(DoctorConfig(serve_python="no-such-python-sm70"), ENV)
    assert bare.missing == "not found on PATH"
    bad = script(tmp_path / "python", "echo 'broken interpreter' >&2; exit 3\n")
    probe = pr.probe_python(DoctorConfig(serve_python=str(bad)), ENV)
    assert probe.exists and probe.run.returncode == 3 and probe.python_version is None
    r = {x.id: x for x in ck.run_checks(DoctorConfig(), pr.ProbeData(python=probe))}
    assert (
        r["serve.python"].status == "fail"
        and "exit 3: broken interpreter" in r["serve.python"].observed
    )


def test_python_found_on_path_by_name():
    probe = pr.probe_python(
        DoctorConfig(serve_python="python3"), {"PATH": os.path.dirname(sys.executable)}
    )
    assert probe.exists and probe.path == os.path.join(os.path.dirname(sys.executable), "python3")


def test_python_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(pr, "PYTHON_TIMEOUT", 0.5)
    slow = script(tmp_path / "python", "sleep 5\n")
    probe = pr.probe_python(DoctorConfig(serve_python=str(slow)), ENV)
    assert probe.run.timed_out and probe.python_version is None


# --- NVML ------------------------------------------------------------------------------------
def _nvml_works() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_real_pynvml_without_driver():
    if _nvml_works():
        pytest.skip("this machine has an NVIDIA driver")
    probe = nvml.probe_nvml(DoctorConfig().gpus)
    assert not probe.available and probe.gpus == []
    assert probe.error_kind in ("library_not_found", "driver_not_loaded"), probe.error
    r = {x.id: x for x in ck.run_checks(DoctorConfig(), pr.ProbeData(nvml=probe))}
    for cid in ck.CHECK_IDS:
        if cid.startswith("gpu."):
            assert (r[cid].status, r[cid].observed) == ("fail", ck.NO_DRIVER)


@pytest.mark.gpu
def test_real_pynvml_with_gpus():
    if not _nvml_works():
        pytest.skip("no NVIDIA driver here")
    probe = nvml.probe_nvml(("0", "1"))
    assert probe.available and probe.driver_version and probe.gpus
    g = probe.gpus[0]
    assert g.name and g.uuid and g.cc_major is not None and g.memory_total_mib
    assert g.memory_total_bytes and g.memory_total_bytes // (1 << 20) == g.memory_total_mib
    if len(probe.gpus) > 1:
        assert len(probe.pairs) == 1 and probe.pairs[0].p2p_read is not None
    json.dumps(to_dict(probe))  # recordable


@pytest.mark.parametrize(
    "bus_id,norm",
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),
        ("0000:3b:00.0", "0000:3b:00.0"),
        ("3b:00.0", "0000:3b:00.0"),
        (None, None),
        ("weird", "weird"),
    ],
)
def test_normalize_bus_id(bus_id, norm):
    assert nvml.normalize_bus_id(bus_id) == norm


# --- files and limits ------------------------------------------------------------------------
def test_real_disk_nearest_parent(tmp_path):
    probe = pr.probe_disk("weights", str(tmp_path / "a" / "b" / "c"))
    assert probe.probed == str(tmp_path)
    usage = shutil.disk_usage(tmp_path)
    assert probe.total_bytes == usage.total
    assert abs(probe.free_bytes - usage.free) < 64 * 1024**2


def test_real_shm_and_limits():
    import resource

    shm = pr.probe_shm()
    assert shm.exists == os.path.isdir("/dev/shm")
    if shm.exists:
        assert shm.total_bytes == shutil.disk_usage("/dev/shm").total
    assert not pr.probe_shm(str(Path("/nonexistent-shm"))).exists
    lim = pr.probe_limits()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert lim.nofile_soft == (-1 if soft == resource.RLIM_INFINITY else soft)
    assert lim.nofile_hard == (-1 if hard == resource.RLIM_INFINITY else hard)


def test_collect_all_and_some(tmp_path):
    cfg = DoctorConfig(
        weights_dir=str(tmp_path / "w"), build_dir=str(tmp_path / "b"), serve_python=sys.executable
    )
    data = pr.collect(cfg, ENV)
    assert data.probed == list(pr.PROBE_NAMES) and set(data.seconds) == set(pr.PROBE_NAMES)
    for name in pr.PROBE_NAMES:
        assert getattr(data, name) is not None, name
    assert data.python.python_version is not None
    round_tripped = pr.load_probe_dict(json.loads(json.dumps(to_dict(data))))
    assert ck.run_checks(cfg, round_tripped) == ck.run_checks(cfg, data)
    some = pr.collect(cfg, ENV, only={"shm", "limits"})
    assert some.probed == ["shm", "limits"] and some.nvml is None and some.nvcc is None
