"""The CPU-runnable parts of tests/gpu/serving/device_spec_prefix.py (issue 24 items 2-4):
the prompt plans built from vLLM's block size, the n-gram simulation, the counter
arithmetic, the verdicts, and the whole driver against a stand-in vLLM
(tests/gpu/serving/fake_vllm) that can plant the bugs the proof must catch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SERVING = Path(__file__).resolve().parent / "gpu" / "serving"
sys.path.insert(0, str(SERVING))

import spec_cases as sc  # noqa: E402

from vllm_patch.spec_decode import ngram  # noqa: E402

BLOCK = 560


def _requests(plan: dict[str, Any], phase: str) -> list[list[dict[str, Any]]]:
    return plan["phases"][phase]


def test_prefix_groups_share_exactly_their_length_and_hit_inside_and_on_block_ends() -> None:
    plan = sc.stage1_plan(BLOCK)
    lengths = sc.prefix_lengths(BLOCK)
    assert {v % BLOCK for v in lengths.values()} >= {0, 1, BLOCK - 1, BLOCK // 2}
    assert {BLOCK, 2 * BLOCK} <= set(lengths.values())
    for name, length in lengths.items():
        first, rest = _requests(plan, f"prefix_{name}")
        assert len(first) == 1 and len(rest) == len(sc.SUFFIXES) - 1  # alone, then the rest
        assert first[0]["shared"] == 0 and all(r["shared"] == length for r in rest)
        base = first[0]["prompt"]
        for r in rest:
            assert r["prompt"][:length] == base[:length]
            # Nothing beyond `length` is shared, or the case would test a longer prefix.
            if len(r["prompt"]) > length:
                assert r["prompt"][length:length + 1] != base[length:length + 1] or \
                    r["prompt"][length:] != base[length:len(r["prompt"])]
        assert any(len(r["prompt"]) == length for r in rest)  # the prefix itself
    (together,) = _requests(plan, "together_2b")
    assert len(together) == len(sc.SUFFIXES) and together[0]["shared"] == 0
    assert all(r["prompt"][:2 * BLOCK] == together[0]["prompt"][:2 * BLOCK] for r in together)
    # Groups do not share with each other (random ids): their first tokens differ.
    firsts = {tuple(_requests(plan, f"prefix_{n}")[0][0]["prompt"][:8]) for n in lengths}
    assert len(firsts) == len(lengths)


def test_truncation_requests_end_on_block_multiples_and_repeat_warm() -> None:
    plan = sc.stage1_plan(BLOCK)
    (cold,) = _requests(plan, "trunc_cold")
    (warm,) = _requests(plan, "trunc_warm")
    assert cold and all((len(r["prompt"]) + r["max_tokens"]) % BLOCK == 0 for r in cold)
    assert {len(r["prompt"]) + r["max_tokens"] for r in cold} == {BLOCK, 2 * BLOCK}
    # Ends within one speculative step: the drafts reach past max_tokens.
    assert {1, sc.K} <= {r["max_tokens"] for r in cold}
    assert [r["prompt"] for r in warm] == [r["prompt"] for r in cold]
    assert all(r["shared"] == len(r["prompt"]) for r in warm)


def test_plan_skips_what_max_len_cannot_hold_and_refuses_tiny_blocks() -> None:
    plan = sc.stage1_plan(BLOCK, max_len=BLOCK + 200)
    assert {"prefix_2b", "together_2b"} <= set(plan["skipped"])
    assert "prefix_b" in plan["phases"]
    assert all(len(r["prompt"]) + r["max_tokens"] <= BLOCK + 200
               for subs in plan["phases"].values() for sub in subs for r in sub)
    with pytest.raises(sc.CaseError, match="block_size=4"):
        sc.stage1_plan(4)


def test_expected_cached_counts_whole_blocks_and_never_the_last_token() -> None:
    assert sc.expected_cached(BLOCK - 1, BLOCK + 6, BLOCK) == 0
    assert sc.expected_cached(BLOCK, BLOCK + 6, BLOCK) == BLOCK
    assert sc.expected_cached(BLOCK, BLOCK, BLOCK) == 0  # prompt == one block: recompute
    assert sc.expected_cached(2 * BLOCK, 2 * BLOCK, BLOCK) == BLOCK
    assert sc.expected_cached(2 * BLOCK - 1, 2 * BLOCK + 33, BLOCK) == BLOCK


def test_engine_configs_are_the_three_engines_of_the_brief() -> None:
    c = sc.engine_configs("/m", 0.1, 1 << 30)
    assert c["E0"]["enable_prefix_caching"] is False and "speculative_config" not in c["E0"]
    assert c["E1"]["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert c["E1"]["mamba_cache_mode"] == "align" and c["E1"]["enable_prefix_caching"]
    assert c["E1"]["compilation_config"]["cudagraph_capture_sizes"] == [4, 8, 16, 32, 64]
    assert c["E2"]["speculative_config"]["method"] == "ngram"
    assert all(kw["disable_log_stats"] is False for kw in c.values())
    with pytest.raises(sc.CaseError, match=r"gpu_memory_utilization=1\.5"):
        sc.engine_configs("/m", 1.5, 1)


def test_vllm_rule_takes_the_earliest_occurrence_and_up_to_k() -> None:
    toks = [1, 2, 9, 1, 2, 8, 1, 2]
    assert sc.propose_upto_k_earliest(toks, 3, 2, 8) == [9, 1, 2]
    assert ngram.propose(toks, 3, 2, 8) == [8, 1, 2]  # ours: the latest occurrence
    assert sc.propose_upto_k_earliest([5, 6, 7, 5, 6], 3, 2, 8) == [7, 5, 6]
    assert sc.propose_upto_k_earliest([5, 6, 7, 8, 5, 6], 3, 2, 8) == [7, 8, 5]
    assert sc.propose_upto_k_earliest([3, 4, 3, 4], 3, 2, 8) == [3, 4]  # fewer than k
    assert sc.propose_upto_k_earliest([1, 2, 3, 4], 3, 2, 8) == []


def test_simulated_acceptance_counts_like_the_verifier() -> None:
    period = [7, 3, 9, 4]
    prompt = period * 4
    out = period * 4  # the greedy continuation keeps the period
    upto = sc.simulate_acceptance(prompt, out, 3,
                                  lambda c, k: sc.propose_upto_k_earliest(c, k, 2, 8))
    assert upto["num_accepted_tokens"] == upto["num_draft_tokens"]  # every draft right
    assert 1 + upto["steps"] + upto["num_accepted_tokens"] == len(out)
    assert upto["tokens_per_step"] == pytest.approx((len(out) - 1) / upto["steps"], abs=1e-3)
    none = sc.simulate_acceptance(list(range(40)), list(range(100, 140)), 3,
                                  lambda c, k: ngram.propose(c, k, 2, 8))
    assert none["num_drafts"] == 0 and none["steps"] == 39 and none["tokens_per_step"] == 1.0


def test_counter_delta_and_acceptance_figures() -> None:
    before = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 30,
              "vllm:spec_decode_num_accepted_tokens": 5, sc.PER_POS: [3, 1, 1]}
    after = {"vllm:spec_decode_num_drafts": 30, "vllm:spec_decode_num_draft_tokens": 90,
             "vllm:spec_decode_num_accepted_tokens": 35, sc.PER_POS: [18, 9, 3]}
    d = sc.counter_delta(before, after)
    assert d["vllm:spec_decode_num_drafts"] == 20 and d[sc.PER_POS] == [15, 8, 2]
    assert d["vllm:prefix_cache_hits"] is None
    a = sc.acceptance(d, generated=51)  # 50 decode tokens, 30 of them accepted drafts
    assert a["acceptance_rate"] == 0.5 and a["mean_acceptance_length"] == 2.5
    assert a["tokens_per_step"] == 2.5  # 50 tokens over 20 steps
    assert sc.acceptance({}, 10)["tokens_per_step"] is None


def test_truncation_and_cache_verdicts() -> None:
    whole = {"prompt_len": BLOCK - 3, "max_tokens": 3, "tokens": [1, 2, 3]}
    short = dict(whole, tokens=[1, 2])
    assert sc.truncation_check([whole], BLOCK)["passed"]
    bad = sc.truncation_check([whole, short], BLOCK)
    assert not bad["passed"] and bad["bad"][0]["request"] == 1
    assert sc.whole_outputs({"a": [whole], "b": [whole]})["passed"]
    w = sc.whole_outputs({"a": [whole], "b": [whole, short]})
    assert not w["passed"] and w["short"][0]["phase"] == "b" and w["requests"] == 3
    phases = {"prefix_b": [{"prompt_len": BLOCK + 7, "shared": 0, "num_cached_tokens": 0},
                           {"prompt_len": BLOCK + 1, "shared": BLOCK,
                            "num_cached_tokens": 0}]}
    assert not sc.cache_hits(phases, BLOCK)["exercised"]
    phases["prefix_b"][1]["num_cached_tokens"] = BLOCK
    hits = sc.cache_hits(phases, BLOCK)
    assert hits["exercised"] and hits["as_expected"] == 2


def test_verdict_needs_every_piece() -> None:
    ok = {"requests": 3, "passed": True}
    trunc = {"E1_trunc_cold": {"requests": 2, "passed": True}}
    cache = {"E1": {"exercised": True}}
    comps = {"E1_vs_E0": ok, "E2_vs_E0": ok}
    assert sc.verdict(comps, trunc, cache) is True
    assert sc.verdict({"E1_vs_E0": ok}, trunc, cache) is None
    assert sc.verdict(dict(comps, E2_vs_E0={"requests": 3, "passed": False}), trunc,
                      cache) is False
    assert sc.verdict(comps, {"x": {"requests": 2, "passed": False}}, cache) is False
    wide = {"requests": 3, "passed": True, "max_abs_dlogprob": 2.0}  # noise widened itself
    assert sc.verdict(dict(comps, E1_vs_E0=wide), trunc, cache) is False
    assert sc.verdict(comps, trunc, {"E1": {"exercised": False}}) is False


def test_pick_repetitive_ignores_random_and_nothing() -> None:
    pred = {"tail": {"num_accepted_tokens": 4}, "cycle16": {"num_accepted_tokens": 9},
            "random": {"num_accepted_tokens": 50}}
    assert sc.pick_repetitive(pred) == "cycle16"
    assert sc.pick_repetitive({"tail": {"num_accepted_tokens": 0}}) is None


def test_stage2_builds_from_the_reference_output() -> None:
    plan = sc.stage2_plan([1, 2, 3], list(range(100, 164)), "E0")
    tail = plan["phases"]["accept_tail"][0][0]["prompt"]
    assert tail == [1, 2, 3, *range(100, 148)]
    assert plan["phases"]["accept_repeat2"][0][0]["prompt"] == [1, 2, 3, *range(100, 164)] * 2
    assert all(len(subs) == 1 and len(subs[0]) == 1 for subs in plan["phases"].values())
    with pytest.raises(sc.CaseError, match="seed output of 2 tokens"):
        sc.stage2_plan([1], [1, 2], "E0")


# --- the driver end to end, against the stand-in vLLM -------------------------------------

CASES = {"clean": {}, "corrupt": {"FAKE_VLLM_BUG": "corrupt_cached"},
         "truncate": {"FAKE_VLLM_BUG": "truncate"}, "refuse": {"FAKE_VLLM_REFUSE": "ngram"},
         "no_reference": {"FAKE_VLLM_REFUSE": "none"}}


@pytest.fixture(scope="module")
def driver_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The driver once per case, all at once (each run's engines poll for plans)."""
    root = tmp_path_factory.mktemp("spec_prefix")
    procs = {}
    for name, extra in CASES.items():
        env = dict(os.environ, PYTHONPATH=str(SERVING / "fake_vllm"), SM70_GPU_SHARE="0.3",
                   SM70_AB_TINY=str(root / "none"), **extra)
        procs[name] = subprocess.Popen(
            [sys.executable, str(SERVING / "device_spec_prefix.py"), "--out",
             str(root / name / "out"), "--work", str(root / name / "work"),
             "--budget-s", "90"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = {}
    for name, p in procs.items():
        log = p.communicate(timeout=120)[0].decode()
        out[name] = json.loads((root / name / "out" / "summary.json").read_text())
        out[name]["_log"] = log
    return out


def test_driver_passes_a_correct_engine(driver_runs: dict[str, dict[str, Any]]) -> None:
    s = driver_runs["clean"]
    assert s["passed"] is True, s["_log"]
    assert s["block_size"] == 48 and s["block_size_source"] in {"E1", "E2"}
    assert s["plan_block_matches"] == {"E1": True, "E2": True}
    assert s["comparisons"]["E1_vs_E0"]["all_equal"]
    assert s["prefix_cache"]["E1"]["exercised"]
    assert set(s["acceptance"]["measured"]) == {"tail", "repeat2", "cycle16", "random"}
    assert s["acceptance"]["measured"]["random"]["E2"]["num_drafts"] > 0


def test_driver_fails_output_corrupted_by_the_cache(driver_runs: dict[str, Any]) -> None:
    s = driver_runs["corrupt"]
    assert s["passed"] is False
    div = s["comparisons"]["E1_vs_E0"]["divergences"]
    phases = {d["phase"] for d in div}
    # Exactly where the cache served whole blocks: not below a block, not on fresh prompts.
    assert {"prefix_b", "prefix_b_plus1", "prefix_2b", "trunc_warm"} <= phases
    assert not phases & {"seed", "trunc_cold", "prefix_half", "prefix_b_minus1"}
    assert not any(d["within_noise"] for d in div)


def test_driver_fails_truncation_at_block_multiples(driver_runs: dict[str, Any]) -> None:
    s = driver_runs["truncate"]
    assert s["passed"] is False
    assert s["truncation"]["E1"]["trunc_cold"]["bad"]
    assert s["whole_outputs"]["E1"]["short"] and s["whole_outputs"]["E0"]["passed"]
    assert s["truncation"]["E0"]["trunc_cold"]["passed"]  # no speculation: whole


def test_driver_records_a_refusal_and_runs_the_rest(driver_runs: dict[str, Any]) -> None:
    s = driver_runs["refuse"]
    assert s["passed"] is None
    assert s["refused"] == {"E2": "ValueError: refused by the fake"}
    assert s["comparisons"]["E1_vs_E0"]["passed"]


def test_driver_without_the_reference_still_runs_both_stages(
        driver_runs: dict[str, Any]) -> None:
    s = driver_runs["no_reference"]
    assert s["passed"] is None and set(s["refused"]) == {"E0"}
    assert s["stage2_seed_source"] in {"E1", "E2"}
    assert s["truncation"]["E1"]["trunc_cold"]["passed"]
    assert "random" in s["acceptance"]["measured"]
