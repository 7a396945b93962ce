"""Keeps the vLLM server running: restart with back-off after it dies, until asked to stop.

One server process (start, readiness, log, shutdown) is sm70ctl.runtime.server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sm70ctl.runtime.server import ServerFailed, ServerLog, ServerProcess, ServerSpec, wait_ready


# --- back-off policy (pure) -----------------------------------------------------------
def next_backoff(
    failures: int,
    healthy_for: float,
    *,
    healthy_reset: float,
    maximum: float,
    base: float = 1.0,
) -> tuple[int, float]:
    """After a server exit: the new count of consecutive failures and the delay before the
    next start. A run that stayed healthy for `healthy_reset` seconds or more wipes the
    history, so a long-lived server that dies once restarts quickly; repeated quick
    failures double the delay up to `maximum`."""
    if healthy_for >= healthy_reset:
        failures = 0
    failures += 1
    delay = min(maximum, base * (2 ** min(failures - 1, 62)))
    return failures, max(0.0, delay)


# --- supervision ----------------------------------------------------------------------
@dataclass
class Events:
    """Callbacks for what people see; the supervisor itself prints nothing (what a callback
    returns is ignored)."""

    starting: Callable[[int, int], object] = lambda attempt, pid: None
    tick: Callable[[float, str], None] | None = None
    ready: Callable[[float], object] = lambda seconds: None
    restarting: Callable[[int, float, str], object] = lambda failures, delay, why: None
    stopping: Callable[[], object] = lambda: None


def supervise(
    spec: ServerSpec,
    log: ServerLog,
    stop: threading.Event,
    events: Events | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Start the server and keep it running until `stop` is set; 0 after a requested stop.
    Without restart, a server that dies raises ServerFailed; with restart it is started
    again after the back-off delay."""
    events = events or Events()
    failures = 0
    attempt = 0
    while True:
        attempt += 1
        server = ServerProcess(spec, log)
        server.start()
        events.starting(attempt, server.pid or 0)
        healthy_for = 0.0
        why = ""
        try:
            try:
                took = wait_ready(server, stop, events.tick)
            except ServerFailed as exc:
                if not spec.restart:
                    raise
                why = exc.message.splitlines()[0]
            else:
                if took < 0:  # stop requested while starting
                    events.stopping()
                    server.stop(spec.shutdown_grace)
                    return 0
                events.ready(took)
                log.note(f"ready after {took:.1f}s at {spec.base_url}")
                ready_at = clock()
                while not stop.is_set() and server.poll() is None:
                    stop.wait(0.5)
                if stop.is_set():
                    events.stopping()
                    server.stop(spec.shutdown_grace)
                    return 0
                healthy_for = clock() - ready_at
                code = server.poll()
                server.drain_output()
                why = f"the server exited with code {code} after {healthy_for:.0f}s"
                if not spec.restart:
                    raise ServerFailed(why, list(log.tail), hint=f"full log: {log.path}")
        finally:
            if server.poll() is None or server.group_alive():
                server.stop(spec.shutdown_grace)
        failures, delay = next_backoff(
            failures,
            healthy_for,
            healthy_reset=spec.healthy_reset,
            maximum=spec.restart_backoff_max,
        )
        log.note(f"{why}; restart {failures} in {delay:g}s", echo=False)
        events.restarting(failures, delay, why)
        if stop.wait(delay):
            return 0
