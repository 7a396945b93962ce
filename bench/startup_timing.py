"""Shared by the start-up benches (env check, doctor --json, warmup --check): run a command
as fresh processes and time each one, by the wall clock (what a user waits for) and by the
CPU time it used (user + system, children included), and describe the machine the figures
come from. On a shared machine the two differ: the wall time grows with the load, the CPU
time much less, so both are printed with the load average seen at the start."""

from __future__ import annotations

import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Runs:
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)  # each timed run's


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, object]:
    """Where and when: the date (UTC), the CPUs, Python, and the load when the bench began."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "python": sys.version.split()[0],
        "load_1m_at_start": round(load, 2) if load is not None else None,
    }


def time_runs(cmd: Sequence[str], env: Mapping[str, str], runs: int, *,
              cwd: Path | None = None, ok: tuple[int, ...] = (0,)) -> Runs:
    """`runs` fresh processes of `cmd`, after one untimed run that fills the page cache.
    An exit status outside `ok` stops the bench with the command's output."""
    result = Runs()
    for i in range(runs + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(list(cmd), env=dict(env), cwd=cwd, capture_output=True,
                              text=True, timeout=300)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode not in ok:
            raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n"
                             f"{done.stdout}{done.stderr}")
        if i == 0:
            continue
        result.stdout.append(done.stdout)
        result.wall_s.append(wall)
        result.cpu_s.append(after.ru_utime + after.ru_stime
                            - before.ru_utime - before.ru_stime)
    return result


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3)}
