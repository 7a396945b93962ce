"""Clef in vLLM's OpenAI API server: an ASGI middleware (`--middleware
vllm_patch.clef.api.ClefMiddleware`, added by `sm70ctl serve` when SM70_CLEF is on).

- `POST /v1/clef/score` is answered here: the body is checked (`routing.route`,
  `scoring.validate_request`), rendered into one prompt (`render`), its length held to
  Clef's context (`routing.check_prompt_length`), and sent to the engine as ONE request of
  one generated token with the Clef flag and the head's reading plan in
  `SamplingParams.extra_args` (`batch`), and a cache salt of its own (its KV and GDN state
  come from the corrected layers and must never be shared with chat or another request).
  The worker's runner hook (R6) scores it; the scores come back through vLLM's
  `collective_rpc` to `ClefWorkerExtension.sm70_clef_take` (`--worker-extension-cls`).
- Any other POST: a body naming the Clef model on a generation route is refused (Clef
  scores, it does not write), and so is one whose `vllm_xargs` carries an `sm70_clef*` key
  (the flag is the scoring route's alone: a chat request may not turn itself into Clef
  rows). Bodies that cannot hold either (no marker bytes) pass untouched and unparsed.

Errors are HTTP 400/404 with vLLM's error body (`routing.error_body`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from vllm_patch.clef.batch import CLEF_ARG, SCORE_ARG
from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.routing import (
    GENERATION_ROUTES,
    SCORE_ROUTE,
    RequestError,
    check_prompt_length,
    clef_model_name,
    error_body,
    route,
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

RESERVED_PREFIX = "sm70_clef"
TAKE_METHOD = "sm70_clef_take"
# a scoring body is bounded by its fields' limits (scoring.Limits); 2 MiB holds the largest
MAX_SCORE_BODY = 2 * 1024 * 1024


# ------------------------------------------------------------------ deciding (pure)
def _markers(clef_name: str) -> tuple[bytes, ...]:
    # JSON may spell any key or value with \u escapes, so an escape means "parse it"
    return (RESERVED_PREFIX.encode(), b"vllm_xargs", clef_name.encode(), b"\\u")


def judge_post(path: str, body: bytes, served_name: str, clef_enabled: bool,
               max_model_len: int, clef_max_model_len: int) -> RequestError | None:
    """Whether a POST other than the scoring route may go on to vLLM (None) or is refused."""
    clef_name = clef_model_name(served_name)
    if not any(m in body for m in _markers(clef_name)):
        return None
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        # not JSON (a form upload): the reserved name may not appear in it at all
        if RESERVED_PREFIX.encode() in body:
            return RequestError(f"`{RESERVED_PREFIX}*` fields are reserved for "
                                f"{SCORE_ROUTE}.", 400, "vllm_xargs")
        return None
    if not isinstance(raw, Mapping):
        return None
    xargs = raw.get("vllm_xargs")
    if isinstance(xargs, Mapping):
        bad = sorted(k for k in xargs if isinstance(k, str) and k.startswith(RESERVED_PREFIX))
        if bad:
            return RequestError(f"vllm_xargs.{bad[0]} is reserved: Clef requests are made "
                                f"on {SCORE_ROUTE} with model `{clef_name}`.", 400,
                                f"vllm_xargs.{bad[0]}")
    if path in GENERATION_ROUTES:
        try:
            route(raw.get("model"), path, served_name, clef_enabled, max_model_len,
                  clef_max_model_len, 0)
        except RequestError as exc:
            return exc
    return None


def score_args(key: str, positions: list[int], roles: list[int],
               kinds: list[int]) -> dict[str, Any]:
    """The scoring request's extra_args (what the runner hook reads, `batch.score_spec`)."""
    return {CLEF_ARG: 1, SCORE_ARG: {"key": key, "positions": positions, "roles": roles,
                                     "kinds": kinds}}


def first_scores(results: Any, count: int) -> list[float]:
    """The scores from collective_rpc's per-worker answers (every TP rank of the last
    stage scores the same hidden states; the first answer is taken)."""
    for r in results if isinstance(results, list) else [results]:
        if r is not None:
            if len(r) != count:
                raise ClefError(f"the head gave {len(r)} scores for {count} positions")
            return [float(v) for v in r]
    raise ClefError("no worker held the request's scores (was the Clef runner hook installed "
                    "in the workers? plugin config clef.enabled)")


# ------------------------------------------------------------------ the ASGI side
async def _read_body(receive: Receive, limit: int | None) -> tuple[bytes, list[Any]]:
    chunks: list[bytes] = []
    messages: list[Any] = []
    size = 0
    while True:
        msg = await receive()
        messages.append(msg)
        if msg["type"] != "http.request":
            break
        part = msg.get("body", b"")
        size += len(part)
        if limit is not None and size > limit:
            raise RequestError(f"the request body is over {limit:,} bytes", 400, "body")
        chunks.append(part)
        if not msg.get("more_body", False):
            break
    return b"".join(chunks), messages


def _replay(messages: list[Any], receive: Receive) -> Receive:
    queue = list(messages)

    async def replay() -> MutableMapping[str, Any]:
        if queue:
            return queue.pop(0)
        return await receive()

    return replay


async def send_json(send: Send, status: int, payload: Mapping[str, Any]) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _served_name(scope: Scope) -> str:
    state = getattr(scope.get("app"), "state", None)
    args = getattr(state, "args", None)
    names = getattr(args, "served_model_name", None)
    if isinstance(names, list | tuple) and names:
        return str(names[0])
    if isinstance(names, str) and names:
        return names
    return str(getattr(args, "model", ""))


class ClefMiddleware:
    """vLLM's app with Clef's route and refusals in front (see the module docstring)."""

    def __init__(self, app: Callable[..., Awaitable[None]],
                 config: Any | None = None) -> None:
        from vllm_patch.config import PluginConfig

        self.app = app
        self.cfg = config if config is not None else PluginConfig.from_env().clef
        self._limits: Any = None
        self._kinds: tuple[str, ...] = ()
        # vLLM's SamplingParams (imported on first use); a stand-in in the CPU tests
        self.make_params: Callable[..., Any] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        try:
            body, messages = await _read_body(
                receive, MAX_SCORE_BODY if path == SCORE_ROUTE else None)
        except RequestError as exc:
            await send_json(send, exc.status, exc.body())
            return
        served = _served_name(scope)
        max_len = int(getattr(getattr(getattr(scope.get("app"), "state", None), "args", None),
                              "max_model_len", None) or 0) or self.cfg.max_model_len
        if path == SCORE_ROUTE:
            status, payload = await self.score(scope, body, served, max_len)
            await send_json(send, status, payload)
            return
        err = judge_post(path, body, served, self.cfg.enabled, max_len,
                         self.cfg.max_model_len)
        if err is not None:
            await send_json(send, err.status, err.body())
            return
        await self.app(scope, _replay(messages, receive), send)

    # -- the scoring route --------------------------------------------------------------
    def limits(self, state: Any) -> tuple[Any, tuple[str, ...]]:
        """The request limits and the head's kinds, from SM70_CLEF_DIR's manifest."""
        if self._limits is None:
            from vllm_patch.clef.manifest import parse_manifest
            from vllm_patch.clef.model_dims import model_dims
            from vllm_patch.clef.scoring import limits_for
            from vllm_patch.clef.validate import read_manifest

            hf = state.vllm_config.model_config.hf_config.to_dict()
            m = parse_manifest(read_manifest(Path(self.cfg.dir).expanduser()),
                               model_dims(hf), self.cfg.rank)
            self._limits = limits_for(m.head, self.cfg.max_questions)
            self._kinds = m.head.kinds
        return self._limits, self._kinds

    async def score(self, scope: Scope, body: bytes, served: str,
                    max_len: int) -> tuple[int, dict[str, Any]]:
        from vllm_patch.clef.render import option_logits, render
        from vllm_patch.clef.scoring import build_response, validate_request

        try:
            try:
                raw = json.loads(body)
            except (ValueError, RecursionError):
                raise RequestError("the body is not valid JSON", 400, "body") from None
            model = raw.get("model") if isinstance(raw, Mapping) else None
            r = route(model, SCORE_ROUTE, served, self.cfg.enabled, max_len,
                      self.cfg.max_model_len, 0)
            state = scope["app"].state
            lim, kinds = self.limits(state)
            req = validate_request(raw, lim)
            engine = state.engine_client
            tok = engine.get_tokenizer()
            if inspect.isawaitable(tok):
                tok = await tok
            rendered = render(req, lambda s: tok.encode(s, add_special_tokens=False), kinds)
            check_prompt_length(r, len(rendered.token_ids))
            logits = await run_scoring(engine, rendered, self.make_params)
        except RequestError as exc:
            return exc.status, exc.body()
        except ClefError as exc:
            return 500, error_body(str(exc), 500)
        key = uuid.uuid4().hex
        return 200, build_response(req, option_logits(rendered, logits),
                                   len(rendered.token_ids), f"clef-{key}", int(time.time()))


async def run_scoring(engine: Any, rendered: Any,
                      make_params: Callable[..., Any] | None = None) -> list[float]:
    """One engine request for the rendered schema; the head's per-position logits.

    One generated token: the request ends with its prefill, so it is never scheduled
    for a decode step and never gets draft tokens to verify (vLLM 0.22.1 has no
    per-request switch for speculative decoding)."""
    if make_params is None:
        from vllm import SamplingParams as make_params

    key = uuid.uuid4().hex
    sp = make_params(max_tokens=1, temperature=0.0, detokenize=False,
                     extra_args=score_args(key, rendered.positions, rendered.roles,
                                           rendered.kinds))
    prompt = {"prompt_token_ids": rendered.token_ids, "cache_salt": key}
    try:
        async for _out in engine.generate(prompt, sp, request_id=f"clef-{key}"):
            pass
    except asyncio.CancelledError:
        await engine.collective_rpc(TAKE_METHOD, args=(key,))  # drop what was computed
        raise
    return first_scores(await engine.collective_rpc(TAKE_METHOD, args=(key,)),
                        len(rendered.positions))
