"""One vLLM server process: its own process group, a rotating log, readiness and shutdown.

The server is started in a new session, so a Ctrl-C in the terminal reaches only us; we
then stop the whole group (the API server and its engine-core children) with SIGTERM and,
after the grace period, SIGKILL. Every line the server prints goes to the rotating log
and to the console (stderr), and the last lines are kept to explain a failed start.
Serve supervises it (restart with back-off, sm70ctl/serve/supervisor.py); warmup starts it
twice to fill and then check the compile cache.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import logging.handlers
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sm70ctl.errors import Sm70Error
from sm70ctl.secrets import redact

TAIL_LINES = 40


# --- errors ---------------------------------------------------------------------------
class ServerFailed(Sm70Error):
    """The server died or never became ready; carries the tail of its log."""

    def __init__(self, message: str, tail: Sequence[str], *, hint: str | None = None) -> None:
        shown = "\n".join(f"    {line}" for line in tail) if tail else "    (no output)"
        super().__init__(f"{message}\n  last lines of the server log:\n{shown}", hint=hint)
        self.tail = list(tail)


# --- logging --------------------------------------------------------------------------
class ServerLog:
    """The rotating log file plus a console echo and a tail for error messages."""

    def __init__(
        self,
        path: Path,
        max_bytes: int,
        backups: int,
        echo: Callable[[str], None] | None = None,
        secrets: Sequence[str] = (),
    ) -> None:
        self.path = Path(path)
        # Values masked in the server's own lines: a server that prints its arguments
        # (some vLLM versions log every non-default one) must not put the API key into
        # the log file, the console or an error message's tail.
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handler = logging.handlers.RotatingFileHandler(
                self.path, maxBytes=max(0, int(max_bytes)), backupCount=max(0, int(backups)),
                encoding="utf-8",
            )
        except OSError as exc:
            raise Sm70Error(f"cannot write the server log {self.path}: {exc.strerror or exc}",
                            hint=f"SM70_LOG_DIR={self.path.parent} must be a folder this "
                            "user can write") from None
        self._logger = logging.getLogger(f"sm70ctl.serve.{id(self)}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        self._logger.addHandler(self._handler)
        self._echo = echo
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()

    def note(self, line: str, *, echo: bool = False) -> None:
        """A supervisor line (prefixed so it stands out from the server's own lines)."""
        line = redact(line, self._secrets)
        with self._lock:
            self._logger.info("[sm70ctl] %s", line)
        if echo and self._echo:
            self._echo(f"[sm70ctl] {line}")

    def server_line(self, line: str) -> None:
        line = redact(line, self._secrets)
        with self._lock:
            self.tail.append(line)
            self._logger.info("%s", line)
        if self._echo:
            self._echo(line)

    def close(self) -> None:
        self._handler.close()
        self._logger.removeHandler(self._handler)


# --- the process ----------------------------------------------------------------------
@dataclass
class ServerSpec:
    argv: list[str]
    env: dict[str, str]
    base_url: str  # http://127.0.0.1:8000
    api_key: str | None = field(default=None, repr=False)  # never in a repr or log
    startup_timeout: float = 1800.0
    shutdown_grace: float = 30.0
    restart: bool = False
    restart_backoff_max: float = 300.0
    healthy_reset: float = 300.0
    cwd: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM the server if the supervisor dies
    (even by SIGKILL), so no orphaned server keeps the port after its lock is gone."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    def __init__(self, spec: ServerSpec, log: ServerLog) -> None:
        self.spec = spec
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.spec.argv,
            env=self.spec.env,
            cwd=self.spec.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: we signal the whole server
            preexec_fn=_die_with_parent,
        )
        self._pump = threading.Thread(target=self._pump_output, daemon=True)
        self._pump.start()
        self.log.note(f"server started, pid {self.proc.pid} (process group {self.proc.pid})")

    def _pump_output(self) -> None:
        assert self.proc and self.proc.stdout
        for raw in iter(self.proc.stdout.readline, b""):
            self.log.server_line(raw.decode("utf-8", "replace").rstrip("\n"))
        self.proc.stdout.close()

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def drain_output(self, timeout: float = 5.0) -> None:
        """Wait (at most `timeout`) until the server's last lines are in the log: after it
        exits, so a failure message can quote them."""
        if self._pump:
            self._pump.join(timeout=timeout)

    def group_alive(self) -> bool:
        """Any live (non-zombie) process left in the server's group? Orphaned zombies are
        ignored: in containers whose PID 1 does not reap, they linger but hold nothing."""
        if not self.proc:
            return False
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return group_has_live_members(self.proc.pid)

    def _signal_group(self, sig: int) -> None:
        if self.proc:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace: float) -> int | None:
        """SIGTERM to the group, SIGKILL after `grace` seconds; returns the exit code."""
        if not self.proc:
            return None
        if self.proc.poll() is None or self.group_alive():
            self.log.note(f"stopping the server (SIGTERM to group {self.proc.pid})", echo=True)
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not self.group_alive():
                    break
                time.sleep(0.1)
            else:
                self.log.note(
                    f"still running after {grace:g}s: SIGKILL to group {self.proc.pid}",
                    echo=True,
                )
                self._signal_group(signal.SIGKILL)
        code = self.proc.wait()
        # Children that outlived the leader (engine-core workers) go with the group.
        if self.group_alive():
            self._signal_group(signal.SIGKILL)
        self.drain_output()
        self.log.note(f"server exited with code {code}")
        return code


def group_has_live_members(pgid: int, proc_root: Path = Path("/proc")) -> bool:
    if not proc_root.is_dir():  # not Linux: trust killpg
        return True
    for stat in proc_root.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


# --- readiness ------------------------------------------------------------------------
def http_ok(url: str, api_key: str | None, timeout: float = 2.0) -> bool:
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(
    server: ServerProcess,
    stop: threading.Event,
    on_tick: Callable[[float, str], None] | None = None,
    *,
    poll: float = 0.5,
) -> float:
    """Block until /health and /v1/models answer; returns the seconds it took. Raises
    ServerFailed when the server exits or the timeout passes; returns early (-1) on stop."""
    spec = server.spec
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        if stop.is_set():
            return -1.0
        code = server.poll()
        if code is not None:
            server.drain_output()
            raise ServerFailed(
                f"the server exited with code {code} while starting ({elapsed:.0f}s)",
                list(server.log.tail),
                hint=f"full log: {server.log.path}",
            )
        if elapsed > spec.startup_timeout:
            raise ServerFailed(
                f"the server was not ready after {spec.startup_timeout:g}s "
                "(SM70_STARTUP_TIMEOUT)",
                list(server.log.tail),
                hint=f"raise SM70_STARTUP_TIMEOUT, or read {server.log.path}",
            )
        health = http_ok(spec.base_url + "/health", spec.api_key)
        if health and http_ok(spec.base_url + "/v1/models", spec.api_key):
            return elapsed
        if on_tick:
            on_tick(elapsed, server.log.tail[-1] if server.log.tail else "")
        stop.wait(poll)


