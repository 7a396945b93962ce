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
