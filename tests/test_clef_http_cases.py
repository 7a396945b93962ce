"""The pure parts of tests/gpu/clef/clef_http.py and the stability verdict of
device_clef_vllm.py: each passes on good answers and fails on the bug it exists for."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
for p in (HERE / "gpu" / "clef", HERE / "gpu" / "ab", HERE / "gpu" / "serving"):
    sys.path.insert(0, str(p))

import clef_http as h  # noqa: E402
import device_clef_vllm as d  # noqa: E402
from clef_vllm_fixtures import burst, score_body, stability  # noqa: E402

from sm70ctl.settings import load_settings  # noqa: E402


def completion(tokens: list[int], lps: list[float], second: float = -3.0) -> dict[str, Any]:
    return {"choices": [{"logprobs": {
        "tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": lps,
        "top_logprobs": [{f"token_id:{t}": lp, "token_id:999": second}
                         for t, lp in zip(tokens, lps, strict=True)]}}]}


def row(tokens: list[int], lps: list[float], margin: float = 1.0) -> dict[str, Any]:
    return {"prompt_len": 3, "tokens": tokens, "logprobs": lps,
            "top2": [[t, lp, 999, lp - margin] for t, lp in zip(tokens, lps, strict=True)]}


def test_completion_row_reads_token_ids_and_the_top_two() -> None:
    r = h.completion_row(completion([5, 7], [-0.1, -0.2]), 3)
    assert r["tokens"] == [5, 7] and r["logprobs"] == [-0.1, -0.2]
    assert r["top2"][0] == [5, -0.1, 999, -3.0]
    bad = completion([5], [-0.1])
    bad["choices"][0]["logprobs"]["tokens"] = ["hello"]
    with pytest.raises(ValueError, match="token_id"):
        h.completion_row(bad, 3)


def test_base_route_must_give_the_chat_rows_tokens_not_the_clef_rows() -> None:
    chat = row([1, 2, 3, 4], [-0.5] * 4)
    clef = row([1, 9, 9, 9], [-0.5] * 4)  # leaves the chat row at step 1
    tol = 0.02
    assert h.base_verdict(row([1, 2, 3, 4], [-0.505] * 4), chat, clef, tol)["passed"]
    # a corrected answer (the route applied Clef) fails
    assert not h.base_verdict(row([1, 9, 9, 9], [-0.5] * 4), chat, clef, tol)["passed"]
    # log-probs beyond the tolerance fail
    assert not h.base_verdict(row([1, 2, 3, 4], [-0.6] * 4), chat, clef, tol)["passed"]
    # a later flip at a near-tie of the chat row passes, at a clear margin it fails
    near = row([1, 2, 3, 4], [-0.5] * 4, margin=0.01)
    assert h.base_verdict(row([1, 2, 7, 7], [-0.5] * 4), near, clef, tol)["passed"]
    assert not h.base_verdict(row([1, 2, 7, 7], [-0.5] * 4), chat, clef, tol)["passed"]
    # a Clef row with the chat row's tokens: told apart by the log-probs, or not at all
    same_tokens = row([1, 2, 3, 4], [-0.3] * 4)
    assert h.base_verdict(chat, chat, same_tokens, tol)["passed"]
    assert not h.base_verdict(same_tokens, chat, same_tokens, tol)["passed"]
    assert not h.base_verdict(chat, chat, chat, tol)["passed"]


def test_scores_must_match_the_engine_side_path() -> None:
    ref = score_body([[0.2, 0.8], [0.5, 0.3, 0.2]])
    assert h.score_verdict(score_body([[0.21, 0.79], [0.5, 0.3, 0.2]]), ref)["passed"]
    assert not h.score_verdict(score_body([[0.8, 0.2], [0.5, 0.3, 0.2]]), ref)["passed"]
    assert not h.score_verdict(score_body([[0.2, 0.8]]), ref)["passed"]  # a question lost
    assert not h.score_verdict(score_body([[0.2, 0.8], [0.5, 0.3, 0.2]], 41), ref)["passed"]


def test_refusals_need_the_openai_error_shape() -> None:
    body = {"error": {"message": "Clef's maximum context is 16,384 tokens", "type":
                      "BadRequestError", "param": "input", "code": 400}}
    assert h.refusal_ok(400, body, "input", "16,384")
    assert not h.refusal_ok(200, body, "input", "16,384")
    assert not h.refusal_ok(400, body, "model", "16,384")
    assert not h.refusal_ok(400, {"detail": "x"}, "input", "16,384")


def serve_view(tmp_path: Path) -> Any:
    """The Clef server's settings as serve loads them."""
    s = h.serve_settings(model_dir=str(tmp_path), clef_dir=str(tmp_path / "clef"),
                         rank=d.RANK, share=0.04, work=str(tmp_path / "w"), startup_s=200,
                         serve_python=sys.executable)
    env = tmp_path / "serve.env"
    env.write_text("".join(f"{k}={v}\n" for k, v in s.items()))
    return load_settings(env_file=env)


def test_the_serve_settings_load_and_turn_clef_on(tmp_path: Path) -> None:
    view = serve_view(tmp_path)
    assert view.clef and view.clef_rank == d.RANK
    assert view.clef_max_model_len == h.CLEF_MAX_LEN <= view.max_model_len
    # the server's rows are judged against engine rows run on TRITON_ATTN (ab_side's default)
    assert view.attention_backend == "TRITON_ATTN"


def test_stability_needs_every_burst_with_its_image_requests() -> None:
    good = [burst() for _ in range(d.BURSTS)]
    assert d.check_stability(stability(good))["passed"]
    lost = copy.deepcopy(good)
    lost[3]["images_ok"] = 1
    assert d.check_stability(stability(lost))["passed"] is False
    assert d.check_stability(stability(good, images=False))["passed"] is False
    grew = copy.deepcopy(good)
    grew[-1]["allocated"] += 64 << 20
    assert d.check_stability(stability(grew))["passed"] is False
    assert d.check_stability(stability(good[:3]))["passed"] is None  # cut by the budget


def test_http_verdict_combines_the_cases() -> None:
    chat = row([1, 2, 3, 4], [-0.5] * 4)
    clef = row([1, 9, 9, 9], [-0.5] * 4)
    ours = {"phases": {"chat_only": {d.HTTP_PROMPT_IDX: chat},
                       "mixed": {d.HTTP_PROMPT_IDX: clef},
                       "http_ref": {"response": score_body([[0.2, 0.8]])}}}
    got = {"base_completion": {"status": 200, "row": chat},
           "base_chat": {"passed": True}, "clef_chat_refused": {"passed": True},
           "clef_too_long": {"passed": True},
           "clef_score": {"status": 200, "body": score_body([[0.2, 0.8]])},
           "clef_no_drafts": h.no_drafts_verdict(3.0, 3.0, 9.0, 200)}
    v = h.judge(got, ours, d.HTTP_PROMPT_IDX, 0.02)
    assert all(c["passed"] for c in v.values())
    assert not h.judge({**got, "clef_no_drafts": h.no_drafts_verdict(3.0, 4.0, 9.0, 200)},
                       ours, d.HTTP_PROMPT_IDX, 0.02)["clef_no_drafts"]["passed"]
    got["clef_score"]["body"] = score_body([[0.6, 0.4]])
    assert not h.judge(got, ours, d.HTTP_PROMPT_IDX, 0.02)["clef_score"]["passed"]
    assert h.judge({}, ours, d.HTTP_PROMPT_IDX, 0.02)["base_chat"]["passed"] is None


def test_a_malformed_score_body_fails_its_case_only() -> None:
    ours = {"phases": {"http_ref": {"response": score_body([[0.2, 0.8]])}}}
    v = h.judge({"clef_score": {"status": 200, "body": "not json"}}, ours, 1, 0.02)
    assert v["clef_score"]["passed"] is False and "error" in v["clef_score"]


METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 12.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 36.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="tiny"} 1.7e9
"""


def test_verified_drafts_reads_only_the_drafts_counter() -> None:
    assert h.verified_drafts(METRICS) == 12.0
    two = METRICS + 'vllm:spec_decode_num_drafts_total{engine="1",model_name="tiny"} 3.0\n'
    assert h.verified_drafts(two) == 15.0
    assert h.verified_drafts("vllm:num_requests_running 0.0\n") is None


def test_a_scoring_request_must_verify_no_draft_while_a_chat_does() -> None:
    assert h.no_drafts_verdict(12.0, 12.0, 20.0, 200)["passed"]
    # the scoring request entered speculation
    assert not h.no_drafts_verdict(12.0, 13.0, 20.0, 200)["passed"]
    # speculation off (or not counted): nothing is proven
    assert not h.no_drafts_verdict(12.0, 12.0, 12.0, 200)["passed"]
    assert not h.no_drafts_verdict(None, None, None, 200)["passed"]
    # the scoring request failed
    assert not h.no_drafts_verdict(12.0, 12.0, 20.0, 500)["passed"]


def test_the_server_speculates_so_the_drafts_case_has_drafts_to_count(tmp_path: Path) -> None:
    view = serve_view(tmp_path)
    assert view.spec_method == "mtp" and view.spec_tokens == 3
