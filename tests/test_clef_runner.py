"""The Clef runner hook (R6): which rows of a step are Clef's and which the head reads.

The pure parts (`vllm_patch.clef.batch`) here; the hook itself against vLLM 0.22.1's real
`InputBatch`, decode-first reorder and `GPUModelRunner` methods through the CPU tree
(tests/clef_runner_probe.py, a child process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_cpu_tree import require_tree, run_probe

from vllm_patch.clef.batch import (
    ClefError,
    is_clef,
    request_flags,
    rows_this_step,
    score_spec,
)

PROBE = Path(__file__).resolve().parent / "clef_runner_probe.py"


def test_the_flag_is_any_true_value_of_the_extra_arg() -> None:
    assert is_clef({"sm70_clef": 1}) and is_clef({"sm70_clef": True})
    assert not is_clef(None) and not is_clef({}) and not is_clef({"sm70_clef": 0})
    assert not is_clef({"other": 1})


def test_flags_follow_the_runners_order_and_holes_are_chat() -> None:
    extra = {"a": {"sm70_clef": 1}, "b": None, "c": {"sm70_clef": True}}
    assert request_flags(["c", "b", None, "a"], extra) == [True, False, False, True]


def test_score_spec_reads_the_plan_and_refuses_a_broken_one() -> None:
    spec = score_spec({"sm70_clef": 1, "sm70_clef_score": {
        "key": "k", "positions": [3, 7], "roles": [0, 1], "kinds": [1, 1]}})
    assert spec is not None and spec.positions == (3, 7) and spec.key == "k"
    assert score_spec({"sm70_clef": 1}) is None
    assert score_spec({"sm70_clef_score": {"key": "k"}}) is None  # not Clef: not read
    with pytest.raises(ClefError, match="as many"):
        score_spec({"sm70_clef": 1, "sm70_clef_score": {
            "key": "k", "positions": [3, 7], "roles": [0], "kinds": [1, 1]}})
    with pytest.raises(ClefError, match="exactly the fields"):
        score_spec({"sm70_clef": 1, "sm70_clef_score": {"key": "k", "positions": [1]}})


def test_rows_this_step_maps_positions_of_the_chunk_only() -> None:
    # rows 4..9 hold positions 10..15 of this request
    assert rows_this_step([2, 10, 12, 15, 16], 10, 4, 10) == ([1, 2, 3], [4, 6, 9])
    assert rows_this_step([2, 3], 10, 4, 10) == ([], [])


# ------------------------------------------------------------------ vLLM's own classes
CASES: list[dict[str, Any]] = [
    {"name": "mixed_reordered", "pad": 3, "requests": [
        {"id": "p_chat", "prompt": 20, "computed": 0, "scheduled": 20, "clef": False},
        {"id": "p_clef", "prompt": 9, "computed": 0, "scheduled": 9, "clef": True},
        {"id": "d_clef", "prompt": 5, "computed": 5, "scheduled": 1, "clef": True},
        {"id": "d_chat", "prompt": 6, "computed": 6, "scheduled": 1, "clef": False},
        {"id": "c_clef", "prompt": 40, "computed": 16, "scheduled": 12, "clef": True},
        {"id": "d_chat2", "prompt": 7, "computed": 7, "scheduled": 1, "clef": False},
    ]},
    {"name": "chat_only", "pad": 0, "requests": [
        {"id": "a", "prompt": 4, "computed": 0, "scheduled": 4, "clef": False},
        {"id": "b", "prompt": 4, "computed": 4, "scheduled": 1, "clef": False},
    ]},
]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    result, _log = run_probe(PROBE, {"cases": CASES}, tmp_path_factory.mktemp("clef_runner"))
    return result


def test_install_wraps_both_methods_once_keeping_vllms_parameters(probe: dict) -> None:
    inst = probe["install"]
    assert inst["first"] == "installed" and inst["second"] == "installed (already)"
    assert inst["installed"] == ["_preprocess", "_model_forward"]
    assert inst["params"] == ["self", "scheduler_output", "num_input_tokens",
                              "intermediate_tensors"]


def test_the_mask_follows_the_reordered_layout_decode_rows_included(probe: dict) -> None:
    case = probe["cases"][0]
    assert case["reordered"], "vLLM's reorder must move requests for this case to mean much"
    assert case["got"] == case["expected"]
    assert case["any_clef"]
    # the plausible bugs write other masks, so the equality above would catch them
    assert case["bug_insertion_order"] != case["expected"]
    assert case["bug_prefill_only"] != case["expected"]
    assert case["got"][-3:] == [0, 0, 0]  # padding rows belong to nobody


def test_a_chat_only_step_after_a_mixed_one_clears_the_mask(probe: dict) -> None:
    case = probe["cases"][1]
    assert case["got"] == [0] * case["padded"] and not case["any_clef"]


def test_scoring_rows_are_gathered_across_chunks_and_taken_once(probe: dict) -> None:
    s = probe["scoring"]
    # layout: the chat decode is row 0; the scoring request's chunk starts at row 1
    first, second = s["steps"]
    assert first["pending_rows"] == [[3, 6, 10]]  # positions 2, 5, 9 of the first 10
    assert second["pending_rows"] == [[3, 6]]  # positions 12, 15: rows 1 + (p - 10)
    assert first["partial"] == ["k1"] and second["partial"] == []
    assert not first["left_pending"] and not second["left_pending"]
    assert s["taken"] == [float(p) for p in s["positions"]]
    assert s["again"] is None
