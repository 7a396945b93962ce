"""Running a build: up-front checks, the log file, progress bars, the summary."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from sm70ctl.build.local_sources import local_state
from sm70ctl.build.lock import Lock
from sm70ctl.build.mirror import MirrorError, require_complete
from sm70ctl.build.plan import BuildConfig, build_steps
from sm70ctl.build.steps import Planned, Store, plan_steps, run_steps
from sm70ctl.build.toolchain import ToolchainProbe, probe_toolchain, toolchain_problems
from sm70ctl.errors import Sm70Error


def _probe(cfg: BuildConfig, lock: Lock) -> ToolchainProbe:
    return probe_toolchain(cfg.cuda_home, cfg.host_cc)


def local_drift(lock: Lock, cfg: BuildConfig) -> list[dict[str, Any]]:
    """Local sources whose content differs from the hash the lock records."""
    return [d for d in local_state(lock, cfg.project_root, cfg.csrc) if d["drift"]]


def _plan(lock: Lock, cfg: BuildConfig, probe: ToolchainProbe) -> list[Planned]:
    return plan_steps(build_steps(lock, cfg, probe), Store(cfg.steps_dir))


def dry_run_data(lock: Lock, cfg: BuildConfig) -> dict[str, Any]:
    probe = _probe(cfg, lock)
    planned = _plan(lock, cfg, probe)
    problems = toolchain_problems(probe, lock.toolchain, cfg.cuda_arch_list)
    return {
        "lock": str(lock.path),
        "lock_sha256": lock.digest,
        "offline": cfg.offline,
        "mirror": str(cfg.mirror_dir) if cfg.mirror_dir else None,
        "build_dir": str(cfg.build_dir),
        "inputs": [{"kind": k, "name": n, "id": i} for k, n, i in lock.items()],
        "patches": [{"name": p.name, "sha256": p.sha256} for p in cfg.series],
        # where each local source was found and its hash now, drifted or not
        "local": local_state(lock, cfg.project_root, cfg.csrc),
        "local_drift": local_drift(lock, cfg),
        "toolchain": {
            "nvcc": probe.nvcc or None,
            "nvcc_release": probe.nvcc_release or None,
            "host_cc": probe.host_cc,
            "host_cc_version": probe.host_cc_version or None,
            "problems": problems,
        },
        "steps": [
            {"step": p.step.name, "stage": p.step.kind, "what": p.step.description,
             "status": p.status, "why": p.reason, "key": p.key}
            for p in planned
        ],
    }


def render_plan(console: Any, data: dict[str, Any]) -> None:
    from sm70ctl.output import make_table

    console.print(make_table(f"pinned inputs ({data['lock']})", ["kind", "name", "id"],
                             [(i["kind"], i["name"], i["id"]) for i in data["inputs"]]))
    if data["patches"]:
        console.print(make_table("patch series", ["patch", "sha256"],
                                 [(p["name"], p["sha256"][:16]) for p in data["patches"]]))
    for d in data["local"]:
        console.print(f"local source {d['name']}: {d['path']} content {d['now'][:12]}"
                      + (f" (the lock has {d['locked'][:12]})" if d["drift"] else
                         " (as locked)"), markup=False, highlight=False)
    for d in data["local_drift"]:
        console.print(f"note: {d['name']}/ changed since the lock was written "
                      f"({d['locked'][:12]} -> {d['now'][:12]}); `sm70ctl build --relock`")
    status_style = {"cached": "ok", "stale": "warn", "missing": "info",
                    "interrupted": "warn", "invalid": "warn"}
    rows = [(status_style.get(s["status"], s["status"]), s["status"], s["step"], s["stage"],
             s["what"], s["why"]) for s in data["steps"]]
    console.print(make_table("plan", ["", "status", "step", "stage", "what", "why"], rows,
                             status_column=0))
    tc = data["toolchain"]
    console.print(f"toolchain: nvcc {tc['nvcc_release'] or 'none'} ({tc['nvcc'] or '-'}), "
                  f"host cc {tc['host_cc_version'] or 'none'}")
    for p in tc["problems"]:
        console.print(f"  compile steps cannot run here: {p}")
    todo = [s for s in data["steps"] if s["status"] != "cached"]
    console.print(f"{len(todo)} of {len(data['steps'])} step(s) would run")


class _Log:
    """The build log file; every line also timestamped."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.f = path.open("a", encoding="utf-8")

    def __call__(self, msg: str) -> None:
        self.f.write(f"{time.strftime('%H:%M:%S')} {msg}\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def build_lock_path(cfg: BuildConfig) -> Path:
    return cfg.build_dir / ".build.lock"


def run_build(lock: Lock, cfg: BuildConfig, out: Any) -> dict[str, Any]:
    """One build at a time per SM70_BUILD_DIR: a second one would take the first one's
    work in progress for an interrupted run's leftovers and delete it."""
    from sm70ctl.locking import FileLock

    with FileLock(build_lock_path(cfg), "sm70ctl build", alternative="SM70_BUILD_DIR",
                  folder_setting="SM70_BUILD_DIR"):
        return _run_build(lock, cfg, out)


def _run_build(lock: Lock, cfg: BuildConfig, out: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    if cfg.offline:
        if cfg.mirror_dir is None:
            raise MirrorError("--offline needs a mirror",
                              hint="pass --mirror DIR or set SM70_MIRROR_DIR")
        require_complete(lock, cfg.mirror_dir)
    probe = _probe(cfg, lock)
    planned = _plan(lock, cfg, probe)
    todo = [p for p in planned if p.status != "cached"]
    compile_todo = [p.step.name for p in todo if p.step.kind == "compile"]
    problems = toolchain_problems(probe, lock.toolchain, cfg.cuda_arch_list)
    if compile_todo and problems:
        raise Sm70Error(
            "cannot compile here: " + "; ".join(problems),
            hint="set SM70_CUDA_HOME to a CUDA 12.8 toolkit and SM70_HOST_CC to gcc 11.4-14; "
                 "`--stop-after patch` fetches, verifies and patches without compiling",
        )
    for d in local_drift(lock, cfg):
        out.warn(f"{d['name']}/ differs from the lock ({d['locked'][:12]} -> {d['now'][:12]}); "
                 "the build uses the working tree; `sm70ctl build --relock` records it")
    if not todo:
        dt = time.monotonic() - t0
        return {"changed": False, "steps": [_row(p, "cached", 0.0) for p in planned],
                "seconds": round(dt, 3), "log": None,
                "summary": f"nothing changed: all {len(planned)} step(s) up to date "
                           f"({dt:.2f}s)"}
    log = _Log(cfg.log_dir / f"build-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    log(f"lock {lock.path} sha256 {lock.digest}; offline={cfg.offline} mirror={cfg.mirror_dir}")
    out.info(f"build log: {log.path}")
    rows: list[dict[str, Any]] = []
    try:
        results = _run_with_progress(planned, cfg, log, out)
    finally:
        log.close()
    by_name = {r.name: r for r in results}
    for p in planned:
        r = by_name[p.step.name]
        rows.append(_row(p, r.status, r.seconds))
    built = [r for r in results if r.status == "built"]
    dt = time.monotonic() - t0
    return {"changed": True, "steps": rows, "seconds": round(dt, 3), "log": str(log.path),
            "summary": f"built {len(built)} step(s), {len(results) - len(built)} cached, "
                       f"in {dt:.1f}s (log: {log.path})"}


def _row(p: Planned, status: str, seconds: float) -> dict[str, Any]:
    return {"step": p.step.name, "stage": p.step.kind, "status": status,
            "was": p.status, "why": p.reason, "key": p.key, "seconds": round(seconds, 3)}


def _run_with_progress(planned: list[Planned], cfg: BuildConfig, log: _Log, out: Any):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    store = Store(cfg.steps_dir)
    disable = out.json_mode or not out.err.is_terminal
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[note]}"),
                  TimeElapsedColumn(), console=out.err, disable=disable) as bar:
        overall = bar.add_task("build", total=len(planned), note="")
        current: dict[str, Any] = {}

        def on_start(p: Planned) -> None:
            current["task"] = bar.add_task(f"  {p.step.name}", total=None, note=p.reason)
            if disable:
                out.info(f"{p.step.name}: {p.reason}")

        def on_done(p: Planned, r: Any) -> None:
            if "task" in current:
                bar.update(current.pop("task"), total=1, completed=1, note=r.status)
            elif disable:
                out.info(f"{p.step.name}: cached")
            bar.advance(overall)

        def progress(fraction: float | None, note: str) -> None:
            if "task" in current:
                if fraction is None:
                    bar.update(current["task"], note=note)
                else:
                    bar.update(current["task"], total=1.0, completed=fraction, note=note)

        return run_steps(planned, store, log, on_start, on_done, progress)
