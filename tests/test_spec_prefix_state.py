"""R8, the prefix-hit fix (vllm_patch/spec_decode/prefix_state.py): which groups keep the
EAGLE look-ahead and which hits are consistent (pure), and, on vLLM 0.22.1's CPU tree
(tests/spec_prefix_state_probe.py), that vLLM's own KV cache manager with an MTP drafter
reports hits that full attention does not cover (the bug as measured on the H200) and,
after `register()`, only hits every group covers exactly, keeping the longest valid one;
without a drafter nothing changes; the off switch leaves vLLM as it is. A replay of the
H200 matrix's first stage through vLLM's manager gives the hit of every request that the
H200 measured, shows that each MTP hit there was uncovered, and what R8 leaves. Mutated
copies of the module must fail the probe's checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_cpu_tree import mutated_plugin, require_tree, run_probe

from vllm_patch.config import PluginConfig
from vllm_patch.spec_decode.prefix_state import (
    GroupKind,
    PrefixStatePatchError,
    check_target,
    hit_is_consistent,
    lookahead_groups,
)

PROBE = Path(__file__).resolve().parent / "spec_prefix_state_probe.py"
ATTN, ALIGN, ALL = GroupKind(False), GroupKind(True, "align"), GroupKind(True, "all")


def test_align_state_groups_lose_the_lookahead() -> None:
    # full attention keeps it (its finder drops the extra block); the align GDN group not
    assert lookahead_groups({0, 1}, [ATTN, ALIGN]) == {0}
    assert lookahead_groups({0, 1, 2}, [ATTN, ATTN, ALIGN]) == {0, 1}
    # not an EAGLE group: nothing to take away; other cache modes are outside this fix
    assert lookahead_groups({0}, [ATTN, ALIGN]) == {0}
    assert lookahead_groups({0, 1}, [ATTN, ALL]) == {0, 1}
    assert lookahead_groups(set(), [ATTN, ALIGN]) == set()


def test_unknown_group_refused() -> None:
    with pytest.raises(ValueError, match="EAGLE attention group 2: the coordinator has 2"):
        lookahead_groups({2}, [ATTN, ALIGN])


def test_hits_every_group_covers_exactly() -> None:
    assert hit_is_consistent(528, [1, 1], [528, 528])
    assert hit_is_consistent(0, [0, 0], [528, 528])
    assert hit_is_consistent(64, [4, 1], [16, 64])  # groups of different block sizes
    # the H200 case: 528 tokens reported, full attention holds none of them
    assert not hit_is_consistent(528, [0, 1], [528, 528])
    assert not hit_is_consistent(1056, [1, 2], [528, 528])
    # a GDN list past the hit: its state is that of a later position
    assert not hit_is_consistent(528, [1, 2], [528, 528])
    with pytest.raises(ValueError, match="1 hit lists for 2 groups"):
        hit_is_consistent(0, [0], [528, 528])


def test_target_check_refuses_other_versions_and_shapes() -> None:
    def find_longest_cache_hit(self: Any, block_hashes: Any, max_cache_hit_length: int
                               ) -> Any:
        return self.attention_groups, self.eagle_attn_group_indices, self.find_longest_cache_hit

    check_target(find_longest_cache_hit, "0.22.1")
    check_target(find_longest_cache_hit, "0.22.1+cu130")
    with pytest.raises(PrefixStatePatchError, match=r"vLLM is 0\.23\.0"):
        check_target(find_longest_cache_hit, "0.23.0")

    def renamed(self: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
        return self.attention_groups, self.find_longest_cache_hit

    with pytest.raises(PrefixStatePatchError, match="eagle_attn_group_indices"):
        check_target(renamed, "0.22.1")

    def other_params(self: Any, block_hashes: Any) -> Any:
        return find_longest_cache_hit(self, block_hashes, 0)

    with pytest.raises(PrefixStatePatchError, match="parameters"):
        check_target(other_params, "0.22.1")


def test_config_switch_defaults_on() -> None:
    assert PluginConfig().spec.exact_prefix_hits is True
    off = PluginConfig.from_dict({"spec": {"exact_prefix_hits": False}})
    assert off.spec.exact_prefix_hits is False


def _check(result: dict[str, Any]) -> list[str]:
    """Every failed expectation of a run with the fix on (an empty list: all hold)."""
    bad = []
    if not result["wrapped"] or result["second"] != "wrapped (already installed)":
        bad.append(f"not installed: {result['register']!r}")
    want = {  # consumer hit, hit-list length per group (full attention, GDN)
        "one_block": (0, [0, 0]),  # full attention dropped its one block: no valid hit
        "three_blocks": (32, [2, 2]),  # the longest hit both groups cover
        "two_blocks_inside": (16, [1, 1]),  # already consistent: kept
        "one_block_ngram": (16, [1, 1]),  # no drafter: vLLM's own answer
    }
    for name, (hit, lists) in want.items():
        got = result["after"][name]
        if (got["hit"], got["lists"]) != (hit, lists):
            bad.append(f"{name}: hit {got['hit']} lists {got['lists']}, want {hit} {lists}")
    if result["after"]["one_block_ngram"]["record"]["applies"]:
        bad.append("one_block_ngram: the fix acted without a drafter")
    guard = result["guard"] or {}
    if (guard.get("hit"), guard.get("lists")) != (0, [0, 0]) or \
            (guard.get("record") or {}).get("refused") != 1:
        bad.append(f"guard: an uncovered hit was not refused: {guard}")
    return bad


# The H200 run's num_cached_tokens per stage-1 request (tests/gpu/results/h200_spec_diag.json,
# engines SM and OM alike, SA), phases with no hit left out: vLLM's scheduling is
# deterministic, so the replay must give these exactly.
H200_MTP = {"prefix_b": [0, 0, 528, 528], "prefix_2b_minus1": [0, 528, 528, 528],
            "prefix_2b": [0, 528, 1056, 1056], "together_2b": [0, 528, 1056, 1056],
            "trunc_warm": [0, 0, 0, 0, 528]}
H200_NGRAM = {"prefix_b": [0, 0, 528, 528], "prefix_b_plus1": [0, 528, 528, 528],
              "prefix_b_and_half": [0, 528, 528, 528], "prefix_2b_minus1": [0, 0, 528, 528],
              "prefix_2b": [0, 0, 1056, 1056], "together_2b": [0, 0, 1056, 1056],
              "trunc_warm": [0, 0, 0, 528, 528]}
# With R8: only prompts sharing two full blocks keep a hit (one, after the EAGLE drop).
FIXED_MTP = {"prefix_2b": [0, 0, 528, 528], "together_2b": [0, 0, 0, 528]}
BLOCK_H200 = 528


def _hits(rows: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    return {ph: [r[0] for r in rs] for ph, rs in rows.items() if any(r[0] for r in rs)}


def _uncovered(rows: dict[str, list[list[int]]]) -> list[tuple[str, int]]:
    """(phase, request) of each hit whose full-attention list is shorter than the hit."""
    return [(ph, i) for ph, rs in rows.items() for i, (hit, fa, _gdn) in enumerate(rs)
            if fa * BLOCK_H200 != hit]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    result, _ = run_probe(PROBE, {"config": PluginConfig().to_dict(), "replay": True},
                          tmp_path_factory.mktemp("prefix_replay"))
    return result["replay"]


def test_replay_gives_the_h200_hits(replayed: dict[str, Any]) -> None:
    assert _hits(replayed["stock_mtp"]) == H200_MTP
    assert _hits(replayed["stock_ngram"]) == H200_NGRAM


def test_every_mtp_hit_of_the_h200_run_was_uncovered(replayed: dict[str, Any]) -> None:
    # the 11 requests that differed from plain decoding there, and no other
    stock = replayed["stock_mtp"]
    assert _uncovered(stock) == [(ph, i) for ph, hits in H200_MTP.items()
                                 for i, h in enumerate(hits) if h]
    assert _uncovered(replayed["stock_ngram"]) == []


def test_with_r8_every_replayed_hit_is_covered(replayed: dict[str, Any]) -> None:
    assert _uncovered(replayed["fixed_mtp"]) == []
    assert _hits(replayed["fixed_mtp"]) == FIXED_MTP


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    result, _ = run_probe(PROBE, {"config": PluginConfig().to_dict()},
                          tmp_path_factory.mktemp("prefix_state"))
    return result


def test_stock_vllm_reports_hits_full_attention_does_not_cover(probed: dict[str, Any]
                                                               ) -> None:
    # the bug the fix exists for, in vLLM 0.22.1's own manager (prefix_b request 2 and a
    # three-block prefix of the H200 run, at block 16): the GDN group's look-ahead wins
    stock = probed["stock"]
    assert (stock["one_block"]["hit"], stock["one_block"]["lists"]) == (16, [0, 1])
    assert (stock["three_blocks"]["hit"], stock["three_blocks"]["lists"]) == (48, [2, 3])
    assert (stock["one_block_ngram"]["hit"], stock["one_block_ngram"]["lists"]) == (16, [1, 1])


def test_after_register_every_hit_is_covered(probed: dict[str, Any]) -> None:
    assert probed["register"].startswith(("wrapped", "deferred"))
    assert _check(probed) == []


def test_off_switch_leaves_vllm_alone(tmp_path: Path) -> None:
    require_tree()
    cfg = PluginConfig.from_dict({"spec": {"exact_prefix_hits": False}}).to_dict()
    result, _ = run_probe(PROBE, {"config": cfg}, tmp_path)
    assert result["register"] == "off (spec.exact_prefix_hits is false)"
    assert not result["wrapped"]
    assert result["after"]["one_block"]["lists"] == [0, 1]  # vLLM's answer, bug and all


MUTANTS = [
    ("look-ahead kept", 'if not (kinds[i].state and kinds[i].cache_mode == "align"):',
     "if True:"),
    ("guard passes all", "return all(n * size == hit_length", "return all(n * size >= 0"),
    ("answer unchecked", "return result if state is None else checked(self, state, result)",
     "return result"),
    ("mode ignored", 'GroupKind(True, str(spec.mamba_cache_mode))', 'GroupKind(True, "none")'),
]


@pytest.mark.parametrize(("name", "old", "new"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_mutants_fail_the_checks(name: str, old: str, new: str, tmp_path: Path) -> None:
    require_tree()
    front = mutated_plugin(tmp_path / "front", "spec_decode/prefix_state.py", old, new)
    try:
        result, _ = run_probe(PROBE, {"config": PluginConfig().to_dict(),
                                      "front": str(front)}, tmp_path)
    except pytest.fail.Exception:
        return  # the mutant crashed the probe: caught
    assert result["module"].startswith(str(front)), "the probe did not load the mutant"
    assert _check(result), f"mutant {name!r} passed the checks"
