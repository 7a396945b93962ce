"""How the benches write what they measured: the JSON result (rewritten as rows come in, so
a run cut short keeps what it had), a markdown table beside it (and its cells), and the JSON
of a run that failed before any row; the command line every tensor-core bench starts from
(pure Python: no torch)."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any


def write_json(path: Path, doc: Any, indent: int | None = 1, newline: bool = False) -> None:
    """`doc` as JSON to `path` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + ("\n" if newline else ""))


def write_result(path: Path, result: dict[str, Any],
                 markdown: Callable[[list[dict[str, Any]]], str] | None = None) -> None:
    """The result's JSON, and with `markdown` its rows' table beside it (same name, .md)."""
    write_json(path, result)
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown(result["rows"]))


def write_failure(path: Path, error: Any) -> None:
    """The JSON of a run that stopped before its rows: no rows, the one error."""
    write_json(path, {"rows": [], "errors": [error]}, indent=None)


def md_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: a header, a `---` separator per column, one line per row (the
    cells as given, already formatted)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def cell(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """A table cell: scale x value in format `spec`, then `suffix`; "-" when there is no
    value (pure)."""
    return "-" if value is None else f"{scale * value:{spec}}{suffix}"


def parse_tokens(text: str) -> list[int]:
    """'8192,16384' -> [8192, 16384]; an error naming the value otherwise (pure)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--tokens {text!r}: comma-separated integers expected") from None
    if not out or min(out) <= 0:
        raise ValueError(f"--tokens {text!r}: positive token counts expected")
    return out


def tensor_core_parser(doc: str, tokens: str, tokens_help: str) -> argparse.ArgumentParser:
    """A tensor-core bench's command line before its own options: --out (the JSON, the .md
    table beside it), --tokens (default `tokens`) and --budget-s; the description is the
    first paragraph of the bench's docstring `doc`."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file (a .md table is written beside)")
    ap.add_argument("--tokens", default=tokens, help=tokens_help)
    ap.add_argument("--budget-s", type=float, default=600.0)
    return ap


def new_result(what: str, device: str, shape: dict[str, Any]) -> dict[str, Any]:
    """A tensor-core bench's result before its rows: what, where, the command line that ran
    it and the shape; rows and errors to come."""
    return {"what": what, "device": device, "command": " ".join(["python3", *sys.argv]),
            "shape": shape, "rows": [], "errors": []}


def run_and_report(run: Callable[[Any], dict[str, Any]], args: Any,
                   markdown: Callable[[list[dict[str, Any]]], str]) -> int:
    """run(args), then its rows' table on stdout; exit code 1 when it recorded errors. An
    exception (no GPU, no ops) still leaves `args.out` saying why, then propagates."""
    try:
        result = run(args)
    except Exception:
        write_failure(Path(args.out), traceback.format_exc())
        raise
    print(markdown(result["rows"]))
    return 0 if not result["errors"] else 1
