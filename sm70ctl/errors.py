"""Expected failures, each turned into a one-line message and an exit code by `cli.main`.

Code deep in the package raises these instead of printing or exiting, so the CLI is the
one place that decides how a failure looks. Anything else escaping is a bug and keeps its
traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2


class Sm70Error(Exception):
    """A failure the user can act on: `message` says what, `hint` how to fix it."""

    exit_code = EXIT_FAIL

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(Sm70Error):
    """Bad command-line input (exit 2, like Click's own usage errors)."""

    exit_code = EXIT_USAGE
