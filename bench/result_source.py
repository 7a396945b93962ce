"""Where a bench/results/*.json came from: its machine, date and job (pure).

The files were written by different generations of the benches: the older ones carry
`device`, `date` and the `command` they ran under at the top; those from the round calls
(tests/gpu/round_call.py) a `run` record whose `device` line ends with the date and whose
`job` names the round call's job; some only a `started` time stamp, and the CPU and
projection files none of these. Each field falls back in that order, to "not recorded".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

NOT_RECORDED = "not recorded"
_DATE = re.compile(r"(?<!\d)(\d{4}-\d{2}-\d{2})(?!\d)")
_SCRIPT = re.compile(r"(?:^|[\s/])([\w.-]+\.(?:py|sh))\b")


@dataclass(frozen=True)
class Source:
    machine: str
    date: str
    job: str

    def cell(self) -> str:
        """The table cell: `H200, 2026-12-01, job`."""
        job = self.job if self.job == NOT_RECORDED else f"`{self.job}`"
        return f"{self.machine}, {self.date}, {job}"


def _machine(result: dict[str, Any]) -> str:
    device = result.get("device") or (result.get("run") or {}).get("device") or ""
    if not device:
        what = str(result.get("what") or "")
        if "PROJECTED" in what:
            return "none (projected)"
        return "CPU" if "on the CPU" in what else NOT_RECORDED
    # "NVIDIA H200" or "one NVIDIA H200 (sm_90, CUDA 13), torch ...": the GPU's own name
    name = device.split("(")[0].split(",")[0].strip()
    name = name.removeprefix("one ").removeprefix("NVIDIA ").strip()
    return name or NOT_RECORDED


def _date(result: dict[str, Any]) -> str:
    run = result.get("run") or {}
    for text in (result.get("date"), run.get("date"), run.get("device"),
                 result.get("started"), run.get("started")):
        m = _DATE.search(str(text or ""))
        if m:
            return m.group(1)
    return NOT_RECORDED


def _job(result: dict[str, Any]) -> str:
    run = result.get("run") or {}
    if run.get("job"):
        return str(run["job"])
    m = _SCRIPT.search(str(result.get("command") or run.get("command") or ""))
    return m.group(1) if m else NOT_RECORDED


def source(result: dict[str, Any]) -> Source:
    """Machine, date and job of one results file's JSON."""
    return Source(_machine(result), _date(result), _job(result))
