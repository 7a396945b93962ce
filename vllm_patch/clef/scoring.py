"""The scoring endpoint's request and response (POST /v1/clef/score; docs/clef.md), pure.

`validate_request` turns the parsed JSON body into a `ScoreRequest` or raises a
`RequestError` (HTTP 400) whose message names the field, the value and the rule, and whose
`param` is the field's path (`questions[2].options[1]`). `build_response` turns the head's
per-option logits into the response body: a softmax over a choice's options or a score's
values, an independent sigmoid per likelihood option.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_patch.clef.head import KINDS, MAX_QUESTIONS, HeadConfig
from vllm_patch.clef.routing import RequestError

MAX_ID_CHARS = 64
_ID = re.compile(r"^[A-Za-z0-9_.:-]+$")
MAX_SCORE_BOUND = 1_000_000
REQUEST_FIELDS = {"model", "input", "questions"}
QUESTION_FIELDS = {"choice": {"id", "kind", "text", "options"},
                   "likelihood": {"id", "kind", "text", "options"},
                   "score": {"id", "kind", "text", "range"}}
MIN_OPTIONS = {"choice": 2, "likelihood": 1}


@dataclass(frozen=True)
class Limits:
    """What one request may ask; `max_questions` is SM70_CLEF_MAX_QUESTIONS, the option
    limits are the head config's (clef.json), the text limits bound what the server
    tokenizes before the token limit (SM70_CLEF_MAX_MODEL_LEN) can be checked."""

    max_questions: int = MAX_QUESTIONS
    max_options: int = 32
    max_score_values: int = 101
    max_input_chars: int = 262_144
    max_text_chars: int = 2_000
    max_option_chars: int = 200


@dataclass(frozen=True)
class Question:
    id: str
    kind: str
    text: str
    options: tuple[str, ...] | tuple[int, ...]  # a score's options are its range's values


@dataclass(frozen=True)
class ScoreRequest:
    model: str
    input: str
    questions: tuple[Question, ...]


def _fail(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", 400, param)


def _text(raw: Mapping[str, Any], key: str, param: str, limit: int) -> str:
    v = raw.get(key)
    if not isinstance(v, str) or not v.strip():
        raise _fail(param, "must be a non-empty string")
    if len(v) > limit:
        raise _fail(param, f"is {len(v):,} characters long; at most {limit:,}")
    return v


def _int(v: Any, param: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or abs(v) > MAX_SCORE_BOUND:
        raise _fail(param, f"= {v!r} is not an integer from -{MAX_SCORE_BOUND:,} to "
                           f"{MAX_SCORE_BOUND:,}")
    return v


def _score_values(raw: Any, param: str, lim: Limits) -> tuple[int, ...]:
    if not isinstance(raw, Mapping) or not {"min", "max"} <= set(raw) <= {"min", "max", "step"}:
        raise _fail(param, "must be an object {\"min\": int, \"max\": int, \"step\": int "
                           "(optional, 1)}")
    lo, hi = _int(raw["min"], f"{param}.min"), _int(raw["max"], f"{param}.max")
    step = _int(raw.get("step", 1), f"{param}.step")
    if lo >= hi:
        raise _fail(param, f"min {lo} must be below max {hi}")
    if step < 1 or (hi - lo) % step:
        raise _fail(f"{param}.step", f"= {step} must be a positive integer dividing "
                                     f"max - min = {hi - lo}")
    count = (hi - lo) // step + 1
    if count > lim.max_score_values:
        raise _fail(param, f"has {count:,} values; the head scores at most "
                           f"{lim.max_score_values}")
    return tuple(range(lo, hi + 1, step))


def _options(raw: Any, kind: str, param: str, lim: Limits) -> tuple[str, ...]:
    least = MIN_OPTIONS[kind]
    if not isinstance(raw, list) or len(raw) < least:
        raise _fail(param, f"a {kind} question needs a list of at least {least} option"
                           f"{'s' if least > 1 else ''}")
    if len(raw) > lim.max_options:
        raise _fail(param, f"has {len(raw)} options; at most {lim.max_options}")
    seen: dict[str, int] = {}
    out: list[str] = []
    for j, o in enumerate(raw):
        p = f"{param}[{j}]"
        if not isinstance(o, str) or not o.strip():
            raise _fail(p, "must be a non-empty string")
        if len(o) > lim.max_option_chars:
            raise _fail(p, f"is {len(o):,} characters long; at most {lim.max_option_chars}")
        key = o.strip().casefold()
        if key in seen:
            raise _fail(p, f"{o!r} repeats option {seen[key]} (options are compared "
                           "ignoring case and surrounding spaces)")
        seen[key] = j
        out.append(o)
    return tuple(out)


def _question(raw: Any, i: int, lim: Limits) -> Question:
    param = f"questions[{i}]"
    if not isinstance(raw, Mapping):
        raise _fail(param, "must be an object")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise _fail(f"{param}.kind", f"= {kind!r} is not one of {list(KINDS)}")
    extra = sorted(set(raw) - QUESTION_FIELDS[kind])
    if extra:
        raise _fail(param, f"unknown field {extra[0]!r} for a {kind} question (fields: "
                           f"{sorted(QUESTION_FIELDS[kind])})")
    qid = raw.get("id")
    if not isinstance(qid, str) or not _ID.match(qid) or len(qid) > MAX_ID_CHARS:
        raise _fail(f"{param}.id", f"= {qid!r} must be 1-{MAX_ID_CHARS} characters of "
                                   "letters, digits, _ . : -")
    text = _text(raw, "text", f"{param}.text", lim.max_text_chars)
    if kind == "score":
        if "range" not in raw:
            raise _fail(f"{param}.range", "a score question needs a range")
        options: tuple[str, ...] | tuple[int, ...] = _score_values(raw["range"],
                                                                    f"{param}.range", lim)
    else:
        options = _options(raw.get("options"), kind, f"{param}.options", lim)
    return Question(qid, kind, text, options)


def validate_request(raw: Any, lim: Limits) -> ScoreRequest:
    """The request, or RequestError on the first rule it breaks."""
    if not isinstance(raw, Mapping):
        raise _fail("body", "must be a JSON object")
    extra = sorted(set(raw) - REQUEST_FIELDS)
    if extra:
        raise _fail(extra[0], f"unknown field (fields: {sorted(REQUEST_FIELDS)})")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model", "must name the Clef model")
    text = _text(raw, "input", "input", lim.max_input_chars)
    qs = raw.get("questions")
    if not isinstance(qs, list) or not qs:
        raise _fail("questions", "must be a non-empty list")
    if len(qs) > lim.max_questions:
        raise _fail("questions", f"has {len(qs)} questions; at most {lim.max_questions} "
                                 "(SM70_CLEF_MAX_QUESTIONS)")
    questions = tuple(_question(q, i, lim) for i, q in enumerate(qs))
    first: dict[str, int] = {}
    for i, q in enumerate(questions):
        if q.id in first:
            raise _fail(f"questions[{i}].id", f"{q.id!r} repeats questions[{first[q.id]}].id")
        first[q.id] = i
    return ScoreRequest(model, text, questions)


def _softmax(xs: Sequence[float]) -> list[float]:
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    s = sum(e)
    return [v / s for v in e]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def build_response(req: ScoreRequest, logits: Sequence[Sequence[float]], prompt_tokens: int,
                   response_id: str, created: int) -> dict[str, Any]:
    """The response body from the head's logits, one list per question, one logit per
    option in request order. ValueError if the logits do not match the request."""
    if len(logits) != len(req.questions):
        raise ValueError(f"head gave {len(logits)} logit lists for {len(req.questions)} "
                         "questions")
    results = []
    for q, row in zip(req.questions, logits, strict=True):
        if len(row) != len(q.options) or not all(math.isfinite(x) for x in row):
            raise ValueError(f"question {q.id!r}: head gave {len(row)} logits (finite: "
                             f"{all(math.isfinite(x) for x in row)}) for {len(q.options)} "
                             "options")
        scores = [_sigmoid(x) for x in row] if q.kind == "likelihood" else _softmax(row)
        result: dict[str, Any] = {
            "id": q.id, "kind": q.kind,
            "scores": [{"option": o, "score": s} for o, s in zip(q.options, scores,
                                                                 strict=True)],
        }
        if q.kind == "choice":
            result["best"] = q.options[max(range(len(scores)), key=scores.__getitem__)]
        elif q.kind == "score":
            result["expected"] = sum(float(o) * s for o, s in zip(q.options, scores,
                                                                  strict=True))
        results.append(result)
    return {"id": response_id, "object": "clef.score", "created": created,
            "model": req.model, "results": results,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def limits_for(head: HeadConfig, max_questions: int) -> Limits:
    """A request's limits: SM70_CLEF_MAX_QUESTIONS within what the head was built for."""
    return Limits(max_questions=min(max_questions, head.max_questions),
                  max_options=head.max_options, max_score_values=head.max_score_values)
