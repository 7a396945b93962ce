"""run_stack.py's verdict (CPU): a side that fell back to stock pieces, or whose output drifts,
fails it."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_stack


def _req(tokens, lps):
    return {"prompt_len": 5, "tokens": tokens, "logprobs": lps,
            "top2": [[t, lp, 0, lp - 1.0] for t, lp in zip(tokens, lps, strict=True)]}


def _side(tokens=(1, 2, 3), lps=(-0.1, -0.2, -0.3), **more):
    s = {"phases": {"single": [_req(list(tokens), list(lps))]}, "error": None}
    s.update(more)
    return s


OURS = dict(
    attention_layers={f"{run_stack.OURS_BACKEND}:Sm70PagedImpl": 2},
    attention_device_decodes=40, gdn_device_calls={"decode": 12},
    sm70_op_calls={"gemv": 30}, engine_kwargs={"enable_prefix_caching": True},
)
FULL = dict(OURS, drafter={"methods": {"QKVParallelLinear:Sm70DraftInt8Method": 1,
                                       "RowParallelLinear:Sm70DraftInt8Method": 2,
                                       "VocabParallelEmbedding:UnquantizedEmbeddingMethod": 1}})


def _sides(**over):
    sides = {"stock": _side(), "ours_core": _side(**OURS), "ours_full": _side(**FULL)}
    for k, v in over.items():
        sides[k] = v
    return sides


def test_all_pieces_ran_and_output_equal_passes():
    v = run_stack.verdict(_sides())
    assert v["passed"], v


def test_a_silent_fallback_to_triton_fails():
    core = _side(**dict(OURS, attention_layers={"vllm.TritonAttentionBackend:X": 2}))
    v = run_stack.verdict(_sides(ours_core=core))
    assert not v["passed"] and not v["evidence"]["ours_core"]["attention_on_ours"]


def test_gdn_decode_never_counted_fails():
    v = run_stack.verdict(_sides(ours_core=_side(**dict(OURS, gdn_device_calls={"decode": 0}))))
    assert not v["passed"]


def test_a_drafter_on_stock_linear_layers_fails():
    full = copy.deepcopy(FULL)
    full["drafter"]["methods"]["RowParallelLinear:UnquantizedLinearMethod"] = 1
    v = run_stack.verdict(_sides(ours_full=_side(**full)))
    assert not v["passed"] and not v["evidence"]["ours_full"]["drafter_on_ours"]


def test_different_tokens_or_a_large_logprob_drift_fail():
    wrong = _side(tokens=(1, 9, 9), **OURS)
    assert not run_stack.verdict(_sides(ours_core=wrong))["passed"]
    drift = _side(lps=(-0.1, -0.6, -0.3), **OURS)
    v = run_stack.verdict(_sides(ours_core=drift))
    assert not v["passed"] and not v["comparisons"]["ours_core"]["dlogprob_capped"]


def test_a_missing_or_failed_side_fails():
    assert not run_stack.verdict(_sides(ours_full={"error": "killed at the budget"}))["passed"]
    assert not run_stack.verdict(_sides(stock={"error": "boom"}))["passed"]
