"""Dataclasses to and from JSON-able dicts, so probe data can be recorded and replayed.

Loading is forgiving about versions on purpose: a record from an older or newer sm70ctl
(missing or extra keys) still loads, with defaults for what is missing, because a bug
report must be readable even when the reporter runs another version. It is strict about
types: a value of the wrong type (`null` where a string belongs, a string where a list
belongs) is a RecordError naming the field, since checks downstream would trip on it.

Writing goes through the one masking rule: a record is made to be attached to a bug
report, so nothing secret may be in it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

from sm70ctl.secrets import scrub

T = TypeVar("T")

# Records the tool writes nest a few levels; deeper input is refused before recursing.
MAX_DEPTH = 32


class RecordError(ValueError):
    """The data does not have the shape of the record it should be."""


def to_dict(obj: Any, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """A dataclass as a JSON-able dict, with secret-named values and `secrets` masked."""
    return scrub(dataclasses.asdict(obj), secrets)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list"}.get(type(value), type(value).__name__)


def from_dict(cls: type[T], data: Any, where: str = "", _depth: int = 0) -> T:
    if not isinstance(data, dict):
        raise RecordError(f"{where or cls.__name__}: expected an object, got {_type_name(data)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in data:
            kwargs[field.name] = _coerce(
                hints[field.name], data[field.name], f"{where}.{field.name}", _depth + 1
            )
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # a required field missing
        raise RecordError(f"{where or cls.__name__}: {exc}") from None


def _coerce(tp: Any, value: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise RecordError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise RecordError(f"{where}: expected a value, got null")
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where, depth)
            except RecordError as exc:
                errors.append(str(exc))
        raise RecordError(errors[0] if len(errors) == 1 else
                          f"{where}: {_type_name(value)} fits none of its types")
    if value is None:
        raise RecordError(f"{where}: expected {_expected(tp)}, got null")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RecordError(f"{where}: expected a list, got {_type_name(value)}")
        args = typing.get_args(tp)
        if origin is tuple and args and (len(args) != 2 or args[1] is not Ellipsis):
            if len(value) != len(args):
                raise RecordError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{where}[{i}]", depth + 1)
                         for i, (a, v) in enumerate(zip(args, value, strict=True)))
        arg = args[0] if args else Any
        items = [_coerce(arg, v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {_type_name(value)}")
        args = typing.get_args(tp)
        key_t, val_t = args if len(args) == 2 else (Any, Any)
        return {_coerce(key_t, k, f"{where} key", depth + 1):
                _coerce(val_t, v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where, depth)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise RecordError(f"{where}: expected {tp.__name__}, got bool")
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise RecordError(f"{where}: expected {tp.__name__}, got {_type_name(value)}")
    if origin is typing.Literal and value not in typing.get_args(tp):
        raise RecordError(f"{where}: {value!r} is not one of {typing.get_args(tp)}")
    return value


def _expected(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)
