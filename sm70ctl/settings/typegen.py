"""Writes sm70ctl/settings/typed.py, the typed face of the settings, from env_schema.yaml.

The pydantic model is built from the schema at import, so neither a type checker nor a
reader can see its attributes; typed.py spells them out as a `Protocol` with one annotated
attribute per variable. This module renders that file (pure) and writes or checks it:

    python -m sm70ctl.settings.typegen          # rewrite typed.py
    python -m sm70ctl.settings.typegen --check  # exit 1 when typed.py is stale

tests/test_settings_typed.py fails when the committed file drifts from the schema.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sm70ctl.settings.schema import Schema, VarSpec, load_schema

TYPED_PATH = Path(__file__).with_name("typed.py")

_BASE = {
    "bool": "bool",
    "int": "int",
    "float": "float",
    "bytes": "int",
    "duration": "float",
    "path": "Path",
    "string": "str",
}


def annotation(spec: VarSpec) -> str:
    """The attribute's type as source text: what the pydantic model holds for it."""
    if spec.secret:
        base = "SecretStr"
    elif spec.type == "list":
        base = "list[int]" if spec.item == "int" else "list[str]"
    elif spec.type == "enum":
        assert spec.choices, spec.name  # the schema loader rejects an enum without choices
        if all(c.lstrip("-").isdigit() for c in spec.choices):
            base = f"Literal[{', '.join(spec.choices)}]"
        else:
            base = f"Literal[{', '.join(json.dumps(c) for c in spec.choices)}]"
    else:
        base = _BASE[spec.type]
    return f"{base} | None" if spec.nullable else base


_HEADER = '''"""The settings as a type checker and a reader see them (GENERATED, do not edit).

Written by `python -m sm70ctl.settings.typegen` from env_schema.yaml: one attribute per
SM70_* variable (the name lower-cased without SM70_). `load_settings` returns an object of
this shape; code that takes settings annotates the parameter `SettingsView`. Importing this
module costs nothing at start-up (no pydantic).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from pydantic import SecretStr


class SettingsView(Protocol):
    """The validated, immutable SM70_* settings (see sm70ctl.settings)."""'''

_FOOTER = '''
    def source_of(self, name: str) -> str:
        """'default', 'environment' or 'file:<path>' for a variable name or attribute."""
        ...

    def env_text(self, name: str) -> str:
        """The effective value of a variable in its environment spelling (secrets masked)."""
        ...

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> SettingsView:
        """A copy with some attributes replaced (values are not validated again)."""
        ...
'''


def render(schema: Schema | None = None) -> str:
    schema = schema or load_schema()
    lines = [_HEADER]
    current = None
    for spec in schema.variables:
        if spec.category != current:
            current = spec.category
            lines.append(f"\n    # {schema.categories[current].title}")
        lines.append(f"    {spec.attr}: {annotation(spec)}")
    lines.append(_FOOTER)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    current = TYPED_PATH.read_text(encoding="utf-8") if TYPED_PATH.exists() else None
    if "--check" in args:
        if current != text:
            print(f"{TYPED_PATH} is stale: run `python -m sm70ctl.settings.typegen`",
                  file=sys.stderr)
            return 1
        return 0
    if current != text:
        TYPED_PATH.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
