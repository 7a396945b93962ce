"""The serving device scripts' file, log and engine-process helpers (no vLLM: the drivers
import it before any, the CPU tests with them)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
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


# --- the drivers' engine processes --------------------------------------------------------
# Each driver starts its engines as processes that write their results to one JSON file
# each, polls those files while the engines run, and stops what is left at its deadline.

Start = Callable[[list[str], dict[str, str], Path], subprocess.Popen]


def fresh_plan_dir(work: Path) -> Path:
    """work/plans, emptied: an engine must never run a plan of an earlier call."""
    plan_dir = work / "plans"
    plan_dir.mkdir(parents=True, exist_ok=True)
    for f in plan_dir.glob("*.json"):
        f.unlink()
    return plan_dir


def launch(configs: Mapping[str, Mapping[str, Any]], work: Path,
           command: Callable[[str, Path, Path], list[str]],
           env: Callable[[str], dict[str, str]], start: Start
           ) -> tuple[dict[str, subprocess.Popen], dict[str, Path]]:
    """One process per engine: its keyword arguments to work/<name>_kwargs.json, its
    result file work/<name>.json (an earlier call's removed first), its log
    work/<name>.log. `command(name, kwargs_path, result_path)` is its argv, `start`
    run_ab.start. Returns the processes and the result files by name."""
    work.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    files = {n: work / f"{n}.json" for n in configs}
    for name, kw in configs.items():
        files[name].unlink(missing_ok=True)
        kw_path = work / f"{name}_kwargs.json"
        kw_path.write_text(json.dumps(kw))
        procs[name] = start(command(name, kw_path, files[name]), env(name),
                            work / f"{name}.log")
    return procs, files


def read_engines(files: Mapping[str, Path], engines: dict[str, Any]) -> None:
    """Each engine's latest complete result into `engines` (a missing or half-written
    file keeps the previous one)."""
    for n, path in files.items():
        got = read_json(path)
        if got is not None:
            engines[n] = got


def write_logs(path: Path, work: Path, names: Iterable[str], tail: int = 15000) -> None:
    """The last `tail` characters of each engine's log, one file."""
    with open(path, "w") as fh:
        for n in names:
            p = work / f"{n}.log"
            text = p.read_text(errors="replace") if p.exists() else ""
            fh.write(f"===== {n}.log ({len(text)} chars, last {tail})\n{text[-tail:]}\n")


def snapshot(out: Path, work: Path, files: Mapping[str, Path],
             engines: dict[str, Any]) -> None:
    """Read the engines' results and write out/engines.json and out/logs.txt as they are
    now (only $OUT comes back from the device, and the call may be cut at any moment)."""
    read_engines(files, engines)
    atomic_write(out / "engines.json", engines)
    write_logs(out / "logs.txt", work, files)


def watch(procs: Mapping[str, subprocess.Popen], deadline: float,
          tick: Callable[[], None], every_s: float = 3.0) -> None:
    """Call `tick` every `every_s` seconds while an engine runs, until the deadline."""
    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(every_s)
        tick()


def stop(procs: Mapping[str, subprocess.Popen], say: bool = True) -> dict[str, int | None]:
    """Kill the engines still running; their exit codes by name (logged when `say`)."""
    rcs: dict[str, int | None] = {}
    for name, p in procs.items():
        if p.poll() is None:
            p.kill()
            p.wait()
            if say:
                log(f"{name}: killed at the budget")
        rcs[name] = p.returncode
        if say:
            log(f"{name}: rc={p.returncode}")
    return rcs


def utc_stamp() -> str:
    """Now, as the summaries' `started` field."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def summary_writer(path: Path, summary: dict[str, Any], t0: float) -> Callable[[], None]:
    """flush(): `summary` with its `elapsed_s` since `t0`, written atomically to `path`."""

    def flush() -> None:
        summary["elapsed_s"] = round(time.time() - t0, 1)
        atomic_write(path, summary)

    return flush


def engine_share(engines: int, default_share: str) -> tuple[Path, float, float]:
    """The tiny checkpoint's folder ($SM70_AB_TINY), the GPU share of the whole run
    ($SM70_GPU_SHARE, else `default_share`) and each engine's part of it."""
    tiny = Path(os.environ.get("SM70_AB_TINY", "/tmp/ab/tiny"))
    share = float(os.environ.get("SM70_GPU_SHARE", default_share))
    return tiny, share, round(share / engines, 3)


def finish(summary: dict[str, Any], flush: Callable[[], None],
           verdict: Callable[[], dict[str, Any]]) -> int:
    """The summary's verdict part from `verdict()`, written; the driver's exit code (0 only
    when it passed). A judge that fails leaves its error beside the engines' rows, which
    engines.json holds, so the verdict can be redone."""
    try:
        summary.update(verdict())
    except Exception as exc:
        summary["judge_error"] = f"{type(exc).__name__}: {exc}"
        summary["judge_traceback"] = traceback.format_exc()[-3000:]
    flush()
    log(f"passed={summary['passed']}")
    return 0 if summary["passed"] else 1
