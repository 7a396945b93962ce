"""The scoring endpoint's request validation (every refusal names its field and rule, as an
HTTP 400 body) and the response shape built from the head's logits."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from clef_fixture import TINY_HEAD

from vllm_patch.clef.head import parse_head_config
from vllm_patch.clef.routing import RequestError
from vllm_patch.clef.scoring import Limits, build_response, limits_for, validate_request

LIM = Limits()


def good() -> dict[str, Any]:
    return {
        "model": "qwen3.8-27b-clef",
        "input": "Refund my order, it arrived broken.",
        "questions": [
            {"id": "topic", "kind": "choice", "text": "What is it about?",
             "options": ["billing", "shipping", "other"]},
            {"id": "anger", "kind": "score", "text": "How angry, 1-5?",
             "range": {"min": 1, "max": 5}},
            {"id": "flags", "kind": "likelihood", "text": "Does it mention...",
             "options": ["a refund", "a lawyer"]},
        ],
    }


def test_valid_request() -> None:
    req = validate_request(good(), LIM)
    assert [q.kind for q in req.questions] == ["choice", "score", "likelihood"]
    assert req.questions[1].options == (1, 2, 3, 4, 5)
    assert req.questions[0].options == ("billing", "shipping", "other")


def test_score_range_with_step() -> None:
    body = good()
    body["questions"][1]["range"] = {"min": 0, "max": 100, "step": 10}
    assert validate_request(body, LIM).questions[1].options == tuple(range(0, 101, 10))


def _edit(path: list[Any], value: Any, delete: bool = False) -> dict[str, Any]:
    body = copy.deepcopy(good())
    node: Any = body
    for p in path[:-1]:
        node = node[p]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


def _many(n: int) -> dict[str, Any]:
    body = good()
    body["questions"] = [{"id": f"q{i}", "kind": "likelihood", "text": "t", "options": ["x"]}
                         for i in range(n)]
    return body


CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("too many questions", _many(65), "questions",
     "has 65 questions; at most 64 (SM70_CLEF_MAX_QUESTIONS)"),
    ("no questions", _edit(["questions"], []), "questions", "must be a non-empty list"),
    ("empty options", _edit(["questions", 0, "options"], []), "questions[0].options",
     "a choice question needs a list of at least 2 options"),
    ("one choice", _edit(["questions", 0, "options"], ["a"]), "questions[0].options",
     "at least 2 options"),
    ("empty likelihood", _edit(["questions", 2, "options"], []), "questions[2].options",
     "a likelihood question needs a list of at least 1 option"),
    ("duplicate option", _edit(["questions", 0, "options"], ["billing", " Billing "]),
     "questions[0].options[1]", "' Billing ' repeats option 0"),
    ("blank option", _edit(["questions", 2, "options", 1], "  "), "questions[2].options[1]",
     "must be a non-empty string"),
    ("option not text", _edit(["questions", 2, "options", 1], 3), "questions[2].options[1]",
     "must be a non-empty string"),
    ("too many options", _edit(["questions", 0, "options"], [f"o{i}" for i in range(33)]),
     "questions[0].options", "has 33 options; at most 32"),
    ("unknown kind", _edit(["questions", 0, "kind"], "ranking"), "questions[0].kind",
     "= 'ranking' is not one of ['choice', 'score', 'likelihood']"),
    ("range reversed", _edit(["questions", 1, "range"], {"min": 5, "max": 1}),
     "questions[1].range", "min 5 must be below max 1"),
    ("range equal", _edit(["questions", 1, "range"], {"min": 3, "max": 3}),
     "questions[1].range", "min 3 must be below max 3"),
    ("range step", _edit(["questions", 1, "range"], {"min": 0, "max": 10, "step": 3}),
     "questions[1].range.step", "= 3 must be a positive integer dividing max - min = 10"),
    ("range zero step", _edit(["questions", 1, "range"], {"min": 0, "max": 10, "step": 0}),
     "questions[1].range.step", "= 0 must be a positive integer"),
    ("range float", _edit(["questions", 1, "range"], {"min": 0.5, "max": 10}),
     "questions[1].range.min", "= 0.5 is not an integer"),
    ("range not object", _edit(["questions", 1, "range"], [1, 5]), "questions[1].range",
     "must be an object"),
    ("range extra key", _edit(["questions", 1, "range"], {"min": 1, "max": 5, "by": 1}),
     "questions[1].range", "must be an object"),
    ("range too wide", _edit(["questions", 1, "range"], {"min": 0, "max": 200}),
     "questions[1].range", "has 201 values; the head scores at most 101"),
    ("score without range", _edit(["questions", 1, "range"], None, delete=True),
     "questions[1].range", "a score question needs a range"),
    ("score with options", _edit(["questions", 1, "options"], ["1", "2"]), "questions[1]",
     "unknown field 'options' for a score question"),
    ("choice with range", _edit(["questions", 0, "range"], {"min": 1, "max": 2}),
     "questions[0]", "unknown field 'range' for a choice question"),
    ("input too long", _edit(["input"], "x" * 262_145), "input",
     "is 262,145 characters long; at most 262,144"),
    ("question too long", _edit(["questions", 0, "text"], "y" * 2_001), "questions[0].text",
     "is 2,001 characters long; at most 2,000"),
    ("option too long", _edit(["questions", 0, "options", 0], "z" * 201),
     "questions[0].options[0]", "is 201 characters long; at most 200"),
    ("empty input", _edit(["input"], ""), "input", "must be a non-empty string"),
    ("duplicate id", _edit(["questions", 2, "id"], "topic"), "questions[2].id",
     "'topic' repeats questions[0].id"),
    ("bad id", _edit(["questions", 0, "id"], "a b"), "questions[0].id", "must be 1-64"),
    ("unknown field", _edit(["temperature"], 0.5), "temperature", "unknown field"),
    ("no model", _edit(["model"], None, delete=True), "model", "must name the Clef model"),
    ("question not object", _edit(["questions", 0], "x"), "questions[0]", "must be an object"),
]


@pytest.mark.parametrize(("case", "body", "param", "message"), CASES, ids=[c[0] for c in CASES])
def test_refusals(case: str, body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(RequestError) as e:
        validate_request(body, LIM)
    assert e.value.status == 400
    assert e.value.param == param
    assert str(e.value).startswith(f"{param}: ")
    assert message in str(e.value)
    assert e.value.body()["error"]["param"] == param


def test_not_an_object() -> None:
    with pytest.raises(RequestError, match="body: must be a JSON object"):
        validate_request([good()], LIM)


def test_limits_follow_setting_and_head() -> None:
    head = parse_head_config({**TINY_HEAD, "max_questions": 8, "max_options": 4}, 32)
    lim = limits_for(head, 64)
    assert (lim.max_questions, lim.max_options) == (8, 4)  # the head's bound wins
    assert limits_for(parse_head_config(TINY_HEAD, 32), 16).max_questions == 16
    with pytest.raises(RequestError, match="has 9 questions; at most 8"):
        validate_request(_many(9), lim)
    with pytest.raises(RequestError, match="has 5 options; at most 4"):
        validate_request(_edit(["questions", 0, "options"], list("abcde")), lim)


# ------------------------------------------------------------------ the response
def test_response_shape_and_scores() -> None:
    req = validate_request(good(), LIM)
    logits = [[2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, math.log(4.0)], [0.0, -math.log(3.0)]]
    out = build_response(req, logits, prompt_tokens=120, response_id="clef-1", created=7)
    assert {k: out[k] for k in ("id", "object", "created", "model", "usage")} == {
        "id": "clef-1", "object": "clef.score", "created": 7, "model": "qwen3.8-27b-clef",
        "usage": {"prompt_tokens": 120, "total_tokens": 120}}
    topic, anger, flags = out["results"]
    assert [s["option"] for s in topic["scores"]] == ["billing", "shipping", "other"]
    e2 = math.exp(2.0)
    assert [s["score"] for s in topic["scores"]] == pytest.approx(
        [e2 / (e2 + 2), 1 / (e2 + 2), 1 / (e2 + 2)])
    assert topic["best"] == "billing"
    # softmax of (0,0,0,0,log 4): 1/8 each, 4/8 for 5
    assert [s["score"] for s in anger["scores"]] == pytest.approx([1 / 8] * 4 + [0.5])
    assert anger["expected"] == pytest.approx((1 + 2 + 3 + 4) / 8 + 2.5)
    assert [s["option"] for s in anger["scores"]] == [1, 2, 3, 4, 5]
    # likelihoods are independent sigmoids: 1/2 and 1/4, not a distribution
    assert [s["score"] for s in flags["scores"]] == pytest.approx([0.5, 0.25])
    assert "best" not in flags and "expected" not in flags


def test_response_is_stable_for_large_logits() -> None:
    req = validate_request(good(), LIM)
    out = build_response(req, [[1000.0, 0.0, -1000.0], [0.0] * 5, [800.0, -800.0]], 1, "c", 0)
    assert out["results"][0]["scores"][0]["score"] == pytest.approx(1.0)
    assert [s["score"] for s in out["results"][2]["scores"]] == pytest.approx([1.0, 0.0])


@pytest.mark.parametrize("logits", [
    [[0.0, 0.0, 0.0], [0.0] * 5],
    [[0.0, 0.0], [0.0] * 5, [0.0, 0.0]],
    [[0.0, 0.0, float("nan")], [0.0] * 5, [0.0, 0.0]],
])
def test_response_refuses_mismatched_logits(logits: list[list[float]]) -> None:
    with pytest.raises(ValueError, match="head gave"):
        build_response(validate_request(good(), LIM), logits, 1, "c", 0)
