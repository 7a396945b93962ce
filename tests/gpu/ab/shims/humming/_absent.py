"""Placeholder names for the humming stand-in (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def absent_module_getattr(module: str) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        class _Absent:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise RuntimeError(f"{module}.{name}: humming-kernels is not installed here")

            def __class_getitem__(cls, item: Any) -> type:
                return cls

        _Absent.__name__ = _Absent.__qualname__ = name
        return _Absent

    return __getattr__
