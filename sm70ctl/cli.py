"""The command-line entry point: every command group is wired here, and only here.

Command modules are imported at start-up, so they must stay light: torch, vLLM and
huggingface_hub are imported inside the functions that need them.
"""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn, Optional

import typer

from sm70ctl import __version__
from sm70ctl.errors import EXIT_USAGE, Sm70Error

app = typer.Typer(
    name="sm70ctl",
    help=(
        "Build, plan and serve Qwen3.8-27B through vLLM on two NVIDIA V100 (sm_70) GPUs.\n\n"
        "Start with `sm70ctl doctor` (can this machine run the stack?) and `sm70ctl plan` "
        "(what fits in GPU memory)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sm70ctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],  # noqa: UP045 - Typer 0.25 needs Optional on Python 3.10
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = None,
) -> None:
    """sm70ctl: the Volta serving stack."""


def _wire() -> None:
    # One line per command module; each module's `register(app)` adds its commands.
    # Each helper/feature adds exactly one import + register line here.
    from sm70ctl.doctor import command as doctor_cmd
    doctor_cmd.register(app)
    from sm70ctl.weights import command as weights_cmd
    weights_cmd.register(app)
    from sm70ctl.plan import command as plan_cmd
    plan_cmd.register(app)
    from sm70ctl.settings import command as env_cmd
    env_cmd.register(app)
    from sm70ctl.build import command as build_cmd
    build_cmd.register(app)
    from sm70ctl.serve import command as serve_cmd
    serve_cmd.register(app)
    from sm70ctl.warmup import command as warmup_cmd
    warmup_cmd.register(app)


_wire()


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; expected failures become one line on stderr and an exit code.

    Click's own usage errors (a bad option value, an unknown command) get the same
    `error:` / `fix:` lines as ours instead of Typer's multi-line boxed panel."""
    import click

    from sm70ctl.output import Output

    # a command asked for --json gets its failure as a JSON document on stdout too, so a
    # script parsing the output has one even when the command failed before its result
    out = Output(json_mode="--json" in (sys.argv[1:] if argv is None else argv))

    def fail(msg: str, hint: str | None, code: int) -> NoReturn:
        out.error(msg, hint)
        if out.json_mode and not Output.json_emitted:
            out.emit({"error": {"message": msg, "fix": hint, "exit_code": code}})
        sys.exit(code)

    try:
        rv = app(args=argv, prog_name="sm70ctl", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        sys.exit(exc.exit_code)  # the help has been printed: nothing was asked yet
    except click.ClickException as exc:
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "sm70ctl"
        fail(exc.format_message(), f"see `{where} --help`", exc.exit_code)
    except click.Abort:
        fail("aborted", None, 1)
    except Sm70Error as exc:
        fail(exc.message, exc.hint, exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", None, 130)
    # without standalone mode Click returns the exit code (typer.Exit, --help) or None
    sys.exit(rv if isinstance(rv, int) else 0)


__all__ = ["EXIT_USAGE", "app", "main"]
