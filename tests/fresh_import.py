"""What importing our modules drags in, asked of a fresh interpreter (this process has long
imported everything)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def loaded_by_import(modules: str, watched: tuple[str, ...]) -> list[str]:
    """Which of `watched` are in sys.modules after `import MODULES` (comma-separated) in a
    fresh interpreter run in the repo root, sorted; a failed import fails the test."""
    code = (f"import json, sys, {modules}; "
            f"print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)
