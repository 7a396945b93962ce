"""The one rendering layer: rich tables for people, JSON for machines.

Commands build plain data (dicts, lists, dataclasses turned into dicts) and hand it here
with a function that draws it for people. With `--json` only the data is printed, to
stdout, as one JSON document; diagnostics always go to stderr so that stdout stays
machine-readable.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

# rich is imported when something is drawn, not at start-up: a --json result or a one-line
# diagnostic into a pipe never needs it.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

# Status words used by every command that reports checks, and their colours.
STATUS_STYLE = {
    "pass": "green",
    "ok": "green",
    "warn": "yellow",
    "fail": "bold red",
    "skip": "dim",
    "info": "cyan",
}


DEFAULT_WIDTH = 160
MIN_WIDTH = 40


def _width(columns: str | None) -> int:
    """The console width off a terminal: $COLUMNS when it is a sane number, else 160
    (an empty, non-numeric or zero COLUMNS once crashed or silenced every command)."""
    try:
        width = int(columns) if columns is not None else DEFAULT_WIDTH
    except ValueError:
        return DEFAULT_WIDTH
    return max(width, MIN_WIDTH) if width > 0 else DEFAULT_WIDTH


def _console(stderr: bool) -> Console:
    from rich.console import Console

    # Deterministic output when not on a terminal (tests, pipes, CI logs): no colour
    # codes, a fixed width wide enough for our tables.
    width = None if sys.stdout.isatty() else _width(os.environ.get("COLUMNS"))
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


# What rich removes from printed text (bell, backspace, vertical tab, form feed, carriage
# return), removed from plain lines too so both paths print the same characters.
_CONTROL = str.maketrans("", "", "\a\b\v\f\r")


def _plain(stream: TextIO) -> bool:
    """Diagnostics go out as plain lines where rich would add no colour anyway."""
    forced = os.environ.get("FORCE_COLOR") or os.environ.get("TTY_COMPATIBLE") == "1"
    try:
        return not forced and not stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return True


class Output:
    """Renders a command's result either as rich text or as JSON."""

    # set once a JSON document went to stdout in this process: cli.main then adds no
    # error document after a result that was already printed (a plan that does not fit)
    json_emitted = False

    def __init__(self, json_mode: bool = False) -> None:
        self.json_mode = json_mode

    @functools.cached_property
    def out(self) -> Console:
        return _console(stderr=False)

    @functools.cached_property
    def err(self) -> Console:
        return _console(stderr=True)

    def _diagnostic(self, plain: str, markup: Callable[[], str] | None = None) -> None:
        """One diagnostic line on stderr: plain text into a pipe, rich markup on a terminal
        (`markup` None prints `plain` with no markup)."""
        if _plain(sys.stderr):
            sys.stderr.write(plain.translate(_CONTROL) + "\n")
            sys.stderr.flush()
        elif markup is None:
            self.err.print(plain, markup=False, soft_wrap=True)
        else:
            self.err.print(markup(), soft_wrap=True)

    # --- results -------------------------------------------------------------------
    def emit(self, data: Any, render: Callable[[Console], None] | None = None) -> None:
        """Print `data` as JSON in JSON mode, else call `render` (or pretty-print)."""
        if self.json_mode:
            sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
            sys.stdout.flush()
            Output.json_emitted = True
        elif render is not None:
            render(self.out)
        else:
            self.out.print_json(data=data, default=str)

    def line(self, plain: str, markup: Callable[[], str]) -> None:
        """A one-line human result on stdout: `plain` into a pipe, `markup()` through rich
        on a terminal (a single line needs no table, so a pipe never imports rich)."""
        if _plain(sys.stdout):
            sys.stdout.write(plain.translate(_CONTROL) + "\n")
            sys.stdout.flush()
        else:
            self.out.print(markup())

    # --- diagnostics (stderr) ----------------------------------------------------------
    # soft_wrap: a diagnostic stays one line whatever the width, so logs can be grepped
    def info(self, msg: str) -> None:
        self._diagnostic(msg)

    def success(self, msg: str) -> None:
        self._diagnostic(msg, lambda: f"[green]{escape(msg)}[/green]")

    def warn(self, msg: str) -> None:
        self._diagnostic(f"warning: {msg}", lambda: f"[yellow]warning:[/yellow] {escape(msg)}")

    def error(self, msg: str, hint: str | None = None) -> None:
        self._diagnostic(f"error: {msg}", lambda: f"[bold red]error:[/bold red] {escape(msg)}")
        if hint:
            self._diagnostic(f"  fix: {hint}", lambda: f"  [dim]fix:[/dim] {escape(hint)}")


def escape(text: str) -> str:
    """Make arbitrary text safe to embed in rich markup."""
    from rich.markup import escape as _escape

    return _escape(str(text))


def status_cell(status: str) -> str:
    style = STATUS_STYLE.get(status, "")
    return f"[{style}]{status}[/{style}]" if style else status


def make_table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    status_column: int | None = None,
) -> Table:
    """A plain rich table; cells are escaped, except the status column which is coloured."""
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            text = "" if cell is None else str(cell)
            cells.append(status_cell(text) if i == status_column else escape(text))
        table.add_row(*cells)
    return table
