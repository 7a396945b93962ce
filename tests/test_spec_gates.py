"""R10 (vllm_patch/gdn/spec_gates.py): the wrapper hands vLLM's kernel the gathered gates of
a mixed step, found in the step's forward-context metadata by the index whose length is
q's; aligned calls pass through, and a call no index fits keeps vLLM's gates and is
counted. The end-to-end proof on vLLM 0.22.1's real `_forward_core` is
tests/test_spec_gates_vllm.py."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import pytest

from vllm_patch.gdn import spec_gates
from vllm_patch.gdn.spec_gates import find_index


class Rows:
    """A 1-D stand-in tensor: index_select and shape, enough for the wrapper."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = list(rows)
        self.shape = (len(self.rows),)

    def index_select(self, dim: int, idx: Rows) -> Rows:
        assert dim == 0
        return Rows([self.rows[i] for i in idx.rows])

    def dim(self) -> int:
        return 1


class Q(Rows):
    def __init__(self, n: int) -> None:
        super().__init__(list(range(n)))
        self.shape = (1, n, 2, 4)

    def dim(self) -> int:
        return 4


@dataclass
class Meta:
    spec_token_indx: Rows | None
    non_spec_token_indx: Rows | None


def _with_context(monkeypatch: pytest.MonkeyPatch, attn_metadata: Any) -> None:
    fc = types.ModuleType("vllm.forward_context")
    fc.get_forward_context = lambda: types.SimpleNamespace(attn_metadata=attn_metadata)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.forward_context", fc)


def test_the_wrapper_gathers_the_speculative_rows_gates(monkeypatch: pytest.MonkeyPatch) -> None:
    # batch order: a draft-less request (token 0, a 1-token prefill), then a drafting one
    # (tokens 1-4): vLLM 0.22.1 would hand the kernel gates of tokens 0-3
    idx = Meta(Rows([1, 2, 3, 4]), Rows([0]))
    _with_context(monkeypatch, {"layers.0.linear_attn": object(), "layers.1.linear_attn": idx})
    seen: dict[str, Any] = {}

    def kernel(**kw: Any) -> str:
        seen.update(kw)
        return "out"

    f = spec_gates.wrap(kernel)
    gates = Rows(["g0", "g1", "g2", "g3", "g4"])
    assert f(a=gates, b=Rows(["b0", "b1", "b2", "b3", "b4"]), q=Q(4),
             num_accepted_tokens=object()) == "out"
    assert seen["a"].rows == ["g1", "g2", "g3", "g4"]
    assert seen["b"].rows == ["b1", "b2", "b3", "b4"]


def test_the_wrapper_leaves_aligned_calls_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_context(monkeypatch, {})
    seen: dict[str, Any] = {}
    f = spec_gates.wrap(lambda **kw: seen.update(kw))
    gates = Rows(["g0", "g1"])
    f(a=gates, b=gates, q=Q(2), num_accepted_tokens=object())
    assert seen["a"] is gates


def test_a_call_no_index_fits_keeps_its_gates_and_is_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the speculative call's q has 4 rows, but the step's indices have 3 and 6
    _with_context(monkeypatch, {"x": Meta(Rows([1, 2, 3]), Rows([0, 4, 5, 6, 7, 8]))})
    monkeypatch.setitem(spec_gates.COUNTS, "unresolved", 0)
    seen: dict[str, Any] = {}
    f = spec_gates.wrap(lambda **kw: seen.update(kw))
    gates = Rows([f"g{i}" for i in range(9)])
    f(a=gates, b=gates, q=Q(4), num_accepted_tokens=object())
    assert seen["a"] is gates and spec_gates.COUNTS["unresolved"] == 1
    # a draft-less call takes non_spec_token_indx, not the speculative one of its length
    _with_context(monkeypatch, {"x": Meta(Rows([1, 2, 3]), None)})
    f(a=gates, b=gates, q=Q(3))
    assert seen["a"] is gates and spec_gates.COUNTS["unresolved"] == 2


def test_find_index_reads_list_metadata_and_lengths() -> None:
    md = Meta(Rows([2, 3]), Rows([0, 1]))
    assert find_index([{"x": md}], "spec", 2) is md.spec_token_indx
    assert find_index({"x": md}, "non_spec", 2) is md.non_spec_token_indx
    assert find_index({"x": md}, "spec", 3) is None
