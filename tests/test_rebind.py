"""vllm_patch/rebind.py: the check that a rebinding's target is still the function it was
written against (pure: plain functions stand in for vLLM's methods)."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_patch import rebind

T = rebind.Target(module="m", owner="C", attr="f", version="0.22.1", params=("self", "x"),
                  names=frozenset({"helper"}), mark="__mark__")


def helper() -> None:
    return None


def good(self: Any, x: int) -> None:
    helper()


def renamed(self: Any, y: int) -> None:
    helper()


def lost_name(self: Any, x: int) -> None:
    return None


class Mine(rebind.RebindError):
    pass


def test_the_expected_target_passes() -> None:
    rebind.check(T, good, "0.22.1")
    rebind.check(T, good, "0.22.1+cu128")  # a local build tag is the same release


@pytest.mark.parametrize(("func", "version", "says"), [
    (good, "0.23.0", "vLLM is 0.23.0"),
    (renamed, "0.22.1", "parameters ('self', 'y')"),
    (lost_name, "0.22.1", "no longer uses ['helper']"),
    (len, "0.22.1", "not a function"),
])
def test_anything_else_is_refused_naming_what_differs(func: Any, version: str,
                                                      says: str) -> None:
    with pytest.raises(Mine, match=r"m\.C\.f: ") as got:
        rebind.check(T, func, version, Mine)
    assert says in str(got.value) and "\n" not in str(got.value)


def test_defer_keeps_one_hook_per_mark_and_one_for_each_mark(monkeypatch: Any) -> None:
    import sys

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = len(sys.meta_path)
    rebind.defer("some.module", "__a__", lambda: None)
    rebind.defer("some.module", "__a__", lambda: None)  # a second register(): no new hook
    rebind.defer("some.module", "__b__", lambda: None)  # another rebinding of the module
    marks = [getattr(f, "_sm70_mark", None) for f in sys.meta_path[: len(sys.meta_path) - before]]
    assert sorted(marks) == ["__a__", "__b__"]
