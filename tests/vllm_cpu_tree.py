"""vLLM 0.22.1's Python tree on the CPU, for the tests that ask it what it makes of our launch.

A probe script runs in the serving venv (.ci/setup.d/20-serve-env.sh) with the 0.22.1 tree of
.ci/setup.d/35-vllm-0.22.1-py.sh first on the path and our plugin loaded through its entry
point, as in production; it reads a JSON request and writes a JSON result. Without the venv
or the tree the tests skip; under CI=true they fail (CI must have them).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tomllib

from sm70ctl.runtime.command_line import VLLM_ENTRYPOINT, vllm_argv
from sm70ctl.runtime.environment import vllm_env
from sm70ctl.settings import load_settings

REPO = Path(__file__).resolve().parents[1]
SERVE_PYTHON = REPO / ".serve-venv" / "bin" / "python"
VLLM_TREE = REPO / "build" / "ci" / "vllm-0.22.1-py"
VLLM_DEPS = REPO / "build" / "ci" / "vllm-0.22.1-deps"
SITE_HOOK = REPO / "tests" / "vllm_probe_site"
CONFIG_PROBE = REPO / "tests" / "vllm_config_probe.py"
MODEL_CONFIG = REPO / "sm70ctl" / "data" / "qwen3.8-27b" / "config.json"
PROBE_TIMEOUT = 300


def probe_problem() -> str | None:
    """Why the probe cannot run here, or None."""
    if not SERVE_PYTHON.is_file():
        return f"{SERVE_PYTHON} is missing (run .ci/setup.d/20-serve-env.sh)"
    if not (VLLM_TREE / "vllm" / "__init__.py").is_file() or not VLLM_DEPS.is_dir():
        return f"{VLLM_TREE} is missing (run .ci/setup.d/35-vllm-0.22.1-py.sh)"
    return None


def require_tree() -> None:
    """Skip without the venv or the tree; under CI=true fail instead."""
    problem = probe_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must have vLLM 0.22.1's config code: {problem}")
    pytest.skip(problem)


def model_folder(tmp: Path) -> Path:
    """A checkpoint folder holding only the model's config.json (the shapes decide what vLLM
    derives; no weights)."""
    model_dir = tmp / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(MODEL_CONFIG.read_text())
    return model_dir


def launch(name: str, model_dir: Path, extra: dict[str, str],
           tmp: Path) -> tuple[Any, dict[str, Any]]:
    """The settings for `model_dir` with `extra` set, and the probe's case for them: the
    words `sm70ctl serve` hands vLLM's API server after `python -m ENTRYPOINT`, and its env."""
    s = load_settings(environ={"SM70_MODEL_DIR": str(model_dir), **extra})
    argv = vllm_argv(s)
    assert argv[1:3] == ["-m", VLLM_ENTRYPOINT]  # what the API server's parser receives
    return s, {"name": name, "argv": argv[3:], "env": vllm_env(s, cache_entry=tmp / "cache")}


def plugin_dist(dest: Path) -> Path:
    """Our general-plugin entry point, as pyproject.toml declares it, for the probe's path
    (the serving venv of CI does not have sm70ctl installed; production's does)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    info = dest / "sm70ctl_parity_probe-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sm70ctl-parity-probe\n"
                                   "Version: 0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in plugins.items())
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{lines}")
    return dest


# the series' Python patch that a launch's arguments depend on: the SM70_PAGED name
NAME_PATCH = REPO / "vllm_patch" / "patches" / "0002-attention-add-sm70-paged-backend-name.patch"


def named_tree(dest: Path) -> Path:
    """The 0.22.1 tree with patch 0002 applied, as `sm70ctl build` ships it (the enum has
    SM70_PAGED, the default SM70_ATTENTION_BACKEND): links to the tree's files, except the
    patched registry.py, which is a copy."""
    import shutil

    from sm70ctl.build.patches import Patch, apply_series

    shutil.copytree(VLLM_TREE, dest, symlinks=True, copy_function=os.symlink)
    registry = dest / "vllm" / "v1" / "attention" / "backends" / "registry.py"
    registry.unlink()
    shutil.copyfile(VLLM_TREE / registry.relative_to(dest), registry)
    apply_series(dest, [Patch(NAME_PATCH, "")])
    return dest


def run_probe(script: Path, request: dict[str, Any], tmp: Path,
              named: bool | None = None) -> tuple[dict[str, Any], str]:
    """The probe's result for `request`, and its log (stdout then stderr); a probe that
    exits non-zero or writes no result fails the test. named: on named_tree, else on the
    released tree; by default named when the request names SM70_PAGED (a launch with
    `--attention-backend SM70_PAGED`, the default, needs the name)."""
    request_file = tmp / "request.json"
    text = json.dumps(request)
    request_file.write_text(text)
    if named is None:
        named = '"SM70_PAGED"' in text
    result = tmp / "result.json"
    tree = named_tree(tmp / "named-tree") if named else VLLM_TREE
    path = [tree, VLLM_DEPS, SITE_HOOK, plugin_dist(tmp / "plugin"), REPO]
    # The launch's own variables come from each case's env; none of the caller's may leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM70_", "VLLM_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    proc = subprocess.run([str(SERVE_PYTHON), str(script), str(request_file), str(result)],
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT, env=env,
                          check=False)
    if proc.returncode != 0 or not result.is_file():
        pytest.fail(f"probe failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-3000:]}")
    return json.loads(result.read_text()), proc.stdout + proc.stderr


def mutated_plugin(dest: Path, file: str, old: str, new: str) -> Path:
    """A copy of our vllm_patch package under `dest` with `old` replaced by `new` (once) in
    `file` (relative to vllm_patch/): put `dest` first on a probe's path ("front") to run
    vLLM with the mutant instead of the real module."""
    import shutil

    pkg = dest / "vllm_patch"
    shutil.copytree(REPO / "vllm_patch", pkg, ignore=shutil.ignore_patterns("__pycache__", "_lib"))
    target = pkg / file
    text = target.read_text()
    assert text.count(old) == 1, f"mutant text not found once in {file}: {old!r}"
    target.write_text(text.replace(old, new))
    return dest
