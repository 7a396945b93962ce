"""Verdicts of `sm70ctl doctor` on recorded probe data (tests/data/doctor/*.json).

Every check is a pure function of (DoctorConfig, ProbeData), so these tests need no GPU,
no nvcc and no serving environment: they load a recorded machine, change one observation
and assert the verdict.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

from sm70ctl.devices import nvml
from sm70ctl.doctor import checks as ck
from sm70ctl.doctor import probes as pr
from sm70ctl.doctor.config import GB, MIB, DoctorConfig
from sm70ctl.doctor.records import RecordError, from_dict, to_dict

DATA = Path(__file__).parent / "data" / "doctor"
FIXTURES = sorted(p.stem for p in DATA.glob("*.json"))


def load(name: str) -> pr.ProbeData:
    return pr.load_probe_dict(json.loads((DATA / f"{name}.json").read_text()))


def verdicts(data: pr.ProbeData, config: DoctorConfig | None = None) -> dict[str, ck.CheckResult]:
    return {r.id: r for r in ck.run_checks(config or data.config, data)}


def status(data: pr.ProbeData, check_id: str, config: DoctorConfig | None = None) -> str:
    return verdicts(data, config)[check_id].status


# --- whole recorded machines -----------------------------------------------------------------
# The checks that do not pass on each recorded machine; everything else must pass.
EXPECTED_NOT_PASSING = {
    "v100_nvlink": {},
    "v100_pcie_no_p2p": {"gpu.interconnect": "warn"},
    "v100_pcie_p2p": {},
    "mixed_4gpu": {},
    "busy_gpu": {"gpu.memory": "fail"},
    "cuda13": {"cuda.nvcc": "fail", "cuda.sm70-probe": "fail"},
    "gcc15": {"host.gcc": "warn", "cuda.sm70-probe": "fail"},
    "torch_no_sm70": {"serve.torch-sm70": "fail"},
    "h200": {
        "cuda.nvcc": "fail",
        "cuda.sm70-probe": "fail",
        "serve.torch-sm70": "fail",
        "serve.torch-cuda": "fail",
        "gpu.arch": "fail",
    },
    "no_driver": {
        **{c: "fail" for c in ck.CHECK_IDS if c.startswith(("gpu.", "driver."))},
        "serve.python": "fail",
        "serve.torch": "skip",
        "serve.torch-sm70": "skip",
        "serve.torch-cuda": "skip",
    },
}


def test_every_fixture_has_expectations():
    assert set(FIXTURES) == set(EXPECTED_NOT_PASSING)


@pytest.mark.parametrize("name", FIXTURES)
def test_recorded_machine_verdicts(name):
    results = verdicts(load(name))
    assert list(results) == list(ck.CHECK_IDS)
    got = {i: r.status for i, r in results.items() if r.status != "pass"}
    assert got == EXPECTED_NOT_PASSING[name]
    for r in results.values():
        assert r.observed and r.expected
        # A fix line exactly when there is something to fix.
        assert bool(r.fix) == (r.status in ("warn", "fail")), r
        assert "\n" not in r.fix and "\n" not in r.observed


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_round_trips(name):
    raw = json.loads((DATA / f"{name}.json").read_text())
    assert json.loads(json.dumps(to_dict(load(name)))) == raw


def test_no_driver_message_is_the_plain_line():
    results = verdicts(load("no_driver"))
    for cid in ck.CHECK_IDS:
        if cid.startswith("gpu."):
            assert results[cid].observed == "NVML not available (no NVIDIA driver)"
    # ... and the other checks still ran.
    assert results["cuda.nvcc"].status == "pass"
    assert results["disk.weights"].status == "pass"


def test_h200_names_its_compute_capability():
    obs = verdicts(load("h200"))["gpu.arch"].observed
    assert "compute capability 9.0; this stack needs 7.0" in obs
    assert obs.count("GPU") == 2


def test_busy_gpu_names_the_processes():
    r = verdicts(load("busy_gpu"))["gpu.memory"]
    assert "GPU1: 12034 MiB used >= 500 MiB" in r.observed
    assert "pid 4242 (python3, 11890 MiB)" in r.observed
    assert "GPU0: 0 MiB used" in r.observed
    assert "4242" in r.fix


def test_cuda13_reports_nvcc_failure_and_reason():
    r = verdicts(load("cuda13"))
    assert "cannot emit sm_70" in r["cuda.nvcc"].observed
    assert "Unsupported gpu architecture 'sm_70'" in r["cuda.sm70-probe"].observed


def test_gcc15_suggests_the_installed_older_gcc():
    r = verdicts(load("gcc15"))
    assert "SM70_HOST_CC=gcc-13" in r["host.gcc"].fix
    assert "gcc versions later than 14 are not supported" in r["cuda.sm70-probe"].observed
    assert "SM70_HOST_CC" in r["cuda.sm70-probe"].fix


# --- driver ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "version,expected",
    [
        ("580.95.05", "pass"),
        ("570.86.10", "pass"),
        ("565.57.01", "fail"),
        ("535.104", "fail"),
        (None, "fail"),
        ("garbage", "fail"),
        ("600.1", "pass"),
    ],
)
def test_driver_version(version, expected):
    data = load("v100_nvlink")
    data.nvml.driver_version = version
    assert status(data, "driver.version") == expected


def test_driver_cuda_version_shown():
    data = load("v100_nvlink")
    data.nvml.cuda_driver_version = 12080
    assert "CUDA up to 12.8" in verdicts(data)["driver.version"].observed


@pytest.mark.parametrize(
    "kind,text",
    [
        ("library_not_found", "NVML not available (no NVIDIA driver)"),
        ("driver_not_loaded", "NVML not available (no NVIDIA driver)"),
        ("no_permission", "NVML not available: Insufficient Permissions"),
        ("binding_missing", "NVML not available: Insufficient Permissions"),
    ],
)
def test_nvml_unavailable_kinds(kind, text):
    data = load("no_driver")
    data.nvml.error, data.nvml.error_kind = "Insufficient Permissions", kind
    r = verdicts(data)
    assert r["driver.nvml"].status == "fail"
    assert r["driver.nvml"].observed == text
    assert r["gpu.memory"].observed == text


# --- CUDA toolkit ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "version,expected",
    [
        ("12.8", "pass"),
        ("12.9", "warn"),
        ("12.6", "warn"),
        ("12.4", "warn"),
        ("11.8", "fail"),
        ("13.0", "fail"),
        ("13.1", "fail"),
        ("14.0", "fail"),
        (None, "fail"),
    ],
)
def test_nvcc_versions(version, expected):
    data = load("v100_nvlink")
    data.nvcc.version = version
    assert status(data, "cuda.nvcc") == expected


def test_nvcc_none_found():
    data = load("v100_nvlink")
    data.nvcc = pr.NvccProbe(candidates=[pr.NvccCandidate("PATH", None, False)])
    r = verdicts(data)
    assert r["cuda.nvcc"].status == "fail" and "no nvcc" in r["cuda.nvcc"].observed
    assert r["cuda.sm70-probe"].status == "skip"


def test_nvcc_setting_points_nowhere():
    data = load("v100_nvlink")
    bad = pr.NvccCandidate("SM70_CUDA_HOME", "/opt/nope/bin/nvcc", False)
    data.nvcc = pr.NvccProbe(candidates=[bad], chosen=bad)
    r = verdicts(data)["cuda.nvcc"]
    assert r.status == "fail" and "SM70_CUDA_HOME points at /opt/nope/bin/nvcc" in r.observed


def test_nvcc_version_unreadable():
    data = load("v100_nvlink")
    data.nvcc.version = None
    data.nvcc.version_run = pr.CommandRun(
        argv=["nvcc"], returncode=127, stderr="libfoo.so: missing"
    )
    assert "libfoo.so: missing" in verdicts(data)["cuda.nvcc"].observed


@pytest.mark.parametrize(
    "run,arch,expected,words",
    [
        (pr.CommandRun(returncode=0, seconds=0.6), 70, "pass", "compiled for sm_70"),
        (pr.CommandRun(returncode=0, seconds=0.6), None, "pass", "compiled for sm_70"),
        (pr.CommandRun(returncode=0), 75, "fail", "cubin is for sm_75"),
        (pr.CommandRun(timed_out=True, seconds=15.0, error="timed out"), None, "fail", "timed out"),
        (pr.CommandRun(error="PermissionError: denied"), None, "fail", "could not start"),
        (
            pr.CommandRun(returncode=2, stderr="x\nerror: boom\n"),
            None,
            "fail",
            "exit 2: error: boom",
        ),
    ],
)
def test_sm70_probe(run, arch, expected, words):
    data = load("v100_nvlink")
    data.nvcc.compile_run, data.nvcc.compile_output_arch = run, arch
    r = verdicts(data)["cuda.sm70-probe"]
    assert r.status == expected and words in r.observed


def test_compile_error_is_shortened():
    long = "error: " + "x" * 500
    assert len(ck.compile_error(long)) == 160


# --- host compiler ---------------------------------------------------------------------------
def cc(name, version, kind="gcc", path="/usr/bin/x"):
    return pr.CompilerInfo(
        name=name, path=path, kind=kind, version=version, run=pr.CommandRun(returncode=0)
    )


@pytest.mark.parametrize(
    "version,ok",
    [
        ("11.3.0", False),
        ("11.4.0", True),
        ("11.5", True),
        ("12.2.0", True),
        ("13.3.0", True),
        ("14.2.0", True),
        ("14", True),
        ("15.1.0", False),
        ("10.5.0", False),
        (None, False),
    ],
)
def test_gcc_range(version, ok):
    assert ck.gcc_supported(version) is ok
    data = load("v100_nvlink")
    data.host_cc = pr.HostCcProbe(default=cc("gcc", version), versioned=[])
    assert status(data, "host.gcc") == ("pass" if ok else "fail")


def test_host_cc_setting_wins():
    data = load("v100_nvlink")
    data.host_cc = pr.HostCcProbe(
        configured=cc("gcc-15", "15.2.0"),
        default=cc("gcc", "12.2.0"),
        versioned=[cc("gcc-13", "13.3.0")],
    )
    r = verdicts(data)["host.gcc"]
    assert r.status == "fail" and "SM70_HOST_CC=gcc-15: gcc 15.2.0" in r.observed
    assert "SM70_HOST_CC=gcc-13" in r.fix
    data.host_cc.configured = cc("gcc-13", "13.3.0")
    assert verdicts(data)["host.gcc"].status == "pass"


def test_host_cc_setting_missing_or_clang():
    data = load("v100_nvlink")
    data.host_cc = pr.HostCcProbe(
        configured=pr.CompilerInfo(name="gcc-9"), default=cc("gcc", "12.2.0")
    )
    assert "not found" in verdicts(data)["host.gcc"].observed
    data.host_cc.configured = cc("clang", "18.1.8", kind="clang")
    r = verdicts(data)["host.gcc"]
    assert r.status == "fail" and "clang 18.1.8" in r.observed


def test_no_gcc_at_all():
    data = load("v100_nvlink")
    data.host_cc = pr.HostCcProbe(default=pr.CompilerInfo(name="gcc"))
    r = verdicts(data)["host.gcc"]
    assert r.status == "fail" and "apt install gcc-12" in r.fix
    data.host_cc.versioned = [cc("gcc-12", "12.3.0")]
    assert status(data, "host.gcc") == "warn"


def test_default_gcc_too_new_without_alternative_fails():
    data = load("gcc15")
    data.host_cc.versioned = [v for v in data.host_cc.versioned if v.name == "gcc-15"]
    r = verdicts(data)["host.gcc"]
    assert r.status == "fail" and "11.4 to 14" in r.observed


# --- serving Python and torch ----------------------------------------------------------------
@pytest.mark.parametrize(
    "version,expected",
    [("3.12.3", "pass"), ("3.12.0", "pass"), ("3.11.9", "warn"), ("3.13.1", "warn")],
)
def test_python_versions(version, expected):
    data = load("v100_nvlink")
    data.python.python_version = version
    assert status(data, "serve.python") == expected


def test_python_broken_interpreter():
    data = load("v100_nvlink")
    data.python.python_version = None
    data.python.run = pr.CommandRun(returncode=1, stderr="Fatal Python error: init_fs_encoding\n")
    r = verdicts(data)
    assert r["serve.python"].status == "fail" and "init_fs_encoding" in r["serve.python"].observed
    assert {r[c].status for c in ("serve.torch", "serve.torch-sm70", "serve.torch-cuda")} == {
        "skip"
    }
    data.python.run = pr.CommandRun(timed_out=True, error="timed out after 60 s")
    assert "timed out" in verdicts(data)["serve.python"].observed


def test_torch_missing_or_broken():
    data = load("v100_nvlink")
    data.python.torch_installed = False
    r = verdicts(data)
    assert r["serve.torch"].status == "fail" and r["serve.torch-sm70"].status == "skip"
    data.python.torch_installed, data.python.torch_error = (
        True,
        "OSError: libcudnn.so.9: cannot open",
    )
    r = verdicts(data)
    assert r["serve.torch"].status == "fail" and "libcudnn" in r["serve.torch"].observed


@pytest.mark.parametrize(
    "cuda,archs,sm70,cuda_status",
    [
        ("12.8", ["sm_70", "sm_80"], "pass", "pass"),
        ("12.6", ["sm_50", "sm_70"], "pass", "pass"),
        ("12.8", ["sm_75", "sm_80"], "fail", "pass"),
        (None, [], "fail", "fail"),
        ("13.0", ["sm_75"], "fail", "fail"),
        ("12.8", ["compute_70"], "fail", "pass"),
    ],
)
def test_torch_arch_and_cuda(cuda, archs, sm70, cuda_status):
    data = load("v100_nvlink")
    data.python.torch_cuda, data.python.torch_arch_list = cuda, archs
    r = verdicts(data)
    assert r["serve.torch-sm70"].status == sm70
    assert r["serve.torch-cuda"].status == cuda_status


# --- GPUs ------------------------------------------------------------------------------------
def with_gpus(data: pr.ProbeData, gpus: tuple[str, ...]) -> DoctorConfig:
    return replace(data.config, gpus=gpus)


def test_gpu_count_and_resolution():
    data = load("v100_nvlink")
    uuid1 = data.nvml.gpus[1].uuid
    assert status(data, "gpu.count", with_gpus(data, ("0", "1"))) == "pass"
    assert status(data, "gpu.count", with_gpus(data, (uuid1, "0"))) == "pass"
    assert status(data, "gpu.count", with_gpus(data, (uuid1[:12],))) == "pass"  # a unique prefix
    r = verdicts(data, with_gpus(data, ("0", "1", "2")))["gpu.count"]
    assert r.status == "fail" and "not found: 2" in r.observed
    assert status(data, "gpu.count", with_gpus(data, ("GPU-deadbeef",))) == "fail"
    assert status(data, "gpu.count", with_gpus(data, ())) == "fail"


def test_gpu_checks_only_look_at_configured_gpus():
    data = load("busy_gpu")  # GPU1 is busy
    assert status(data, "gpu.memory", with_gpus(data, ("0",))) == "pass"
    assert status(data, "gpu.memory", with_gpus(data, ("1",))) == "fail"
    r = verdicts(data, with_gpus(data, ("5",)))
    assert r["gpu.memory"].status == "skip" and r["gpu.count"].status == "fail"


def test_gpu_16gb_fails():
    data = load("v100_nvlink")
    data.nvml.gpus[0].name, data.nvml.gpus[0].memory_total_mib = "Tesla V100-SXM2-16GB", 16160
    r = verdicts(data)["gpu.arch"]
    assert (
        r.status == "fail" and "GPU0: Tesla V100-SXM2-16GB" in r.observed and "32 GB" in r.observed
    )


@pytest.mark.parametrize(
    "used,expected", [(0, "pass"), (499, "pass"), (500, "fail"), (31000, "fail"), (None, "warn")]
)
def test_gpu_busy_threshold(used, expected):
    data = load("v100_nvlink")
    data.nvml.gpus[0].memory_used_mib = used
    assert status(data, "gpu.memory") == expected


def test_gpu_busy_threshold_from_config_and_hidden_processes():
    data = load("v100_nvlink")
    data.nvml.gpus[0].memory_used_mib = 800
    assert status(data, "gpu.memory", replace(data.config, gpu_busy_bytes=1024 * MIB)) == "pass"
    r = verdicts(data)["gpu.memory"]
    assert r.status == "fail" and "no process visible" in r.observed


@pytest.mark.parametrize("mode,expected", [(True, "pass"), (False, "warn"), (None, "pass")])
def test_persistence(mode, expected):
    data = load("v100_nvlink")
    data.nvml.gpus[1].persistence_mode = mode
    assert status(data, "gpu.persistence") == expected


@pytest.mark.parametrize(
    "enabled,pending,vol,agg,expected",
    [
        (True, True, 0, 0, "pass"),
        (True, True, 1, 1, "fail"),
        (True, True, 0, 3, "warn"),
        (False, False, 0, 0, "warn"),
        (False, True, 0, 0, "warn"),
        (None, None, None, None, "pass"),
    ],
)
def test_ecc(enabled, pending, vol, agg, expected):
    data = load("v100_nvlink")
    g = data.nvml.gpus[0]
    g.ecc_enabled, g.ecc_pending, g.ecc_uncorrected_volatile, g.ecc_uncorrected_aggregate = (
        enabled,
        pending,
        vol,
        agg,
    )
    assert status(data, "gpu.ecc") == expected


@pytest.mark.parametrize(
    "mask,expected",
    [
        (0x0, "pass"),
        (0x1, "pass"),
        (0x4, "pass"),
        (0x8, "warn"),
        (0x20, "warn"),
        (0x40, "warn"),
        (0x80, "warn"),
        (0x5, "pass"),
        (0x1000, "pass"),
        (None, "pass"),
    ],
)
def test_throttle(mask, expected):
    data = load("v100_nvlink")
    data.nvml.gpus[0].clocks_event_reasons = mask
    assert status(data, "gpu.throttle") == expected


def test_clock_event_names():
    assert ck.clock_event_names(0x41) == ["gpu_idle", "hw_thermal_slowdown"]
    assert ck.clock_event_names(0x1000) == ["0x1000"]


@pytest.mark.parametrize(
    "gen,gen_max,width,width_max,expected",
    [
        (3, 3, 16, 16, "pass"),
        (1, 3, 16, 16, "pass"),
        (3, 3, 8, 16, "warn"),
        (2, 2, 16, 16, "warn"),
        (None, None, None, None, "pass"),
        (5, 5, 16, 16, "pass"),
    ],
)
def test_pcie(gen, gen_max, width, width_max, expected):
    data = load("v100_nvlink")
    g = data.nvml.gpus[1]
    g.pcie_gen_current, g.pcie_gen_max, g.pcie_width_current, g.pcie_width_max = (
        gen,
        gen_max,
        width,
        width_max,
    )
    assert status(data, "gpu.pcie") == expected


@pytest.mark.parametrize(
    "links,read,nvl,expected,words",
    [
        (2, "ok", "ok", "pass", "2 active NVLink link(s); all-reduce in fp16"),
        (0, "ok", "ok", "pass", "NVLink P2P (through a switch)"),
        (
            0,
            "ok",
            "not_supported",
            "pass",
            "PCIe with P2P, no NVLink; all-reduce with the 12-bit exchange",
        ),
        (0, "chipset_not_supported", "not_supported", "warn", "NCCL_P2P_DISABLE=1"),
        (None, None, None, "warn", "PCIe without P2P (unknown)"),
    ],
)
def test_interconnect(links, read, nvl, expected, words):
    data = load("v100_nvlink")
    data.nvml.pairs = [nvml.PairProbe(a=0, b=1, nvlink_active=links, p2p_read=read, p2p_nvlink=nvl)]
    r = verdicts(data)["gpu.interconnect"]
    assert r.status == expected and words in r.observed


def test_interconnect_single_gpu_and_unprobed_pair():
    data = load("v100_nvlink")
    assert status(data, "gpu.interconnect", with_gpus(data, ("1",))) == "skip"
    data.nvml.pairs = []
    assert status(data, "gpu.interconnect") == "warn"
    # The pair is the first two configured GPUs, in either order.
    data = load("v100_nvlink")
    assert status(data, "gpu.interconnect", with_gpus(data, ("1", "0"))) == "pass"


@pytest.mark.parametrize("mig,expected", [(None, "pass"), (False, "pass"), (True, "fail")])
def test_mig(mig, expected):
    data = load("v100_nvlink")
    data.nvml.gpus[0].mig_enabled = mig
    r = verdicts(data)["gpu.mig"]
    assert r.status == expected
    if mig:
        assert "nvidia-smi -i 0 -mig 0" in r.fix


# --- disk and limits -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "role,check_id,free,expected",
    [
        ("weights", "disk.weights", 35 * GB, "pass"),
        ("weights", "disk.weights", 35 * GB - 1, "fail"),
        ("build", "disk.build", 2 * GB, "pass"),
        ("build", "disk.build", 2 * GB - 1, "fail"),
    ],
)
def test_disk_thresholds(role, check_id, free, expected):
    data = load("v100_nvlink")
    next(d for d in data.disks if d.role == role).free_bytes = free
    assert status(data, check_id) == expected


def test_disk_error_and_parent_note():
    data = load("v100_nvlink")
    data.disks[0] = pr.DiskProbe("weights", "/x", error="PermissionError: denied")
    assert "denied" in verdicts(data)["disk.weights"].observed
    data.disks[1].probed = "/home"
    assert "nearest existing parent" in verdicts(data)["disk.build"].observed


@pytest.mark.parametrize(
    "free,exists,expected",
    [
        (64 * 1024**3, True, "pass"),
        (4 * 1024**3, True, "pass"),
        (2 * 1024**3, True, "warn"),
        (64 * MIB, True, "fail"),
        (None, False, "fail"),
    ],
)
def test_shm(free, exists, expected):
    data = load("v100_nvlink")
    data.shm = pr.ShmProbe("/dev/shm", exists, free, free)
    assert status(data, "disk.shm") == expected


@pytest.mark.parametrize(
    "soft,hard,expected",
    [
        (1024, 1048576, "pass"),
        (65536, 65536, "pass"),
        (1024, 4096, "warn"),
        (-1, -1, "pass"),
        (None, None, "skip"),
    ],
)
def test_nofile(soft, hard, expected):
    data = load("v100_nvlink")
    data.limits = pr.LimitsProbe(soft, hard)
    assert status(data, "limits.nofile") == expected


# --- selection, summary, records -------------------------------------------------------------
def test_not_probed_checks_skip():
    data = load("v100_nvlink")
    data.nvml = data.nvcc = data.host_cc = data.python = None
    data.disks = data.shm = data.limits = data.settings = None
    assert {r.status for r in ck.run_checks(data.config, data)} == {"skip"}


def test_select_ids_groups_and_unknown():
    assert [c.id for c in ck.select(["gpu.memory"])] == ["gpu.memory"]
    assert [c.id for c in ck.select(["disk", "cuda.nvcc"])] == [
        "cuda.nvcc",
        "disk.weights",
        "disk.build",
        "disk.shm",
    ]
    assert len(ck.select(None)) == len(ck.CHECK_IDS) == len(set(ck.CHECK_IDS))
    with pytest.raises(ValueError, match=r"gpu\.nope, foo"):
        ck.select(["gpu.nope", "foo", "gpu"])
    assert ck.probes_needed(ck.select(["gpu.memory", "disk.shm"])) == {"nvml", "shm"}
    assert ck.probes_needed(ck.select(None)) == {*pr.PROBE_NAMES, "settings"}


def test_summary_and_strict():
    data = load("v100_pcie_no_p2p")
    results = ck.run_checks(data.config, data)
    s = ck.summarize(results)
    assert (s["status"], s["exit_code"], s["warnings"], s["failing"]) == (
        "warn",
        0,
        ["gpu.interconnect"],
        [],
    )
    s = ck.summarize(results, strict=True)
    assert (s["status"], s["exit_code"], s["failing"]) == ("fail", 1, ["gpu.interconnect"])
    s = ck.summarize(ck.run_checks(data.config, load("v100_nvlink")), strict=True)
    assert (s["status"], s["exit_code"]) == ("pass", 0)
    assert sum(s["counts"].values()) == len(ck.CHECK_IDS)


def test_records_forgiving_and_strict_about_types():
    raw = json.loads((DATA / "v100_nvlink.json").read_text())
    newer = copy.deepcopy(raw)
    newer["from_the_future"] = 1
    newer["nvml"]["gpus"][0]["new_field"] = "x"
    del newer["nvml"]["gpus"][0]["ecc_pending"]
    data = pr.load_probe_dict(newer)
    assert (
        data.nvml.gpus[0].ecc_pending is None and data.nvml.gpus[0].name == "Tesla V100-SXM2-32GB"
    )
    assert isinstance(data.config.gpus, tuple)
    bad = copy.deepcopy(raw)
    bad["nvml"]["gpus"] = "nope"
    with pytest.raises(RecordError, match=r"nvml\.gpus: expected a list"):
        pr.load_probe_dict(bad)
    bad = copy.deepcopy(raw)
    bad["nvml"]["gpus"][0]["memory_used_mib"] = "lots"
    with pytest.raises(RecordError, match=r"memory_used_mib: expected int"):
        pr.load_probe_dict(bad)
    with pytest.raises(RecordError, match="schema_version"):
        pr.load_probe_dict({**raw, "schema_version": 99})
    with pytest.raises(RecordError):
        pr.load_probe_dict([1, 2])


def test_config_round_trip():
    cfg = DoctorConfig(
        gpus=("GPU-1", "3"), gpu_busy_bytes=1 << 30, cuda_home="/c", host_cc="gcc-12"
    )
    assert from_dict(DoctorConfig, json.loads(json.dumps(to_dict(cfg)))) == cfg
    assert cfg.gpu_busy_mib == 1024


@pytest.mark.parametrize(
    "probe,expected,words",
    [
        (pr.SettingsProbe(), "pass", "loaded"),
        (pr.SettingsProbe(source="fallback", error="No module named 'pydantic_settings'"), "warn",
         "settings module unavailable (No module named 'pydantic_settings')"),
        (pr.SettingsProbe(source="fallback", problems=["SM70_GPUS='x': bad", "SM70_PORT='0': low"]),
         "fail", "2 problems: SM70_GPUS='x': bad; SM70_PORT='0': low"),
    ],
)  # fmt: skip
def test_settings_check(probe, expected, words):
    data = load("v100_nvlink")
    data.settings = probe
    r = verdicts(data)["settings.valid"]
    assert r.status == expected and words in r.observed
