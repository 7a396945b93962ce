"""Dataclasses to and from JSON-able dicts, so probe data can be recorded and replayed.

Loading is forgiving on purpose: a record from an older or newer sm70ctl (missing or extra
keys) still loads, with defaults for what is missing, because a bug report must be
readable even when the reporter runs another version.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class RecordError(ValueError):
    """The data does not have the shape of the record it should be."""


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    if not isinstance(data, dict):
        raise RecordError(f"{where or cls.__name__}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in data:
            kwargs[field.name] = _coerce(
                hints[field.name], data[field.name], f"{where}.{field.name}"
            )
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(args[0], value, where) if len(args) == 1 else value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RecordError(f"{where}: expected a list, got {type(value).__name__}")
        arg = typing.get_args(tp)[0]
        items = [_coerce(arg, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is float and isinstance(value, int):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise RecordError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value
