"""sm70ctl/settings/typed.py (SettingsView) against env_schema.yaml and the pydantic model.

The file is generated (`python -m sm70ctl.settings.typegen`); these tests fail when it drifts
from the schema (a variable added, renamed, retyped) or when its annotations stop describing
what `load_settings` actually returns.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import SecretStr

from sm70ctl.settings import load_schema, load_settings, typegen
from sm70ctl.settings.typed import SettingsView

SCHEMA = load_schema()
REPO = Path(__file__).resolve().parents[1]


def _annotations() -> dict[str, Any]:
    names = {"Path": Path, "SecretStr": SecretStr, "Literal": Literal}
    return {k: eval(v, names) for k, v in SettingsView.__annotations__.items()}


def conforms(value: Any, tp: Any) -> bool:
    """Whether `value` is of the annotated type (bool is not an int here)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return any(conforms(value, t) for t in typing.get_args(tp))
    if origin is Literal:
        return any(value == c and type(value) is type(c) for c in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(conforms(v, item) for v in value)
    if tp is type(None):
        return value is None
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, float)
    return isinstance(value, tp)


def test_the_committed_file_is_current() -> None:
    assert typegen.TYPED_PATH.read_text(encoding="utf-8") == typegen.render(), (
        "sm70ctl/settings/typed.py is stale: run `python -m sm70ctl.settings.typegen`")


def test_one_attribute_per_variable_in_schema_order() -> None:
    assert list(SettingsView.__annotations__) == [v.attr for v in SCHEMA.variables]


def test_the_defaults_have_the_annotated_types() -> None:
    settings = load_settings({})
    wrong = {name: (getattr(settings, name), tp) for name, tp in _annotations().items()
             if not conforms(getattr(settings, name), tp)}
    assert wrong == {}


def test_every_example_has_the_annotated_type() -> None:
    annotations = _annotations()
    for spec in SCHEMA.variables:
        assert spec.example is not None, spec.name
        value = getattr(load_settings({spec.name: spec.example, **spec.example_with}),
                        spec.attr)
        assert conforms(value, annotations[spec.attr]), (spec.name, value)


def test_nullable_variables_admit_none() -> None:
    annotations = _annotations()
    for spec in SCHEMA.variables:
        assert conforms(None, annotations[spec.attr]) == spec.nullable, spec.name


@pytest.mark.parametrize(("change", "expect"), [
    ({"type": "int"}, "    port: int"),  # unchanged type: same line
    ({"type": "string"}, "    port: str"),
    ({"nullable": True}, "    port: int | None"),
    ({"type": "enum", "choices": ("1", "3")}, "    port: Literal[1, 3]"),
    ({"type": "enum", "choices": ("a", "b")}, '    port: Literal["a", "b"]'),
    ({"type": "list", "item": "int"}, "    port: list[int]"),
    ({"secret": True}, "    port: SecretStr"),
])
def test_render_follows_the_schema(change: dict[str, Any], expect: str) -> None:
    variables = tuple(dataclasses.replace(v, **change) if v.name == "SM70_PORT" else v
                      for v in SCHEMA.variables)
    text = typegen.render(dataclasses.replace(SCHEMA, variables=variables))
    assert expect in text.splitlines()
    if change != {"type": "int"}:
        assert text != typegen.TYPED_PATH.read_text(encoding="utf-8")


def test_check_mode_reports_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "typed.py"
    stale.write_text(typegen.render().replace("    port: int\n", ""), encoding="utf-8")
    monkeypatch.setattr(typegen, "TYPED_PATH", stale)
    assert typegen.main(["--check"]) == 1
    assert typegen.main([]) == 0 and stale.read_text(encoding="utf-8") == typegen.render()
    assert typegen.main(["--check"]) == 0


def test_importing_typed_costs_no_pydantic() -> None:
    code = ("import sys, sm70ctl.settings.typed; "
            "print([m for m in sys.modules if m.split('.')[0] == 'pydantic'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
