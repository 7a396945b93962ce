"""A content-addressed step runner: atomic outputs, a stamp written last, resume.

Each step declares its inputs (plain JSON data: lock entries, patch digests, settings
that change compiled code, toolchain versions) and the steps it depends on. Its key is
the sha256 of those inputs plus its dependencies' keys, so a changed input re-runs that
step and everything downstream of it, and nothing else.

Layout under the store root (`$SM70_BUILD_DIR/steps`):
    <step>/<key>/          the finished output (renamed into place when complete)
    <step>/<key>.json      the stamp, written last: the inputs and when it finished
    <step>/.tmp-<key>-<pid>/  work in progress; left behind by a killed build and
                              removed by the next run, which redoes only that step
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error
from sm70ctl.fsutil import atomic_write_text, replace_dir, rmtree_quiet
from sm70ctl.readers import read_json

STEP_FORMAT = 1  # bump when the meaning of a step's output changes


class StepError(Sm70Error):
    """A step failed; the message names the step."""


@dataclass
class StepContext:
    out: Path  # write the step's output here (a temporary folder)
    deps: dict[str, Path]  # finished outputs of the steps this one depends on
    log: Callable[[str], None]
    progress: Callable[[float | None, str], None] = lambda fraction, note: None


@dataclass
class Step:
    name: str
    kind: str  # fetch | patch | env | compile | install
    description: str
    inputs: dict[str, Any]
    run: Callable[[StepContext], None]
    deps: tuple[str, ...] = ()
    # Optional quick check that a cached result still holds (an install whose target
    # environment was deleted is not cached any more).
    still_valid: Callable[[Path], bool] | None = None


@dataclass
class Planned:
    step: Step
    key: str
    status: str  # cached | stale | missing | interrupted | invalid
    reason: str
    changed: list[str] = field(default_factory=list)


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


def step_key(step: Step, dep_keys: dict[str, str]) -> str:
    payload = {
        "format": STEP_FORMAT,
        "name": step.name,
        "inputs": step.inputs,
        "deps": {d: dep_keys[d] for d in step.deps},
    }
    return hashlib.sha256(_canonical(payload).encode()).hexdigest()


def order_steps(steps: Iterable[Step]) -> list[Step]:
    """Topological order, stable in declaration order; raises on unknown or cyclic deps."""
    by_name: dict[str, Step] = {}
    for s in steps:
        if s.name in by_name:
            raise StepError(f"two steps are named {s.name!r}")
        by_name[s.name] = s
    done: list[Step] = []
    state: dict[str, int] = {}

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise StepError(f"steps depend on each other: {' -> '.join((*chain, name))}")
        if name not in by_name:
            raise StepError(f"step {chain[-1]!r} depends on unknown step {name!r}")
        state[name] = 1
        for d in by_name[name].deps:
            visit(d, (*chain, name))
        state[name] = 2
        done.append(by_name[name])

    for name in by_name:
        visit(name, ())
    return done


def diff_inputs(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Names of the inputs that differ (dotted paths), for 'why is this stale'."""
    out: list[str] = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_inputs(a, b, f"{prefix}{k}.")
        elif _canonical(a) != _canonical(b):
            out.append(f"{prefix}{k}")
    return out


class Store:
    """The on-disk step results."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def output(self, name: str, key: str) -> Path:
        return self.root / name / key

    def stamp(self, name: str, key: str) -> Path:
        return self.root / name / f"{key}.json"

    def is_done(self, name: str, key: str) -> bool:
        return self.stamp(name, key).is_file() and self.output(name, key).is_dir()

    def other_stamps(self, name: str, key: str) -> list[dict[str, Any]]:
        d = self.root / name
        if not d.is_dir():
            return []
        out = []
        for p in sorted(d.glob("*.json"), key=lambda q: q.stat().st_mtime, reverse=True):
            if p.name == f"{key}.json":
                continue
            try:
                out.append(read_json(p, what="step record"))
            except Sm70Error:
                continue
        return out

    def leftovers(self, name: str) -> list[Path]:
        d = self.root / name
        return sorted(d.glob(".tmp-*")) if d.is_dir() else []

    def commit(self, step: Step, key: str, tmp: Path, seconds: float) -> Path:
        final = self.output(step.name, key)
        replace_dir(tmp, final)
        stamp = {
            "step": step.name,
            "key": key,
            "inputs": step.inputs,
            "deps": list(step.deps),
            "seconds": round(seconds, 3),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        atomic_write_text(self.stamp(step.name, key), _canonical(stamp) + "\n")
        # Older results of this step are superseded; keep the disk bounded.
        for p in (self.root / step.name).iterdir():
            if p.name not in (key, f"{key}.json") and not p.name.startswith(".tmp-"):
                if p.is_dir():
                    rmtree_quiet(p)
                else:
                    p.unlink(missing_ok=True)
        return final


def plan_steps(steps: Iterable[Step], store: Store) -> list[Planned]:
    """Keys and statuses for every step, without running anything."""
    ordered = order_steps(steps)
    keys: dict[str, str] = {}
    rebuild: set[str] = set()
    planned: list[Planned] = []
    for s in ordered:
        key = step_key(s, keys)
        keys[s.name] = key
        upstream = [d for d in s.deps if d in rebuild]
        if store.is_done(s.name, key):
            if s.still_valid is not None and not s.still_valid(store.output(s.name, key)):
                p = Planned(s, key, "invalid", "cached result no longer holds; redo")
            else:
                p = Planned(s, key, "cached", "inputs unchanged")
        elif store.leftovers(s.name):
            p = Planned(s, key, "interrupted", "an earlier run stopped mid-step; redo it")
        else:
            others = store.other_stamps(s.name, key)
            if others:
                changed = diff_inputs(others[0].get("inputs", {}), s.inputs)
                if upstream and not changed:
                    why = f"rebuilt upstream: {', '.join(upstream)}"
                else:
                    why = f"changed: {', '.join(changed) or 'step format'}"
                p = Planned(s, key, "stale", why, changed)
            else:
                p = Planned(s, key, "missing", "never built")
        if p.status != "cached":
            rebuild.add(s.name)
        planned.append(p)
    return planned


@dataclass
class StepResult:
    name: str
    key: str
    status: str  # cached | built
    seconds: float
    output: str


def run_steps(
    planned: list[Planned],
    store: Store,
    log: Callable[[str], None],
    on_start: Callable[[Planned], None] = lambda p: None,
    on_done: Callable[[Planned, StepResult], None] = lambda p, r: None,
    progress: Callable[[float | None, str], None] = lambda f, n: None,
) -> list[StepResult]:
    """Run the planned steps in order; cached ones are skipped in O(1)."""
    outputs: dict[str, Path] = {}
    results: list[StepResult] = []
    for p in planned:
        s = p.step
        if p.status == "cached":
            out = store.output(s.name, p.key)
            outputs[s.name] = out
            r = StepResult(s.name, p.key, "cached", 0.0, str(out))
            log(f"[{s.name}] cached ({p.key[:12]})")
            results.append(r)
            on_done(p, r)
            continue
        for left in store.leftovers(s.name):
            log(f"[{s.name}] removing leftover of an interrupted run: {left.name}")
            rmtree_quiet(left)
        tmp = store.root / s.name / f".tmp-{p.key[:16]}-{os.getpid()}"
        tmp.mkdir(parents=True)
        log(f"[{s.name}] start ({p.status}: {p.reason}) key {p.key[:12]}")
        on_start(p)
        t0 = time.monotonic()
        ctx = StepContext(
            out=tmp,
            deps={d: outputs[d] for d in s.deps},
            log=lambda m, _n=s.name: log(f"[{_n}] {m}"),
            progress=progress,
        )
        try:
            s.run(ctx)
        except BaseException:
            rmtree_quiet(tmp)
            log(f"[{s.name}] failed")
            raise
        dt = time.monotonic() - t0
        out = store.commit(s, p.key, tmp, dt)
        outputs[s.name] = out
        log(f"[{s.name}] done in {dt:.2f}s -> {out}")
        r = StepResult(s.name, p.key, "built", dt, str(out))
        results.append(r)
        on_done(p, r)
    return results
