"""`sm70ctl doctor` end to end: the real CLI in a subprocess, on this machine and on
recorded probe data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sm70ctl.doctor import checks as ck
from sm70ctl.doctor import probes as pr

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "doctor"


def doctor(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    base["COLUMNS"] = "160"
    return subprocess.run(
        [sys.executable, "-m", "sm70ctl", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
        cwd=cwd or ROOT,
    )


def fixture(name: str) -> str:
    return str(DATA / f"{name}.json")


@pytest.mark.parametrize(
    "name,strict,code",
    [
        ("v100_nvlink", False, 0),
        ("v100_nvlink", True, 0),
        ("v100_pcie_no_p2p", False, 0),
        ("v100_pcie_no_p2p", True, 1),
        ("busy_gpu", False, 1),
        ("h200", False, 1),
        ("no_driver", False, 1),
    ],
)
def test_exit_codes_on_recorded_machines(name, strict, code):
    args = ["--probe-data", fixture(name), "--json"] + (["--strict"] if strict else [])
    proc = doctor(*args)
    assert proc.returncode == code, proc.stderr
    report = json.loads(proc.stdout)
    assert report["summary"]["exit_code"] == code
    assert report["summary"]["strict"] is strict


def test_json_schema():
    proc = doctor("--probe-data", fixture("busy_gpu"), "--json")
    report = json.loads(proc.stdout)
    assert list(report) == ["schema_version", "kind", "summary", "checks", "probes"]
    assert report["schema_version"] == pr.SCHEMA_VERSION and report["kind"] == "sm70ctl.doctor"
    assert set(report["summary"]) == {
        "status",
        "exit_code",
        "strict",
        "counts",
        "failing",
        "warnings",
    }
    assert report["summary"]["failing"] == ["gpu.memory"]
    assert [c["id"] for c in report["checks"]] == list(ck.CHECK_IDS)
    for c in report["checks"]:
        assert set(c) == {"id", "title", "status", "observed", "expected", "fix"}
        assert c["status"] in ck.STATUSES
    # The probe data inside the report is the recorded machine, unchanged.
    assert report["probes"] == json.loads(Path(fixture("busy_gpu")).read_text())


def test_table_output():
    proc = doctor("--probe-data", fixture("h200"), env={"COLUMNS": "400"})
    assert proc.returncode == 1
    out = proc.stdout
    assert "sm70ctl doctor" in out and "gpu.arch" in out
    assert "compute capability 9.0; this stack needs 7.0" in out
    assert re.search(r"^FAIL: 18 pass, 5 fail$", out, re.M), out
    assert "\x1b[" not in out  # no colour codes when not on a terminal


def test_unknown_check_is_a_usage_error_listing_ids():
    proc = doctor("--check", "gpu.nope", "--json")
    assert proc.returncode == 2
    # --json: the failure as a document on stdout (cli.main), the line on stderr
    assert json.loads(proc.stdout)["error"]["exit_code"] == 2
    assert "unknown --check gpu.nope" in json.loads(proc.stdout)["error"]["message"]
    assert "unknown --check gpu.nope" in proc.stderr
    for cid in ("gpu.memory", "cuda.sm70-probe", "limits.nofile"):
        assert cid in proc.stderr
    # an empty id is named visibly (it read "unknown --check " before)
    proc = doctor("--check", "", "--check", "gpu.nope")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown --check '', gpu.nope\n")


def test_check_selects_and_probes_only_what_it_needs():
    proc = doctor("--check", "disk.shm", "--check", "limits", "--json")
    report = json.loads(proc.stdout)
    assert [c["id"] for c in report["checks"]] == ["disk.shm", "limits.nofile"]
    assert report["probes"]["probed"] == ["shm", "limits"]
    assert report["probes"]["nvml"] is None and report["probes"]["nvcc"] is None
    assert sum(report["summary"]["counts"].values()) == 2


def test_record_then_replay(tmp_path):
    rec = tmp_path / "sub" / "probes.json"
    live = doctor("--json", "--record", str(rec))
    assert rec.exists() and not list(rec.parent.glob(".probes.json.*"))  # no temp file left
    recorded = json.loads(rec.read_text())
    assert recorded["schema_version"] == pr.SCHEMA_VERSION
    assert recorded == json.loads(live.stdout)["probes"]
    replay = doctor("--probe-data", str(rec), "--json")
    assert replay.returncode == live.returncode
    assert json.loads(replay.stdout)["checks"] == json.loads(live.stdout)["checks"]
    # A whole --json report is accepted as probe data too.
    report = tmp_path / "report.json"
    report.write_text(live.stdout)
    assert (
        json.loads(doctor("--probe-data", str(report), "--json").stdout)["checks"]
        == json.loads(live.stdout)["checks"]
    )


@pytest.mark.parametrize(
    "content,words",
    [("{not json", "not valid JSON"), ('{"nvml": 1}', "not doctor probe data"),
     (None, "No such file"), ("[" * 100_000 + "]" * 100_000, "levels deep"),
     ('{"schema_version": 1, "nvml": {"error": null, "driver_version": null, "gpus": 5}}',
      "not doctor probe data"), ("\x00\x01binary", "binary content")],
)
def test_bad_probe_data_is_a_usage_error(tmp_path, content, words):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    proc = doctor("--probe-data", str(path))
    assert proc.returncode == 2 and words in proc.stderr
    assert "Traceback" not in proc.stderr


def test_this_machine(tmp_path):
    """The doctor on this machine, for real: nvcc, gcc, pynvml, disk, the venv's Python."""
    env = {
        "SM70_WEIGHTS_DIR": str(tmp_path / "weights"),
        "SM70_BUILD_DIR": str(tmp_path / "build"),
        "SM70_SERVE_PYTHON": sys.executable,
        "SM70_GPUS": "0",
        "SM70_TENSOR_PARALLEL_SIZE": "1",
    }
    proc = doctor("--json", env=env)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    checks = {c["id"]: c for c in report["checks"]}
    probes = report["probes"]
    assert probes["config"]["gpus"] == ["0"]
    assert checks["settings.valid"]["status"] == "pass", checks["settings.valid"]
    assert probes["config"]["serve_python"] == sys.executable
    assert probes["disks"][0]["probed"] == str(tmp_path)
    # The venv's Python really ran: version known, no torch in it.
    assert probes["python"]["python_version"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert checks["serve.torch"]["status"] == "fail"
    assert checks["serve.torch-sm70"]["status"] == "skip"
    nvcc = probes["nvcc"]
    if nvcc["version"] and int(nvcc["version"].split(".")[0]) >= 13:
        assert checks["cuda.sm70-probe"]["status"] == "fail"
        assert "Unsupported gpu architecture 'sm_70'" in checks["cuda.sm70-probe"]["observed"]
    if not probes["nvml"]["available"]:
        assert checks["gpu.memory"]["observed"] == "NVML not available (no NVIDIA driver)"
        assert proc.returncode == 1


def test_env_file(tmp_path):
    env_file = tmp_path / "sm70.env"
    env_file.write_text("SM70_GPUS=2,3\nSM70_GPU_BUSY_MIB=1GiB\n")
    proc = doctor("--check", "disk.shm", "--env-file", str(env_file), "--json")
    config = json.loads(proc.stdout)["probes"]["config"]
    assert config["gpus"] == ["2", "3"] and config["gpu_busy_bytes"] == 1024**3
    # The environment wins over the file.
    proc = doctor(
        "--check", "disk.shm", "--env-file", str(env_file), "--json", env={"SM70_GPUS": "0,1"}
    )
    assert json.loads(proc.stdout)["probes"]["config"]["gpus"] == ["0", "1"]


def test_bad_setting_is_a_failing_check_and_the_rest_still_runs():
    proc = doctor(
        "--json", "--check", "settings", "--check", "disk.shm", env={"SM70_GPU_BUSY_MIB": "lots"}
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["settings.valid"]["status"] == "fail"
    assert "SM70_GPU_BUSY_MIB='lots'" in checks["settings.valid"]["observed"]
    assert checks["disk.shm"]["status"] in ("pass", "warn", "fail")
    assert report["probes"]["settings"]["source"] == "fallback"
    assert report["probes"]["config"]["gpu_busy_bytes"] == 500 * 1024**2  # the default


def test_doctor_config_from_real_settings(tmp_path):
    try:
        from sm70ctl.settings import load_settings
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("settings module not importable here")
    from sm70ctl.doctor.config import DoctorConfig

    s = load_settings(
        environ={
            "SM70_GPUS": "GPU-5d1e0a3c,1",
            "SM70_GPU_BUSY_MIB": "1GiB",
            "SM70_WEIGHTS_DIR": str(tmp_path / "w"),
            "SM70_BUILD_DIR": str(tmp_path / "b"),
            "SM70_SERVE_PYTHON": "/opt/serve/bin/python",
            "SM70_CUDA_HOME": "/usr/local/cuda-12.8",
            "SM70_HOST_CC": "gcc-13",
        }
    )
    cfg = DoctorConfig.from_settings(s)
    assert cfg == DoctorConfig(
        gpus=("GPU-5d1e0a3c", "1"),
        gpu_busy_bytes=1024**3,
        weights_dir=str(tmp_path / "w"),
        build_dir=str(tmp_path / "b"),
        serve_python="/opt/serve/bin/python",
        cuda_home="/usr/local/cuda-12.8",
        host_cc="gcc-13",
    )
    default = DoctorConfig.from_settings(load_settings(environ={}))
    assert default.gpus == ("0", "1") and default.gpu_busy_mib == 500
    assert default.cuda_home is None and default.host_cc is None


def test_fallback_config_without_settings_module():
    from sm70ctl.doctor.config import DoctorConfig
    from sm70ctl.errors import UsageError

    cfg = DoctorConfig.from_environ({"SM70_GPUS": "2, 3", "SM70_GPU_BUSY_MIB": "750"})
    assert cfg.gpus == ("2", "3") and cfg.gpu_busy_mib == 750
    assert DoctorConfig.from_environ({}) == DoctorConfig()
    with pytest.raises(UsageError, match="SM70_GPU_BUSY_MIB"):
        DoctorConfig.from_environ({"SM70_GPU_BUSY_MIB": "5 parsecs"})


def test_cli_import_stays_light():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import sm70ctl.cli"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    imported = {
        line.split("|")[-1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if "|" in line
    }
    assert "sm70ctl" in imported
    assert not imported & {"torch", "vllm", "huggingface_hub", "pynvml"}


def test_docs_list_every_check():
    text = (ROOT / "docs" / "doctor.md").read_text()
    for cid in ck.CHECK_IDS:
        assert f"`{cid}`" in text, cid
    assert f"schema_version` is {pr.SCHEMA_VERSION}" in text


def test_runs_without_the_settings_module_dependencies():
    # As on a machine where pydantic is not installed: the import of the
    # settings module really fails, and the doctor falls back to reading the variables.
    # The doctor's own command is mounted alone: sm70ctl.cli also wires `env`, which
    # needs the settings module at start-up.
    code = (
        "import sys; sys.modules['pydantic'] = None\n"
        "import typer\n"
        "from sm70ctl.doctor import command\n"
        "app = typer.Typer()\n"
        "command.register(app)\n"
        "app(args=['--json', '--check', 'settings', '--check', 'disk.shm'])\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, "SM70_GPUS": "1,2"},
        cwd=ROOT,
    )
    report = json.loads(proc.stdout)
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["settings.valid"]["status"] == "warn"
    assert "pydantic" in checks["settings.valid"]["observed"]
    assert report["probes"]["settings"]["source"] == "fallback"
    assert report["probes"]["config"]["gpus"] == ["1", "2"]
    assert proc.returncode == 0, proc.stderr
