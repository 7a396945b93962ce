"""`sm70ctl warmup`: fill the compile caches for the current settings, or check them."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Annotated, Any

import typer

from sm70ctl.options import EnvFileOpt, JsonOpt
from sm70ctl.settings.typed import SettingsView

HELP = (
    "Compile everything the server needs before it serves, so the first request never "
    "waits for a build.\n\n"
    "Builds our sm_70 kernels and starts vLLM once (through SM70_SERVE_PYTHON) so Triton, "
    "TorchInductor and vLLM fill their caches under SM70_CACHE_DIR/<fingerprint>, then starts "
    "it again in a fresh process and checks nothing is compiled again. The fingerprint "
    "hashes csrc/, vllm_patch/, the compilers, the torch/vLLM/Triton versions of the serving "
    "interpreter and every compile-affecting setting. Work this machine cannot do (no V100) "
    "is reported as skipped and the cache stays cold.\n\n"
    "Examples:\n\n"
    "    sm70ctl warmup                 # build and verify (minutes cold)\n\n"
    "    sm70ctl warmup --check         # warm or cold, and why (under 3 s); exit 1 when cold\n\n"
    "    sm70ctl warmup --check --json  # the verdict and the fingerprint components"
)

CheckOpt = Annotated[bool, typer.Option("--check", help="Only say warm or cold, and why.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Warm again even when already warm.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cuda (the V100s) or cpu.")]


def register(app: typer.Typer) -> None:
    @app.command("warmup", help=HELP)
    def warmup(
        env_file: EnvFileOpt = None,
        check: CheckOpt = False,
        force: ForceOpt = False,
        device: DeviceOpt = "cuda",
        json_mode: JsonOpt = False,
    ) -> None:
        from sm70ctl.errors import UsageError
        from sm70ctl.settings import load_settings

        if device not in ("cuda", "cpu"):
            raise UsageError(f"--device {device}: expected cuda or cpu")
        settings = load_settings(env_file=env_file)
        code = run_check(settings, device, json_mode) if check else run(
            settings, device, force, json_mode)
        if code:
            raise typer.Exit(code)


def run_check(settings: SettingsView, device: str, json_mode: bool) -> int:
    from sm70ctl.output import Output
    from sm70ctl.runtime.cache_status import cache_status

    start = time.perf_counter()
    verdict, comps = cache_status(settings, device, os.environ)
    data = {
        "warm": verdict.warm,
        "fingerprint": verdict.fingerprint,
        "reason": verdict.reason,
        "changed": list(verdict.changed),
        "components": comps,
        "seconds": round(time.perf_counter() - start, 3),
    }
    out = Output(json_mode)

    def markup() -> str:
        from sm70ctl.output import escape

        word = "[green]warm[/green]" if verdict.warm else "[bold red]cold[/bold red]"
        return f"{word} {escape(f'[{verdict.fingerprint}]')}: {escape(verdict.reason)}"

    if json_mode:
        out.emit(data)
    else:
        word = "warm" if verdict.warm else "cold"
        out.line(f"{word} [{verdict.fingerprint}]: {verdict.reason}", markup)
    return 0 if verdict.warm else 1


def run(settings: SettingsView, device: str, force: bool, json_mode: bool) -> int:
    from sm70ctl.output import Output, make_table
    from sm70ctl.warmup.runner import Reporter, RunContext, run_warmup

    out = Output(json_mode)
    bars = _Bars(out)
    reporter = Reporter(step_started=bars.start, step_tick=bars.tick, step_done=bars.done,
                        note=out.info)
    ctx = RunContext(settings=settings, device=device, environ=dict(os.environ),
                     reporter=reporter, stop=threading.Event())

    def on_signal(signum: int, _frame: Any) -> None:
        ctx.stop.set()

    # SIGHUP too: a closed terminal must clean up like Ctrl-C, not die mid-build.
    old = {s: signal.signal(s, on_signal)
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        manifest = run_warmup(ctx, force=force)
    finally:
        bars.close()
        for s, h in old.items():
            signal.signal(s, h)
    data = manifest.to_dict()

    def render(console: Any) -> None:
        rows = [(s.name, s.status, f"{s.seconds:.0f}s" if s.seconds else "", s.detail)
                for s in manifest.steps]
        console.print(make_table(f"warmup {manifest.fingerprint}",
                                 ["step", "status", "time", "detail"], rows))
        if manifest.warm and all(s.status == "not needed" for s in manifest.steps):
            console.print("[green]warm[/green]: nothing to compile for these settings")
        elif manifest.warm:
            console.print("[green]warm[/green]: the cache is filled and verified")
        else:
            console.print("[bold red]cold[/bold red]: some steps could not run here "
                          "(see above); the cache is not marked warm")

    out.emit(data, render)
    return 0 if manifest.warm else 1


_STATUS = {"done": "ok", "not needed": "skip", "skipped": "warn", "failed": "fail"}


class _Bars:
    """One progress line per running step (spinner and elapsed time), on stderr."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.progress: Any = None
        self.tasks: dict[str, Any] = {}
        self.tty = sys.stderr.isatty() and not out.json_mode

    def start(self, name: str, what: str) -> None:
        if not self.tty:
            self.out.info(f"warmup: {name}: {what}")
            return
        if self.progress is None:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                     TimeElapsedColumn(),
                                     TextColumn("{task.fields[last]}", style="dim"),
                                     console=self.out.err)
            self.progress.start()
        self.tasks[name] = self.progress.add_task(f"{name}: {what}", total=None, last="")

    def tick(self, name: str, elapsed: float, last: str) -> None:
        if self.progress is not None and name in self.tasks:
            self.progress.update(self.tasks[name], last=last[-60:])

    def done(self, step: Any) -> None:
        if self.progress is not None and step.name in self.tasks:
            self.progress.update(self.tasks[step.name], total=1, completed=1,
                                 description=f"{step.name}: {step.status}", last="")
        elif not self.tty:
            self.out.info(f"warmup: {step.name}: {step.status}"
                          + (f" ({step.detail})" if step.detail else ""))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
