"""Option declarations shared by every command, so each is declared once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
EnvFileOpt = Annotated[
    Optional[Path],  # noqa: UP045 - Typer 0.25 needs Optional on Python 3.10
    typer.Option(
        "--env-file",
        help="Read SM70_* settings from this .env file (the environment still wins).",
        exists=False,
        dir_okay=False,
    ),
]
