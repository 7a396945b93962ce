"""The CLI as a whole: version, help with examples on every command, light imports."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
import typer.main
from typer.testing import CliRunner

from sm70ctl import __version__
from sm70ctl.cli import app

runner = CliRunner()


def _all_commands() -> list[tuple[str, ...]]:
    root = typer.main.get_command(app)
    found: list[tuple[str, ...]] = []

    def walk(cmd: click.Command, path: tuple[str, ...]) -> None:
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, (*path, name))
        else:
            found.append(path)

    walk(root, ())
    return found


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"sm70ctl {__version__}"


def test_there_are_commands() -> None:
    assert _all_commands(), "no command is wired in sm70ctl.cli"


@pytest.mark.parametrize("path", _all_commands(), ids=lambda p: " ".join(p))
def test_every_command_has_help_with_an_example(path: tuple[str, ...]) -> None:
    result = runner.invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "sm70ctl " + " ".join(path) in result.output, (
        f"`sm70ctl {' '.join(path)} --help` shows no worked example"
    )


def test_unknown_command_is_a_usage_error() -> None:
    result = runner.invoke(app, ["no-such-command"])
    assert result.exit_code == 2


def test_cli_import_pulls_no_heavy_modules() -> None:
    # `-X importtime` lists every module imported; torch, vllm and huggingface_hub must
    # wait until a command really needs them.
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import sm70ctl.cli"],
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    heavy = {m for m in imported if m.split(".")[0] in {"torch", "vllm", "huggingface_hub"}}
    assert not heavy, f"importing sm70ctl.cli imports {sorted(heavy)}"


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("SM70_")}
    base.update(env)
    return subprocess.run([sys.executable, "-m", "sm70ctl", *args], env=base,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("columns", ["abc", "", "0", "-5"])
def test_odd_columns_neither_crash_nor_silence_output(columns: str) -> None:
    # COLUMNS=abc was a ValueError traceback on every command; COLUMNS=0 printed nothing,
    # not even the error of a failing command
    r = _run(["env", "list"], COLUMNS=columns)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "SM70_MAX_MODEL_LEN" in r.stdout
    r = _run(["env", "explain", "SM70_NOPE"], COLUMNS=columns)
    assert r.returncode == 2
    assert r.stderr.startswith("error: unknown variable 'SM70_NOPE'")


def test_output_width_rule() -> None:
    from sm70ctl.output import DEFAULT_WIDTH, MIN_WIDTH, _width

    assert _width(None) == DEFAULT_WIDTH and _width("x") == DEFAULT_WIDTH
    assert _width("0") == DEFAULT_WIDTH and _width("-1") == DEFAULT_WIDTH
    assert _width("200") == 200 and _width("5") == MIN_WIDTH


def test_diagnostics_stay_one_line_on_stderr() -> None:
    # a long message and hint each print as one line (not wrapped at the console width),
    # on stderr, and markup in them is printed literally
    code = (
        "import sys; from sm70ctl.output import Output; o = Output(json_mode=True); "
        "o.emit({'ok': 1}); o.error('x' * 300 + ' [bold]y[/bold]', hint='h ' * 200); "
        "o.warn('w ' * 200); o.info('i ' * 200)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"COLUMNS": "50", "PATH": "/usr/bin:/bin"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == '{\n  "ok": 1\n}\n'
    lines = r.stderr.splitlines()
    assert len(lines) == 4, lines
    assert lines[0] == "error: " + "x" * 300 + " [bold]y[/bold]"
    assert lines[1].startswith("  fix: h h") and lines[2].startswith("warning: w w")


@pytest.mark.parametrize("args,needle", [
    (["plan", "--context", "0"], "error: Invalid value for '--context': 0 is not in the range"),
    (["plan", "--gpus"], "error: Option '--gpus' requires an argument."),
    (["no-such-command"], "error: No such command 'no-such-command'."),
    (["env", "explain"], "error: Missing argument 'NAME'."),
    (["doctor", "--record", "."], "error: Invalid value for '--record': File '.' is a directory."),
])
def test_click_usage_errors_are_one_line(args: list[str], needle: str) -> None:
    # Typer drew these as a usage line, a "Try" line and a boxed panel
    r = _run(args, COLUMNS="60")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines[0].startswith(needle), r.stderr
    assert len(lines) == 2 and lines[1].startswith("  fix: see `sm70ctl "), r.stderr


@pytest.mark.parametrize("args,env,code,needle", [
    (["plan", "--json"], {"SM70_PORT": "x"}, 1, "SM70_PORT='x'"),
    (["plan", "--json", "--context", "0"], {}, 2, "Invalid value for '--context'"),
])
def test_json_failures_print_a_json_document(args, env, code, needle) -> None:
    # a script parsing --json output gets a document on stdout even when the command
    # failed before its result; humans still get the error line on stderr
    import json

    r = _run(args, **env)
    assert r.returncode == code
    doc = json.loads(r.stdout)
    assert needle in doc["error"]["message"] and doc["error"]["exit_code"] == code
    assert doc["error"]["fix"]
    assert r.stderr.startswith("error: ")


def test_exit_codes_pass_through_main() -> None:
    assert _run(["--version"]).returncode == 0
    assert _run(["plan", "--help"]).returncode == 0
    assert _run(["env", "explain", "SM70_PORT", "--json"]).returncode == 0
    # typer.Exit(1) from a command, and no arguments at all (help, usage exit 2)
    assert _run(["env", "check"], SM70_PORT="x").returncode == 1
    r = _run([])
    assert r.returncode == 2 and "Usage: sm70ctl" in r.stdout
