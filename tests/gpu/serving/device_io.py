"""The serving device scripts' file and log helpers (pure Python: the drivers import it
before any vLLM, the CPU tests with them)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def atomic_write(path: Path, data: Any) -> None:
    """JSON to `path` through a temporary file: a reader never sees half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The file's JSON, or None while it is missing or being written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
