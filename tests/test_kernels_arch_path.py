"""vllm_patch.ops.kernels' architecture path (CPU): the Python mirror follows set_arch_path,
reads the op once, and volta_path applies the C++ rule (below compute capability 8, or
forced), with the ops and torch.cuda replaced by recorders."""

from __future__ import annotations

import sys
import types

import pytest

from vllm_patch.ops import kernels


class _Ops:
    def __init__(self) -> None:
        self.path = "native"
        self.reads = 0

    def set_arch_path(self, path: str) -> None:
        self.path = path

    def arch_path(self) -> str:
        self.reads += 1
        return self.path


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch) -> _Ops:
    o = _Ops()
    monkeypatch.setattr(kernels, "_ops", lambda: o)
    monkeypatch.setattr(kernels, "_arch", [])
    monkeypatch.setattr(kernels, "_volta", {})
    caps = {0: (9, 0), 1: (7, 0), 2: (7, 5)}
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(get_device_capability=lambda i: caps[i])
    monkeypatch.setitem(sys.modules, "torch", fake)
    return o


def test_the_op_is_read_once_then_the_mirror_follows_set_arch_path(ops: _Ops) -> None:
    ops.path = "sm70"  # a process where the C++ side was set before the mirror existed
    assert kernels.arch_path() == "sm70" and kernels.arch_path() == "sm70"
    assert ops.reads == 1
    kernels.set_arch_path("native")
    assert ops.path == "native" and kernels.arch_path() == "native" and ops.reads == 1
    with pytest.raises(ValueError, match="arch path must be one of"):
        kernels.set_arch_path("sm75")
    assert kernels.arch_path() == "native"


def test_volta_path_is_below_capability_8_or_forced(ops: _Ops) -> None:
    assert [kernels.volta_path(i) for i in (0, 1, 2)] == [False, True, True]
    kernels.set_arch_path("sm70")
    assert kernels.volta_path(0) is True
    kernels.set_arch_path("native")
    assert kernels.volta_path(0) is False
