"""The pydantic model of the settings, built from the schema when this module is imported.

Each schema entry becomes one field whose validator parses the environment spelling
("9.9GiB", "30s", "1,2,4,8") and checks the entry's constraints, so the schema stays the
only place a variable is described. Values are read only from what `load_settings` hands
over (never straight from os.environ), so sources can be tracked and checked. That is
also why it is a plain pydantic model, not a pydantic-settings one: load_settings is the
only source, and importing pydantic-settings would cost a short command a sixth of its
start-up.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Optional

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    create_model,
)
from pydantic_core import PydanticCustomError

from sm70ctl.readers import NAME_MAX, PATH_MAX, path_problem
from sm70ctl.secrets import MASK
from sm70ctl.settings import values as V
from sm70ctl.settings.schema import VarSpec, load_schema

__all__ = ["Settings", "convert", "display", "python_type"]

PATH_LIMITS = f"components of at most {NAME_MAX} bytes, at most {PATH_MAX} bytes in all"


def _scalar(spec: VarSpec, kind: str, text: str) -> Any:
    if kind == "bool":
        return V.parse_bool(text)
    if kind == "int":
        return V.parse_int(text)
    if kind == "float":
        return V.parse_float(text)
    if kind == "bytes":
        return V.parse_bytes(text)
    if kind == "duration":
        return V.parse_duration(text)
    if kind == "path":
        limits = f"a path such as /srv/models ({PATH_LIMITS})"
        if (problem := path_problem(text.strip())) is not None:
            raise V.BadValue(problem, limits)
        try:
            path = Path(text.strip()).expanduser()
        except RuntimeError:  # ~user for a user that does not exist
            raise V.BadValue("cannot expand the ~ in this path", "an absolute path, or "
                             "~/... for the current user") from None
        if (problem := path_problem(path)) is not None:  # ~ may expand past the limit
            raise V.BadValue(problem, limits)
        return path
    return text.strip()  # enum, string


def _show(spec: VarSpec, kind: str, value: Any) -> str:
    if kind == "bytes":
        return V.format_bytes(value)
    if kind == "duration":
        return V.format_duration(value)
    return str(value)


def _bounds(spec: VarSpec, kind: str) -> tuple[Any, Any]:
    lo = _scalar(spec, kind, spec.min) if spec.min is not None else None
    hi = _scalar(spec, kind, spec.max) if spec.max is not None else None
    return lo, hi


def _range_text(spec: VarSpec, kind: str) -> str:
    lo, hi = _bounds(spec, kind)
    parts = []
    if lo is not None:
        parts.append(f">= {_show(spec, kind, lo)}")
    if hi is not None:
        parts.append(f"<= {_show(spec, kind, hi)}")
    return " and ".join(parts)


def _check_scalar(spec: VarSpec, kind: str, text: str) -> Any:
    """Parse one scalar and apply range, step, choices and pattern."""
    try:
        value = _scalar(spec, kind, text)
    except V.BadValue as exc:
        if kind in ("bytes", "duration"):
            raise
        raise V.BadValue(exc.rule, _allowed(spec)) from None
    if spec.choices is not None:
        typed = {c: _scalar(spec, kind, c) for c in spec.choices}
        if value not in typed.values():
            why = f" ({spec.rule})" if spec.rule else ""
            raise V.BadValue(f"not one of the allowed choices{why}", ", ".join(spec.choices))
    lo, hi = _bounds(spec, kind)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        # SM70_GPU_BUSY_MIB=500 reads as 500 bytes: say so, the name suggests MiB
        bare = kind == "bytes" and text.strip().isdigit()
        note = f" ({value:,} B: a size without a unit is bytes)" if bare else ""
        raise V.BadValue(f"out of range{note}", _range_text(spec, kind))
    if spec.multiple_of and value % spec.multiple_of:
        raise V.BadValue(
            f"not a multiple of {spec.multiple_of}",
            f"0 or a multiple of {spec.multiple_of}, {_range_text(spec, kind)}",
        )
    pattern = spec.item_pattern if spec.type == "list" else spec.pattern
    if pattern and not re.fullmatch(pattern, str(value)):
        raise V.BadValue("does not match the expected format", f"text matching {pattern}")
    return value


def convert(spec: VarSpec, raw: Any) -> Any:
    """Environment text (or an already-typed value) -> the typed value, else `BadValue`."""
    if isinstance(raw, SecretStr):
        raw = raw.get_secret_value()
    if raw is None:
        raw = ""
    if isinstance(raw, (list, tuple)):
        raw = ",".join(str(x) for x in raw)
    elif isinstance(raw, bool):
        raw = "true" if raw else "false"
    text = str(raw)
    if not text.strip():
        if spec.nullable:
            return None
        default = MASK if spec.secret else spec.default
        raise V.BadValue("empty value", f"unset it to use the default {default!r}, or "
                         f"set a value ({_allowed(spec)})")
    if spec.type == "list":
        items = [t.strip() for t in text.split(",")]
        if any(not t for t in items):
            raise V.BadValue("empty list item", _allowed(spec))
        kind = spec.item or "string"
        value = [_check_scalar(spec, kind, t) for t in items]
        if spec.min_items is not None and len(value) < spec.min_items:
            raise V.BadValue(f"fewer than {spec.min_items} items", _allowed(spec))
        if spec.max_items is not None and len(value) > spec.max_items:
            raise V.BadValue(f"more than {spec.max_items} items", _allowed(spec))
        if spec.unique and len(set(value)) != len(value):
            raise V.BadValue("repeated items", _allowed(spec))
        return value
    value = _check_scalar(spec, spec.type, text)
    if spec.secret:
        return SecretStr(value)
    return value


def _allowed(spec: VarSpec) -> str:
    """A short description of what the variable accepts."""
    kind = spec.item if spec.type == "list" else spec.type
    if spec.choices:
        base = "one of " + ", ".join(spec.choices)
    else:
        base = {
            "bool": "true or false",
            "int": "an integer",
            "float": "a number",
            "bytes": "a byte size (e.g. 512MiB, 9.9GiB)",
            "duration": "a duration (e.g. 30s, 5m)",
            "path": "a path",
            "string": "text",
            "enum": "a choice",
        }.get(kind or "string", "text")
        rng = _range_text(spec, kind or "string") if spec.min or spec.max else ""
        if rng:
            base += f" {rng}"
        if spec.multiple_of:
            base += f", a multiple of {spec.multiple_of}"
        pattern = spec.item_pattern if spec.type == "list" else spec.pattern
        if pattern:
            base += f" matching {pattern}"
    if spec.type == "list":
        base = f"comma-separated items, each {base}"
    if spec.nullable:
        base += "; empty for none"
    return base


def allowed_text(spec: VarSpec) -> str:
    return _allowed(spec)


def python_type(spec: VarSpec) -> Any:
    base: Any = {
        "bool": bool,
        "int": int,
        "float": float,
        "bytes": int,
        "duration": float,
        "enum": str,
        "path": Path,
        "string": str,
    }.get(spec.type)
    if spec.type == "list":
        base = list[int] if spec.item == "int" else list[str]
    if spec.type == "enum" and spec.choices and all(c.lstrip("-").isdigit() for c in spec.choices):
        base = int
    if spec.secret:
        base = SecretStr
    if spec.nullable:
        base = Optional[base]  # noqa: UP045 - a runtime type object, built dynamically
    return base


def display(spec: VarSpec, value: Any) -> str:
    """A typed value back in its environment spelling (secrets masked)."""
    if value is None:
        return ""
    if spec.secret:
        return MASK
    kind = spec.item if spec.type == "list" else spec.type
    if isinstance(value, list):
        return ",".join(_show(spec, kind or "string", v) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if kind == "bytes":
        return str(value)
    return _show(spec, kind or "string", value)


def _validator(spec: VarSpec):
    def check(raw: Any) -> Any:
        try:
            return convert(spec, raw)
        except V.BadValue as exc:
            raise PydanticCustomError(
                "sm70_value", "{rule}", {"rule": exc.rule, "allowed": exc.allowed}
            ) from None

    return check


class SettingsBase(BaseModel):
    """Shared behaviour of the generated model: immutable, sources recorded."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        validate_default=True,
        protected_namespaces=(),
        arbitrary_types_allowed=True,
    )
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    def source_of(self, name: str) -> str:
        """'default', 'environment' or 'file:<path>' for a variable name or attribute."""
        key = name if name.startswith("SM70_") else "SM70_" + name.upper()
        return self._sources.get(key, "default")

    def env_text(self, name: str) -> str:
        """The effective value of a variable in its environment spelling (secrets masked)."""
        spec = load_schema().get(name)
        if spec is None:
            raise KeyError(name)
        return display(spec, getattr(self, spec.attr))


def _build() -> type[SettingsBase]:
    schema = load_schema()
    fields: dict[str, Any] = {}
    for spec in schema.variables:
        annotated = Annotated[python_type(spec), BeforeValidator(_validator(spec))]
        fields[spec.attr] = (annotated, Field(default=spec.default, description=spec.summary))
    return create_model("Settings", __base__=SettingsBase, __module__=__name__, **fields)


Settings = _build()
