"""The vLLM plugin: discoverable through its entry point once the project is installed,
`register()` idempotent and import-light; and, where the CPU serving environment exists,
called by vLLM's own plugin loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from fresh_import import loaded_by_import

ROOT = Path(__file__).resolve().parent.parent
SERVE_PY = ROOT / ".serve-venv" / "bin" / "python"

PROBE = r"""
import json, sys
from importlib.metadata import entry_points
eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "sm70"]
register = eps[0].load()
heavy_after_load = sorted(m for m in ("torch", "vllm") if m in sys.modules)
first = register()
second = register()
import vllm_patch.plugin as plugin
print(json.dumps({
    "value": eps[0].value,
    "dist": eps[0].dist.name if eps[0].dist else None,
    "heavy_after_load": heavy_after_load,
    "first_calls": first["calls"], "second_calls": second["calls"],
    "custom_ops": first["custom_ops"], "attention": first["attention_backend"],
    "quantization": first["quantization"],
    "same_config": first["config"] == second["config"],
    "mem_util_default": first["config"].to_dict() is not None,
    "file": plugin.__file__,
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("sm70ctl-*.whl")
    return whl


def test_wheel_ships_the_lock_and_the_patch_series(wheel: Path) -> None:
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert "sm70ctl/data/sm70.lock.toml" in names
    assert "vllm_patch/patches/SERIES.md" in names
    series = {p.name for p in (ROOT / "vllm_patch" / "patches").glob("*.patch")}
    assert series and {f"vllm_patch/patches/{n}" for n in series} <= names
    assert "sm70ctl/build/compile_kernels.py" in names


def test_entry_point_in_a_fresh_venv_and_register_is_idempotent(wheel: Path,
                                                                tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    run = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={"PATH": os.environ.get("PATH", "")})
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["value"] == "vllm_patch.plugin:register"
    assert data["dist"] == "sm70ctl"
    assert data["file"].startswith(str(env_dir))  # the installed copy, not the source tree
    assert data["heavy_after_load"] == []  # loading the entry point imports no torch/vLLM
    assert (data["first_calls"], data["second_calls"]) == (1, 2)
    assert data["same_config"]
    assert data["custom_ops"].startswith("absent")  # no kernels built in this venv
    # the backend class is in the source; this venv has no vLLM to register it with
    assert data["attention"].startswith("skipped")
    assert data["quantization"] == "absent (vLLM not installed)"


def test_register_reads_the_plugin_config_from_the_environment(monkeypatch) -> None:
    from vllm_patch import plugin
    from vllm_patch.config import ENV_VAR, PluginConfig

    # Not the defaults: a plugin that ignored the variable would report PluginConfig().
    cfg = PluginConfig.from_dict(
        {"gemm": {"int8_gemv": False, "gemv_max_rows": 4}, "attention": {"decode_max_splits": 32}}
    )
    assert cfg != PluginConfig()
    monkeypatch.setenv(ENV_VAR, cfg.to_json())
    monkeypatch.setattr(plugin, "_state", {})
    report = plugin.register()
    assert report["config"] == cfg
    assert report["config"].gemm.gemv_max_rows == 4
    assert report["config"].attention.decode_max_splits == 32
    assert report["quantization"] == "off (gemm.int8_gemv is false)"  # the setting acted
    assert plugin.register()["calls"] == 2
    assert plugin.registered()["calls"] == 2


def test_register_without_vllm_reports_quantization_absent(monkeypatch) -> None:
    import importlib.util

    from vllm_patch import plugin
    from vllm_patch.config import ENV_VAR

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(plugin, "_state", {})
    assert plugin.register()["quantization"] == "absent (vLLM not installed)"


def test_loading_the_cli_imports_no_vllm_or_torch() -> None:
    assert loaded_by_import("sm70ctl.cli, sm70ctl.build.command",
                            ("torch", "vllm", "vllm_patch.plugin")) == []


def _serve_env_has_vllm() -> bool:
    if not SERVE_PY.exists():
        return False
    res = subprocess.run([str(SERVE_PY), "-c", "import vllm.plugins"], capture_output=True,
                         timeout=300)
    return res.returncode == 0


@pytest.mark.slow
def test_vllm_plugin_loader_calls_register(wheel: Path, tmp_path: Path) -> None:
    """vLLM's own loader (vllm.plugins.load_general_plugins) finds and calls register().

    The plugin is installed into a private --target folder put on PYTHONPATH, so the
    shared serving environment is not modified."""
    if not _serve_env_has_vllm():
        msg = "no .serve-venv with vLLM (made by .ci/setup.d/20-serve-env.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    target = tmp_path / "site"
    res = subprocess.run([str(SERVE_PY), "-m", "pip", "install", "-q", "--no-deps",
                          "--no-index", "--target", str(target), str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    code = (
        "import json, vllm.plugins as p; p.load_general_plugins(); p.load_general_plugins();"
        "import vllm_patch.plugin as v; r = v.registered();"
        "print(json.dumps({'calls': r.get('calls'), 'file': v.__file__}))"
    )
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(target),
           "VLLM_PLUGINS": "sm70", "HOME": str(tmp_path)}
    run = subprocess.run([str(SERVE_PY), "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(run.stdout.strip().splitlines()[-1])
    assert data["calls"] == 1  # loaded once per process, however often the loader runs
    assert data["file"].startswith(str(target))
