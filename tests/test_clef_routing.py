"""Clef's routing rules: chosen by model name, its context limit as an HTTP 400 body naming
the limit, and no draft tokens for Clef rows."""

from __future__ import annotations

import pytest

from vllm_patch.clef.routing import (
    SCORE_ROUTE,
    RequestError,
    check_prompt_length,
    clef_model_name,
    draft_tokens,
    route,
)

SERVED = "qwen3.8-27b"
ARGS = {"served_model_name": SERVED, "clef_enabled": True, "max_model_len": 262144,
        "clef_max_model_len": 16384, "spec_tokens": 3}


def test_clef_name_is_the_served_name_plus_suffix() -> None:
    assert clef_model_name(SERVED) == "qwen3.8-27b-clef"


def test_clef_request_on_the_scoring_route() -> None:
    r = route("qwen3.8-27b-clef", SCORE_ROUTE, **ARGS)
    assert r.clef and r.max_model_len == 16384 and not r.speculative


def test_chat_request_keeps_the_base_model() -> None:
    r = route(SERVED, "/v1/chat/completions", **ARGS)
    assert not r.clef and r.max_model_len == 262144 and r.speculative
    assert not route(SERVED, "/v1/chat/completions", **{**ARGS, "spec_tokens": 0}).speculative


@pytest.mark.parametrize(("model", "path", "clef_on", "status", "message"), [
    ("qwen3.8-27b-clef", "/v1/chat/completions", True, 400,
     "`qwen3.8-27b-clef` is a scoring model and does not generate text: POST /v1/clef/score"),
    ("qwen3.8-27b-clef", "/v1/completions", True, 400, "does not generate text"),
    (SERVED, SCORE_ROUTE, True, 400,
     "/v1/clef/score scores with `qwen3.8-27b-clef` only; got model 'qwen3.8-27b'"),
    ("qwen3.8-27b-clef", SCORE_ROUTE, False, 404,
     "The model `qwen3.8-27b-clef` does not exist (Clef is off: SM70_CLEF=false)"),
    (SERVED, SCORE_ROUTE, False, 404, "served only with SM70_CLEF=true"),
])
def test_refused_routes(model: str, path: str, clef_on: bool, status: int,
                        message: str) -> None:
    with pytest.raises(RequestError) as e:
        route(model, path, **{**ARGS, "clef_enabled": clef_on})
    assert message in str(e.value)
    assert e.value.status == status
    body = e.value.body()
    assert body["error"]["code"] == status
    assert body["error"]["type"] == ("BadRequestError" if status == 400 else "NotFoundError")


def test_clef_context_limit_is_a_400_naming_the_limit() -> None:
    r = route("qwen3.8-27b-clef", SCORE_ROUTE, **ARGS)
    check_prompt_length(r, 16384)  # at the limit: accepted
    with pytest.raises(RequestError) as e:
        check_prompt_length(r, 16385)
    body = e.value.body()
    assert body == {"error": {
        "message": "This Clef request has 16,385 prompt tokens (input and rendered questions); "
                   "Clef's maximum context is 16,384 tokens (SM70_CLEF_MAX_MODEL_LEN).",
        "type": "BadRequestError", "param": "input", "code": 400}}


def test_the_limit_follows_the_setting() -> None:
    r = route("qwen3.8-27b-clef", SCORE_ROUTE, **{**ARGS, "clef_max_model_len": 8192})
    with pytest.raises(RequestError, match="maximum context is 8,192 tokens"):
        check_prompt_length(r, 8193)


def test_chat_length_is_left_to_vllm() -> None:
    check_prompt_length(route(SERVED, "/v1/chat/completions", **ARGS), 100_000)


def test_clef_rows_never_get_draft_tokens() -> None:
    assert draft_tokens([False, True, False, True], 3) == [3, 0, 3, 0]
    assert draft_tokens([True], 7) == [0]
    assert draft_tokens([], 3) == []
