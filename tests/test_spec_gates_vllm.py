"""R10 (vllm_patch/gdn/spec_gates.py) end to end on vLLM 0.22.1's own GDN code on the CPU
(tests/spec_gates_probe.py): the stock QwenGatedDeltaNetAttention._forward_core on metadata
from vLLM's GDN builder, its GPU kernels replaced by float64 references (vLLM's host function
fused_sigmoid_gating_delta_rule_update runs; only its Triton kernel is emulated). A mixed
n-gram step (a draft-less request beside one with 3 drafts) must give each request what it
gets alone. Stock vLLM does not when the draft-less request comes first; with R10 it does;
two mutants of R10 do not. Needs the serving venv and the 0.22.1 tree (tests/vllm_cpu_tree.py):
skips without them, fails under CI=true."""

from __future__ import annotations

from typing import Any

import pytest
from vllm_cpu_tree import REPO, require_tree, run_probe

PROBE = REPO / "tests" / "spec_gates_probe.py"
STEPS = ["plain_first", "spec_first", "spec_between"]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_tree()
    res, _log = run_probe(PROBE, {}, tmp_path_factory.mktemp("spec_gates"))
    assert "error" not in res, res.get("traceback")
    return res


def step(result: dict[str, Any], run: str, name: str) -> dict[str, Any]:
    s = result[run][name]
    assert "error" not in s, f"{run}/{name}: {s['error']}"
    return s


def requests(s: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [v for k, v in s.items() if k.endswith(f":{kind}")]


def test_the_steps_are_mixed_as_vllms_builder_makes_them(result: dict[str, Any]) -> None:
    assert result["vllm"] == "0.22.1"
    s = step(result, "stock", "plain_first")
    # the draft-less request is reclassified as a 1-token prefill beside the drafting one
    assert s["meta"] == {"num_prefills": 1, "num_decodes": 0, "num_spec_decodes": 1,
                         "spec_token_indx": [1, 2, 3, 4], "non_spec_token_indx": [0]}
    assert step(result, "stock", "spec_between")["meta"]["non_spec_token_indx"] == [0, 1, 6, 7]
    for name in STEPS:
        for r in requests(step(result, "stock", name), "plain"):
            assert r["alone_path"] == "decode"
        for r in requests(step(result, "stock", name), "spec"):
            assert r["alone_path"] == "spec"


@pytest.mark.parametrize("name", ["plain_first", "spec_between"])
def test_stock_vllm_gives_a_drafting_request_behind_a_plain_one_wrong_gates(
        result: dict[str, Any], name: str) -> None:
    s = step(result, "stock", name)
    # the kernel is handed the whole batch's gates for the speculative tokens only
    assert [(c["tokens"], c["spec"]) for c in s["recurrent_calls"]] == [(4, True)]
    assert s["recurrent_calls"][0]["gate_rows"] > 4
    (spec,) = requests(s, "spec")
    assert not spec["close"], "vLLM 0.22.1's ungathered gates no longer shift this request"
    assert spec["err"]["ssm"] > 0.1  # far above rounding: the state update itself is wrong
    assert all(r["close"] for r in requests(s, "plain"))


def test_stock_vllm_is_right_when_the_drafting_request_comes_first(
        result: dict[str, Any]) -> None:
    (spec,) = requests(step(result, "stock", "spec_first"), "spec")
    assert spec["equal"]


@pytest.mark.parametrize("name", STEPS)
def test_with_r10_each_request_matches_itself_alone(result: dict[str, Any], name: str) -> None:
    s = step(result, "r10", name)
    assert [(c["tokens"], c["gate_rows"]) for c in s["recurrent_calls"]] == [(4, 4)]
    (spec,) = requests(s, "spec")
    assert spec["equal"], f"the drafting request differs from itself alone: {spec['err']}"
    for r in requests(s, "plain"):
        # a 1-token prefill in the step, a decode alone: only fp16 rounding may differ
        assert r["close"], f"a draft-less request differs from itself alone: {r['err']}"
    assert all(r["state_changed"] for r in requests(s, "spec") + requests(s, "plain"))
    assert s["other_slots_untouched"]


def test_r10_installs_on_vllms_module_and_wraps_its_function(result: dict[str, Any]) -> None:
    assert result["install"] == "wrapped (gathers the gates of mixed speculative GDN steps)"
    assert result["wraps_vllm"]
    assert result["install_again"] == "wrapped (already installed)"
    # the three mixed steps gathered; the requests alone were aligned and passed through
    assert result["r10_counts"] == {"gathered_spec": 3, "gathered_non_spec": 0,
                                    "unresolved": 0}


def test_r10_refuses_a_caller_that_no_longer_gathers_by_spec_token_indx(
        result: dict[str, Any]) -> None:
    r = result["refusal"]
    assert r["said"].startswith("refused (") and "['spec_token_indx']" in r["said"]
    assert r["left_alone"]


@pytest.mark.parametrize("mutant", ["mutant_non_spec_index", "mutant_b_ungathered"])
def test_mutants_of_r10_are_caught(result: dict[str, Any], mutant: str) -> None:
    wrong = [name for name in STEPS
             if "error" in result[mutant][name]
             or not all(r["equal"] for r in requests(result[mutant][name], "spec"))]
    assert wrong, f"{mutant} passes the steps R10 must pass"
