"""`sm70ctl serve`: settings -> memory plan -> pre-flight -> launch -> supervise."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from sm70ctl.options import EnvFileOpt, JsonOpt
from sm70ctl.settings.typed import SettingsView

HELP = (
    "Start the vLLM OpenAI server for the configured model and keep it running.\n\n"
    "Order: settings, memory plan (refused on overflow), pre-flight (exclusive GPUs, free "
    "port, per-port lock held for the server's life, model folder and its quantisation "
    "config, warm compile cache, GPU UUIDs resolved to PCI-bus indices), then the server "
    "in its own process group, logging to SM70_LOG_DIR and the console. SIGINT/SIGTERM/SIGHUP "
    "stop it gracefully (SIGKILL after SM70_SHUTDOWN_GRACE).\n\n"
    "Examples:\n\n"
    "    sm70ctl serve --dry-run                      # command and environment, no start\n\n"
    "    sm70ctl serve                                # pre-flight, launch, wait for /health\n\n"
    "    SM70_PORT=8100 sm70ctl serve --restart       # restart with back-off if it dies\n\n"
    "    sm70ctl serve --device cpu --env-file cpu.env --allow-cold   # vLLM's CPU build (tests)"
)

# Each of these stops the server gracefully (SIGHUP: the terminal or SSH session closed).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        help="cuda (the V100s) or cpu (vLLM's CPU build with a CPU settings profile; the GPU "
        "checks are reported as skipped).",
    ),
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Print the command and environment; start nothing.")
]
AllowColdOpt = Annotated[
    bool,
    typer.Option("--allow-cold", help="Start even when the compile cache is cold (a warning)."),
]
RestartOpt = Annotated[
    Optional[bool],  # noqa: UP045 - Typer 0.25 needs Optional on Python 3.10
    typer.Option(
        "--restart/--no-restart",
        help="Restart the server with back-off when it dies (default: SM70_RESTART).",
        show_default=False,
    ),
]


def register(app: typer.Typer) -> None:
    @app.command("serve", help=HELP)
    def serve(
        env_file: EnvFileOpt = None,
        device: DeviceOpt = "cuda",
        dry_run: DryRunOpt = False,
        allow_cold: AllowColdOpt = False,
        restart: RestartOpt = None,
        json_mode: JsonOpt = False,
    ) -> None:
        from sm70ctl.settings import load_settings

        code = run_serve(
            load_settings(env_file=env_file),
            environ=dict(os.environ),
            device=device,
            dry_run=dry_run,
            allow_cold=allow_cold,
            restart=restart,
            json_mode=json_mode,
        )
        if code:
            raise typer.Exit(code)


# --- the work ---------------------------------------------------------------------------
def _plan_verdict(settings: SettingsView, device: str) -> tuple[str, str]:
    if device == "cpu":
        return ("skip", "device cpu: the GPU memory plan does not apply")
    from sm70ctl.errors import Sm70Error
    from sm70ctl.plan.run import plan_for_settings

    try:
        run = plan_for_settings(settings)
    except (Sm70Error, ValueError, KeyError, OSError) as exc:
        return ("fail", f"the memory plan could not be computed: {exc}")
    plan = run.plan
    if plan.overflow is not None:
        return ("fail", f"{plan.overflow.message} (run `sm70ctl plan` for what fits)")
    gpus_note = "" if run.gpus.source == "nvml" else f" ({run.gpus.note})"
    return ("pass", f"fits; longest sequence {plan.longest_sequence:,} tokens{gpus_note}")


def _gather(
    settings: SettingsView, device: str, allow_cold: bool, lock_ours: bool, environ: dict[str, str]
) -> dict[str, Any]:
    """Run every probe; returns the inputs of the pure checks plus launch data."""
    from sm70ctl.devices.selection import resolve_gpu_entries
    from sm70ctl.locking import probe_holder
    from sm70ctl.runtime import probes as rprobes
    from sm70ctl.runtime.cache_status import cache_status
    from sm70ctl.runtime.port_lock import port_lock_path
    from sm70ctl.runtime.probes import GpuUse
    from sm70ctl.serve import probes
    from sm70ctl.serve.backend_name import decide_backend_flag
    from sm70ctl.serve.preflight import CacheState, PreflightInputs
    from sm70ctl.settings.rules import is_loopback

    gpus: list[GpuUse] = []
    nvml_error: str | None = None
    indices: list[int] | None = None
    if device == "cuda":
        gpus, nvml_error = rprobes.probe_gpus(settings)
        if nvml_error is None:
            resolved, problems = resolve_gpu_entries(settings.gpus, gpus)
            indices = None if problems else resolved
    holder = None
    if not lock_ours:
        h = probe_holder(port_lock_path(settings.lock_dir, settings.port))
        holder = h.info if h else None
    model = rprobes.probe_model_dir(settings.model_dir)
    verdict, _ = cache_status(settings, device, environ)
    backend = decide_backend_flag(settings.attention_backend,
                                  rprobes.probe_serving_backend(settings, environ))
    inputs = PreflightInputs(
        device=device,
        host=settings.host,
        host_is_loopback=is_loopback(settings.host),
        api_key_set=settings.api_key is not None,
        port=settings.port,
        port_state=probes.probe_port(settings.host, settings.port),
        lock_holder=holder,
        lock_ours=lock_ours,
        serve_python=str(settings.serve_python),
        serve_python_ok=rprobes.probe_executable(settings.serve_python),
        model=model,
        quantization=settings.quantization,
        quant_problems=probes.quant_problems(dict(model.config) if model.config else None),
        cache=CacheState(verdict.warm, verdict.reason, verdict.fingerprint),
        allow_cold=allow_cold,
        gpus_wanted=list(settings.gpus),
        nvml_error=nvml_error,
        gpus=gpus,
        busy_bytes=int(settings.gpu_busy_mib),
        plan=_plan_verdict(settings, device),
        attention_backend=settings.attention_backend,
        tensor_parallel_size=settings.tensor_parallel_size,
        backend_name=backend.check,
    )
    # the all-reduce and NCCL_P2P_DISABLE from the GPUs' links (sm70ctl.devices.topology)
    allreduce = rprobes.probe_allreduce(settings, indices) if device == "cuda" else None
    return {"inputs": inputs, "gpu_indices": indices, "fingerprint": verdict.fingerprint,
            "allreduce": allreduce, "attention_backend": backend.value}


def _server_argv(settings: SettingsView, gathered: dict[str, Any],
                 secrets_file: Path | None = None) -> list[str]:
    """The server's command line, the same for a dry run and a start: the attention-backend
    name is the one decided for the serving vLLM (sm70ctl.serve.backend_name)."""
    from sm70ctl.runtime.command_line import vllm_argv
    from sm70ctl.serve.clef_args import clef_argv

    return vllm_argv(settings, secrets_file=secrets_file,
                     attention_backend=gathered["attention_backend"]) + clef_argv(settings)


def _render_checks(console: Any, checks: list[Any]) -> None:
    from sm70ctl.output import make_table

    rows = [(c.name, c.status, c.detail + (f"\nfix: {c.hint}" if c.hint and
                                              c.status == "fail" else "")) for c in checks]
    console.print(make_table("pre-flight", ["check", "status", "detail"], rows, status_column=1))


def _render_dry_run(console: Any, data: dict[str, Any]) -> None:
    from sm70ctl.output import make_table

    _render_checks_dicts(console, data["checks"])
    console.print(make_table("environment set for vLLM", ["variable", "value"],
                             sorted(data["env"].items())))
    console.print("command:", style="bold")
    console.print(data["command_line"], markup=False, highlight=False, soft_wrap=True)


def _render_checks_dicts(console: Any, checks: list[dict[str, Any]]) -> None:
    from sm70ctl.serve.preflight import Check

    _render_checks(console, [Check(**c) for c in checks])


def run_serve(
    settings: SettingsView,
    *,
    environ: dict[str, str],
    device: str = "cuda",
    dry_run: bool = False,
    allow_cold: bool = False,
    restart: bool | None = None,
    json_mode: bool = False,
) -> int:
    from sm70ctl.errors import Sm70Error, UsageError
    from sm70ctl.output import Output
    from sm70ctl.runtime.command_line import redact_argv, shell_line, vllm_argv
    from sm70ctl.runtime.cpu_profile import DEVICES, cpu_problems
    from sm70ctl.runtime.environment import managed_env, mask_env
    from sm70ctl.runtime.manifest import entry_dir
    from sm70ctl.runtime.port_lock import port_lock
    from sm70ctl.runtime.secrets import secrets_file
    from sm70ctl.secrets import secret_values
    from sm70ctl.serve.preflight import failures, run_checks

    out = Output(json_mode)
    if device not in DEVICES:
        raise UsageError(f"--device {device}: expected one of {', '.join(DEVICES)}")
    if device == "cpu":
        problems = cpu_problems(settings)
        if problems:
            raise UsageError(
                "--device cpu needs a CPU settings profile: " + "; ".join(problems),
                hint="see docs/serve.md (the CPU profile), e.g. --env-file tests/e2e/cpu.env",
            )
    # Every value to keep out of output and logs: the settings' secrets and whatever an
    # inherited secret-named variable holds (VLLM_API_KEY, HF_TOKEN...).
    secrets = secret_values(environ, extra=[s.get_secret_value() for s in
                                            (settings.api_key, settings.hf_token) if s])
    vllm_argv(settings)  # refuses a command line vLLM would misread, before any probe

    if dry_run:
        gathered = _gather(settings, device, allow_cold, lock_ours=False, environ=environ)
        shown_argv = redact_argv(_server_argv(settings, gathered))
        checks = run_checks(gathered["inputs"])
        env = managed_env(settings, device, entry_dir(settings.cache_dir, gathered["fingerprint"]),
                          gathered["gpu_indices"], allreduce=gathered["allreduce"])
        data = {
            "dry_run": True,
            "device": device,
            "command": shown_argv,
            "command_line": shell_line(shown_argv),
            "env": mask_env(env, secrets),
            "checks": [c.to_dict() for c in checks],
        }
        out.emit(data, lambda console: _render_dry_run(console, data))
        failed = failures(checks)
        if failed:
            why = "; ".join(f"{c.name}: {c.detail}" for c in failed)
            out.warn(f"serve would refuse now: {why}")
        return 0

    lock = port_lock(settings.lock_dir, settings.port, settings.host)
    lock.acquire()  # raises LockHeldError naming the holder's pid
    try:
        gathered = _gather(settings, device, allow_cold, lock_ours=True, environ=environ)
        checks = run_checks(gathered["inputs"])
        failed = failures(checks)
        doc = {"device": device, "checks": [c.to_dict() for c in checks]}
        if failed:
            out.emit({**doc, "started": False},
                     lambda console: _render_checks(console, checks))
            raise Sm70Error(
                "pre-flight failed, nothing was started: "
                + "; ".join(f"{c.name}: {c.detail}" for c in failed),
                hint=failed[0].hint,
            )
        if not json_mode:
            _render_checks(out.err, checks)
        for c in checks:
            if c.status == "warn":
                out.warn(f"{c.name}: {c.detail}")
        entry = entry_dir(settings.cache_dir, gathered["fingerprint"])
        lock.update(cache_entry=str(entry))  # so a warmup never rebuilds it under us
        env = managed_env(settings, device, entry, gathered["gpu_indices"],
                          allreduce=gathered["allreduce"])
        # From here on a stop signal only sets `stop`: the secrets file is written next and
        # must be removed on every way out, including a closed terminal (SIGHUP), so no
        # signal may end the process between its creation and the supervisor taking over.
        stop = threading.Event()
        received: list[str] = []

        def on_signal(signum: int, _frame: Any) -> None:
            received.append(signal.Signals(signum).name)
            stop.set()

        old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
        try:
            with secrets_file(settings) as secrets_path:
                argv = _server_argv(settings, gathered, secrets_path)
                return _launch(settings, out, argv, env, environ, secrets, restart, doc,
                               lock.path, stop, received)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    finally:
        lock.release()


def _launch(
    settings: SettingsView,
    out: Any,
    argv: list[str],
    managed: dict[str, str],
    environ: dict[str, str],
    secrets: list[str],
    restart: bool | None,
    doc: dict[str, Any],
    lock_path: Path,
    stop: threading.Event,
    received: list[str],
) -> int:
    from sm70ctl.runtime.command_line import base_url, redact_argv, shell_line
    from sm70ctl.runtime.environment import child_env, mask_env, unmanaged
    from sm70ctl.runtime.server import ServerLog, ServerSpec
    from sm70ctl.serve.supervisor import Events, supervise

    log_path = Path(settings.log_dir).expanduser() / f"serve-{settings.port}.log"
    echo = None if out.json_mode else (lambda line: out.err.print(line, markup=False,
                                                                  highlight=False))
    log = ServerLog(log_path, settings.log_max_bytes, settings.log_backups, echo=echo,
                    secrets=secrets)
    spec = ServerSpec(
        argv=argv,
        env=child_env(environ, managed),
        base_url=base_url(settings),
        api_key=settings.api_key.get_secret_value() if settings.api_key else None,
        startup_timeout=float(settings.startup_timeout),
        shutdown_grace=float(settings.shutdown_grace),
        restart=settings.restart if restart is None else restart,
        restart_backoff_max=float(settings.restart_backoff_max),
        healthy_reset=float(settings.healthy_reset),
    )
    shown = shell_line(redact_argv(argv))
    log.note(f"sm70ctl serve, pid {os.getpid()}, lock {lock_path}")
    log.note(f"command: {shown}")
    for k, v in sorted(mask_env(managed, secrets).items()):
        log.note(f"managed env: {k}={v}")
    inherited = unmanaged(environ, managed, secrets)
    for name, value, influential in inherited:
        log.note(f"inherited env (not managed){' [may affect vLLM]' if influential else ''}: "
                 f"{name}={value}")
    risky = [n for n, _, infl in inherited if infl]
    if risky:
        out.warn("inherited variables that may change vLLM's behaviour or its compile-cache "
                 f"key: {', '.join(risky)} (listed in {log_path})")
    out.info(f"command: {shown}")
    out.info(f"log: {log_path}")
    if out.json_mode:
        out.emit({**doc, "started": True, "command_line": shown, "log": str(log_path),
                  "url": spec.base_url})

    progress = _StartupProgress(out, spec.startup_timeout)
    events = Events(
        starting=lambda attempt, pid: out.info(
            f"starting vLLM (attempt {attempt}, pid {pid}); waiting for /health and /v1/models"
        ),
        tick=progress.tick,
        ready=lambda took: (progress.done(), out.success(
            f"ready after {took:.1f}s: {spec.base_url}/v1 (SIGINT/SIGTERM stops it)")),
        restarting=lambda failures, delay, why: (progress.done(), out.warn(
            f"{why}; restarting in {delay:g}s (consecutive failures: {failures})")),
        stopping=lambda: (progress.done(), out.info("stopping the server")),
    )
    try:
        if stop.is_set():  # asked to stop before the server was started
            log.note(f"received {', '.join(received)} before the start; nothing started")
            out.info("stopped before the server was started")
            return 0
        code = supervise(spec, log, stop, events)
        if received:
            log.note(f"received {', '.join(received)}")
        out.info("server stopped; port lock released")
        return code
    finally:
        progress.done()
        log.close()


class _StartupProgress:
    """A progress bar while the server starts (a line every 15 s when not a terminal)."""

    def __init__(self, out: Any, timeout: float) -> None:
        self.out = out
        self.timeout = timeout
        self._progress: Any = None
        self._task: Any = None
        self._last_line = 0.0
        self.tty = sys.stderr.isatty() and not out.json_mode

    def tick(self, elapsed: float, last: str) -> None:
        if self.tty:
            if self._progress is None:
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

                self._progress = Progress(
                    TextColumn("starting vLLM"), BarColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[last]}", style="dim"),
                    console=self.out.err, transient=True,
                )
                self._progress.start()
                self._task = self._progress.add_task("start", total=self.timeout, last="")
            self._progress.update(self._task, completed=elapsed, last=last[-70:])
        elif time.monotonic() - self._last_line >= 15:
            self._last_line = time.monotonic()
            self.out.info(f"waiting for the server: {elapsed:.0f}s of {self.timeout:g}s")

    def done(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
