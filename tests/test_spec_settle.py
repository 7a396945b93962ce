"""R7, the accepted-state fix (vllm_patch/spec_decode/accepted_state.py): which rows it moves
(pure), and, on vLLM 0.22.1's CPU tree (tests/spec_settle_probe.py), that after it the
non-speculative GDN path reads exactly the state the speculative path would have read, with
vLLM's own copy-spec functions, in both cache modes, and that the target check passes on
vLLM's real `_prepare_inputs`. Mutated copies of the module (base slot, shift, the draft
test) must fail the probe's checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_cpu_tree import mutated_plugin, require_tree, run_probe

from vllm_patch.spec_decode.accepted_state import Settle, rows_to_settle

PROBE = Path(__file__).resolve().parent / "spec_settle_probe.py"


def test_rows_without_drafts_after_acceptance_are_moved() -> None:
    got = rows_to_settle(["a", "b", "c", "d", None], [3, 1, 4, 2, 5],
                         {"c": [1, 2, 3], "d": []}, "none", {})
    # a: accepted 3, no drafts -> moved; b: accepted 1; c: has drafts (vLLM's path);
    # d: an empty draft list is no draft; the None slot is padding
    assert got == [Settle(0, "a", 0, 3), Settle(3, "d", 0, 2)]


def test_align_mode_uses_the_running_state_block() -> None:
    got = rows_to_settle(["a", "b"], [2, 3], {}, "align", {"a": 5})
    # b has no running-state block yet (new to the runner): nothing to move
    assert got == [Settle(0, "a", 5, 2)]


def test_other_modes_refused() -> None:
    with pytest.raises(ValueError, match="mamba_cache_mode 'all'"):
        rows_to_settle(["a"], [2], {}, "all", {})


CASES: list[dict[str, Any]] = [
    {"mode": "none", "reqs": [
        {"id": "moved3", "blocks": [5, 7, 2, 9], "accepted": 3, "drafts": 0},
        {"id": "moved4", "blocks": [11, 12, 13, 14], "accepted": 4, "drafts": 0},
        {"id": "drafting", "blocks": [20, 21, 22, 23], "accepted": 3, "drafts": 3},
        {"id": "one", "blocks": [30, 31, 32, 33], "accepted": 1, "drafts": 0}]},
    {"mode": "align", "state_idx": {"moved": 2, "drafting": 1},
     "reqs": [
         {"id": "moved", "blocks": [1, 3, 6, 8, 10, 15, 16], "accepted": 2, "drafts": 0},
         {"id": "drafting", "blocks": [24, 25, 26, 27, 28, 29], "accepted": 2,
          "drafts": 3}]},
]


def _check(result: dict[str, Any]) -> list[str]:
    """Every failed expectation (an empty list: all hold)."""
    bad = []
    none, align = result["settle"]
    for r in ("moved3", "moved4"):
        row = none["rows"][r]
        if not (row["temporal_matches_spec_view"] and row["conv_matches_spec_view"]):
            bad.append(f"none/{r}: state not where the non-speculative path reads it")
        if row["accepted_after"] != 1 or row["gpu_buffer_after"] != 1:
            bad.append(f"none/{r}: accepted count not reset")
    for r in ("drafting", "one"):
        if not none["rows"][r]["untouched"]:
            bad.append(f"none/{r}: touched")
    if none["rows"]["drafting"]["accepted_after"] != 3:
        bad.append("none/drafting: accepted count changed (vLLM's path needs it)")
    if none["moved"] != 2 or not none["other_blocks_untouched"]:
        bad.append(f"none: moved {none['moved']} rows, others untouched "
                   f"{none['other_blocks_untouched']}")
    row = align["rows"]["moved"]
    if not (row["temporal_matches_spec_view"] and row["conv_matches_spec_view"]
            and row["accepted_after"] == 1):
        bad.append("align/moved: wrong")
    if not align["rows"]["drafting"]["untouched"] or not align["other_blocks_untouched"]:
        bad.append("align: touched what it must not")
    return bad


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    result, _ = run_probe(PROBE, {"install": True, "settle": CASES},
                          tmp_path_factory.mktemp("settle"))
    return result


def test_state_moves_where_the_non_speculative_path_reads(probed: dict[str, Any]) -> None:
    assert _check(probed) == []
    assert probed["settle"][0]["counts"] == {"steps": 1, "requests": 2, "copies": 4}


def test_target_checks_on_vllms_real_prepare_inputs(probed: dict[str, Any]) -> None:
    got = probed["install"]
    assert got["register"].startswith("deferred")
    assert got["wrapped"] and got["outcome"].startswith("wrapped")
    assert got["original_checks"] == "ok"
    assert got["second"] == "wrapped (already installed)"


MUTANTS = [
    ("base slot", "out.append(Settle(row, rid, int(base), int(accepted[row])))",
     "out.append(Settle(row, rid, int(base) + 1, int(accepted[row])))"),
    ("drafted rows too", "len(drafted.get(rid, ())) > 0", "False"),
    ("accepted count kept", "        batch.num_accepted_tokens_cpu[s.row] = 1\n", ""),
    ("no shift", "func(state, block_ids, s.base, s.accepted)",
     "func(state, block_ids, s.base, 1 if state.dim() == 3 else s.accepted)"),
]


@pytest.mark.parametrize(("name", "old", "new"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_mutants_fail_the_checks(name: str, old: str, new: str, tmp_path: Path) -> None:
    require_tree()
    front = mutated_plugin(tmp_path / "front", "spec_decode/accepted_state.py", old, new)
    try:
        result, _ = run_probe(PROBE, {"settle": CASES, "front": str(front)}, tmp_path)
    except pytest.fail.Exception:
        return  # the mutant crashed the probe: caught
    assert _check(result), f"mutant {name!r} passed the checks"
