"""Torch code run in a child: this interpreter if it has torch, else the serving environment
CI builds (.serve-venv, .ci/setup.d/20-serve-env.sh). Without either the calling test skips,
except under CI=true, where it fails (CI must provide one).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVE_PY = ROOT / ".serve-venv" / "bin" / "python"


def torch_python() -> str:
    """The interpreter that has torch (skips or fails the test when there is none)."""
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    if SERVE_PY.is_file():
        return str(SERVE_PY)
    if os.environ.get("CI") == "true":
        pytest.fail(f"no torch here and no {SERVE_PY} (CI must provide it)")
    pytest.skip(f"no torch here and no {SERVE_PY}")


def run_json(args: list[str], request: Any, timeout: int) -> Any:
    """What `torch_python() ARGS` prints as JSON, given `request` as JSON on stdin (the repo
    on PYTHONPATH, so the child imports vllm_patch from this tree); a child that exits
    non-zero fails the test with its stderr."""
    proc = subprocess.run([torch_python(), *args], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
