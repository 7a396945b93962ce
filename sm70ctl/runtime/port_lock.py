"""Serve's per-port lock and what its record tells others (the cache entry a server runs on).

The lock itself is `sm70ctl.locking.FileLock`; this module only names the file and reads
the records, so warmup can refuse to rebuild an entry a live server uses without importing
serve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sm70ctl.locking import FileLock, probe_holder


def port_lock_path(lock_dir: Path, port: int) -> Path:
    return Path(lock_dir).expanduser() / f"serve-port-{port}.lock"


def port_lock(lock_dir: Path, port: int, host: str) -> FileLock:
    return FileLock(port_lock_path(lock_dir, port), f"sm70ctl serve on port {port}",
                    alternative="SM70_PORT", folder_setting="SM70_LOCK_DIR", port=port,
                    host=host)


def servers_using(lock_dir: Path, entry: Path) -> list[dict[str, Any]]:
    """The live `sm70ctl serve` processes whose server runs on the compile-cache `entry`
    (from the records of the held port locks)."""
    out = []
    for path in sorted(Path(lock_dir).expanduser().glob("serve-port-*.lock")):
        holder = probe_holder(path)
        if holder is not None and holder.info.get("cache_entry") == str(entry):
            out.append(holder.info)
    return out
