"""Which requests are Clef, how long they may be, and that they never speculate (pure).

A request is Clef when its `model` field is the Clef name. No setting names it yet (the
schema's 98 have none; `SM70_CLEF_SERVED_MODEL_NAME` would be the one), so the Clef name is
SM70_SERVED_MODEL_NAME + CLEF_SUFFIX: `qwen3.8-27b-clef` with the defaults.

Clef scores, it does not write: a Clef request is one prefill through the corrected layers
and the head, on the scoring route only; a generation route naming Clef is refused, and a
Clef row is never given draft tokens (it has no decode step to speculate on). Its prompt
(the input and the rendered questions) may hold at most SM70_CLEF_MAX_MODEL_LEN tokens.

Errors are `RequestError`s carrying the HTTP status and the OpenAI-style body vLLM's API
server sends (`{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_patch.clef.errors import ClefError

CLEF_SUFFIX = "-clef"
SCORE_ROUTE = "/v1/clef/score"
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_TYPES = {400: "BadRequestError", 404: "NotFoundError"}


class RequestError(ClefError):
    """A request we refuse: HTTP `status`, the request field it concerns (`param`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.status, self.param)


def error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response, in vLLM's ErrorResponse shape."""
    return {"error": {"message": message, "type": _TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


def clef_model_name(served_model_name: str) -> str:
    return served_model_name + CLEF_SUFFIX


@dataclass(frozen=True)
class Route:
    clef: bool
    max_model_len: int
    speculative: bool


def route(model: Any, path: str, served_model_name: str, clef_enabled: bool,
          max_model_len: int, clef_max_model_len: int, spec_tokens: int) -> Route:
    """How a request for `model` on `path` is served; RequestError when it cannot be.

    Only the names this module decides are judged here: another name on a generation route
    is left to vLLM's own model check (Route of the base model)."""
    clef_name = clef_model_name(served_model_name)
    is_clef = model == clef_name
    if is_clef and not clef_enabled:
        raise RequestError(f"The model `{clef_name}` does not exist (Clef is off: "
                           "SM70_CLEF=false).", 404, "model")
    if path == SCORE_ROUTE:
        if not clef_enabled:
            raise RequestError(f"{SCORE_ROUTE} is served only with SM70_CLEF=true.", 404)
        if not is_clef:
            raise RequestError(f"{SCORE_ROUTE} scores with `{clef_name}` only; got model "
                               f"{model!r}.", 400, "model")
        return Route(True, clef_max_model_len, False)
    if is_clef:
        raise RequestError(f"`{clef_name}` is a scoring model and does not generate text: "
                           f"POST {SCORE_ROUTE}.", 400, "model")
    return Route(False, max_model_len, spec_tokens > 0)


def check_prompt_length(r: Route, prompt_tokens: int) -> None:
    """Refuse a prompt longer than the route's context (Clef's prompt is all it reads)."""
    if r.clef and prompt_tokens > r.max_model_len:
        raise RequestError(
            f"This Clef request has {prompt_tokens:,} prompt tokens (input and rendered "
            f"questions); Clef's maximum context is {r.max_model_len:,} tokens "
            "(SM70_CLEF_MAX_MODEL_LEN).", 400, "input")


def draft_tokens(clef_rows: Sequence[bool], spec_tokens: int) -> list[int]:
    """Draft tokens each scheduled request may get this step: none for a Clef request."""
    return [0 if clef else spec_tokens for clef in clef_rows]
