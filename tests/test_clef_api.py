"""Clef's ASGI middleware (vllm_patch/clef/api.py) in front of a stand-in app and engine:
what passes to vLLM untouched, what is refused, and the scoring route's one engine request
and its response; the prompt rendering (vllm_patch/clef/render.py); the serve words."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from clef_fixture import TINY_CONFIG, write_clef_dir

from vllm_patch.clef import api
from vllm_patch.clef.render import option_logits, render
from vllm_patch.clef.scoring import Limits, validate_request
from vllm_patch.config import ClefConfig

SERVED = "qwen3.8-27b"
CLEF = SERVED + "-clef"
KINDS = ("choice", "score", "likelihood")


def tokenize(text: str) -> list[int]:
    """One token per word (spaces and newlines split), ids from the word's characters."""
    return [sum(map(ord, w)) % 997 for w in text.replace("\n", " ").split(" ") if w]


class Tok:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return tokenize(text)


class Engine:
    """generate() records the request; collective_rpc answers with logit = position index."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.rpcs: list[tuple[str, tuple]] = []

    def get_tokenizer(self) -> Tok:
        return Tok()

    async def generate(self, prompt: Any, sp: Any, request_id: str) -> Any:
        self.calls.append({"prompt": prompt, "sp": sp, "request_id": request_id})
        yield SimpleNamespace(finished=True)

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.rpcs.append((method, args))
        n = len(self.calls[-1]["sp"]["extra_args"]["sm70_clef_score"]["positions"])
        return [None, [float(i) for i in range(n)]]


class App:
    """The stand-in for vLLM's app: records the bodies it receives, answers 200."""

    def __init__(self, clef_dir: Path) -> None:
        self.bodies: list[bytes] = []
        hf = SimpleNamespace(to_dict=lambda: json.loads(json.dumps(TINY_CONFIG)))
        self.state = SimpleNamespace(
            args=SimpleNamespace(served_model_name=[SERVED], max_model_len=4096),
            engine_client=Engine(),
            vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=hf)))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        self.bodies.append(body)
        await api.send_json(send, 200, {"ok": True})


@pytest.fixture(scope="module")
def clef_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_clef_dir(tmp_path_factory.mktemp("clef") / "dir", rank=8)


def call(mw: api.ClefMiddleware, app: App, path: str, body: Any,
         method: str = "POST") -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    # the body arrives in two pieces, as a client may send it
    msgs = [{"type": "http.request", "body": raw[:7], "more_body": True},
            {"type": "http.request", "body": raw[7:], "more_body": False}]
    sent: list[Any] = []

    async def receive() -> Any:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(m: Any) -> None:
        sent.append(m)

    scope = {"type": "http", "method": method, "path": path, "app": app}
    asyncio.run(mw(scope, receive, send))
    status = sent[0]["status"]
    return status, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def make(clef_dir: Path, enabled: bool = True, max_len: int = 16384) -> tuple[Any, App]:
    app = App(clef_dir)
    mw = api.ClefMiddleware(app, ClefConfig(enabled=enabled, dir=str(clef_dir), rank=8,
                                            max_model_len=max_len))
    mw.make_params = lambda **kw: kw
    return mw, app


CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}
SCORE = {"model": CLEF, "input": "Refund my order, it arrived broken.", "questions": [
    {"id": "topic", "kind": "choice", "text": "What is it about?",
     "options": ["billing", "shipping", "other"]},
    {"id": "anger", "kind": "score", "text": "How angry?", "range": {"min": 1, "max": 3}},
    {"id": "flags", "kind": "likelihood", "text": "Mentions", "options": ["a refund"]}]}


# ------------------------------------------------------------------ passing through
def test_a_chat_request_reaches_vllm_byte_for_byte(clef_dir: Path) -> None:
    mw, app = make(clef_dir)
    body = json.dumps(CHAT).encode()
    assert call(mw, app, "/v1/chat/completions", body) == (200, {"ok": True})
    assert app.bodies == [body]


def test_gets_and_other_paths_pass(clef_dir: Path) -> None:
    mw, app = make(clef_dir)
    assert call(mw, app, "/v1/models", b"", method="GET")[0] == 200
    assert call(mw, app, "/tokenize", {"prompt": "x", "model": SERVED})[0] == 200


# ------------------------------------------------------------------ refusals
def test_the_clef_name_on_a_generation_route_is_refused(clef_dir: Path) -> None:
    mw, app = make(clef_dir)
    status, body = call(mw, app, "/v1/chat/completions", {**CHAT, "model": CLEF})
    assert status == 400 and body["error"]["param"] == "model"
    assert "does not generate text" in body["error"]["message"]
    assert app.bodies == []


@pytest.mark.parametrize("raw", [
    json.dumps({**CHAT, "vllm_xargs": {"sm70_clef": 1}}).encode(),
    # the same keys spelled with JSON escapes: still the flag once parsed
    json.dumps({**CHAT, "vllm_xargs": {"sm70_clef": 1}}).replace(
        "sm70_clef", "\\u0073m70_clef").replace("vllm_xargs", "\\u0076llm_xargs").encode(),
    json.dumps({**CHAT, "vllm_xargs": {"sm70_clef_score": "x"}}).encode(),
])
def test_a_chat_request_may_not_set_the_clef_flag(clef_dir: Path, raw: bytes) -> None:
    mw, app = make(clef_dir)
    status, body = call(mw, app, "/v1/completions", raw)
    assert status == 400 and "reserved" in body["error"]["message"]
    assert body["error"]["param"].startswith("vllm_xargs.sm70_clef")
    assert app.bodies == []


def test_other_vllm_xargs_pass(clef_dir: Path) -> None:
    mw, app = make(clef_dir)
    assert call(mw, app, "/v1/completions", {**CHAT, "vllm_xargs": {"x": 1}})[0] == 200


def test_with_clef_off_the_route_and_the_name_are_404(clef_dir: Path) -> None:
    mw, app = make(clef_dir, enabled=False)
    assert call(mw, app, "/v1/clef/score", SCORE)[0] == 404
    assert call(mw, app, "/v1/chat/completions", {**CHAT, "model": CLEF})[0] == 404


# ------------------------------------------------------------------ the scoring route
def test_a_scoring_request_is_one_engine_request_with_the_flag(clef_dir: Path) -> None:
    mw, app = make(clef_dir)
    status, body = call(mw, app, "/v1/clef/score", SCORE)
    assert status == 200, body
    (c,) = app.state.engine_client.calls
    sp, prompt = c["sp"], c["prompt"]
    assert sp["max_tokens"] == 1 and sp["extra_args"]["sm70_clef"] == 1
    spec = sp["extra_args"]["sm70_clef_score"]
    assert prompt["cache_salt"] == spec["key"]  # a salt of its own: no shared cache
    ids = prompt["prompt_token_ids"]
    want = render(validate_request(SCORE, Limits()), tokenize, KINDS)
    assert ids == want.token_ids and spec["positions"] == want.positions
    assert spec["roles"] == [0, 1, 1, 1, 0, 1, 1, 1, 0, 1]
    assert spec["kinds"] == [0] * 4 + [1] * 4 + [2] * 2
    assert app.state.engine_client.rpcs == [("sm70_clef_take", (spec["key"],))]
    # logits = position index: the last option of each softmax wins, sigmoid(9) for flags
    topic, anger, flags = body["results"]
    assert topic["best"] == "other" and [s["option"] for s in anger["scores"]] == [1, 2, 3]
    assert flags["scores"][0]["score"] == pytest.approx(1 / (1 + 2.718281828 ** -9), 1e-6)
    assert body["usage"]["prompt_tokens"] == len(ids) and app.bodies == []


def test_a_prompt_over_clefs_context_is_refused_naming_the_limit(clef_dir: Path) -> None:
    n = len(render(validate_request(SCORE, Limits()), tokenize, KINDS).token_ids)
    mw, app = make(clef_dir, max_len=n - 1)
    status, body = call(mw, app, "/v1/clef/score", SCORE)
    assert status == 400 and body["error"]["param"] == "input"
    assert f"{n:,} prompt tokens" in body["error"]["message"]
    assert f"maximum context is {n - 1:,} tokens" in body["error"]["message"]
    assert app.state.engine_client.calls == []
    mw, app = make(clef_dir, max_len=n)
    assert call(mw, app, "/v1/clef/score", SCORE)[0] == 200


@pytest.mark.parametrize(("body", "param"), [
    ({**SCORE, "model": SERVED}, "model"),
    ({**SCORE, "questions": []}, "questions"),
    (b"{not json", "body"),
])
def test_bad_scoring_requests_are_400_naming_the_field(clef_dir: Path, body: Any,
                                                       param: str) -> None:
    mw, app = make(clef_dir)
    status, out = call(mw, app, "/v1/clef/score", body)
    assert status == 400 and out["error"]["param"] == param


def test_an_oversized_scoring_body_is_refused_before_parsing(clef_dir: Path) -> None:
    mw, app = make(clef_dir)
    status, out = call(mw, app, "/v1/clef/score", b" " * (api.MAX_SCORE_BODY + 1))
    assert status == 400 and "over" in out["error"]["message"]


def test_missing_scores_are_a_server_error_not_a_guess() -> None:
    with pytest.raises(api.ClefError, match="no worker"):
        api.first_scores([None, None], 3)
    with pytest.raises(api.ClefError, match="2 scores for 3"):
        api.first_scores([[1.0, 2.0]], 3)


# ------------------------------------------------------------------ rendering
def test_each_read_position_is_the_last_token_of_its_piece() -> None:
    req = validate_request(SCORE, Limits())
    r = render(req, tokenize, KINDS)
    pieces = [req.input]
    for q in req.questions:
        pieces.append("\n\nQuestion: " + q.text)
        pieces += ["\n- " + str(o) for o in q.options]
    ends, n = [], 0
    for p in pieces:
        n += len(tokenize(p))
        ends.append(n - 1)
    assert r.positions == ends[1:]
    assert r.options == [(1, 4), (5, 8), (9, 10)]
    assert option_logits(r, list(range(10))) == [[1, 2, 3], [5, 6, 7], [9]]


def test_serve_adds_the_middleware_and_the_worker_extension_only_with_clef() -> None:
    from sm70ctl.serve.clef_args import clef_argv

    on = clef_argv(SimpleNamespace(clef=True))  # type: ignore[arg-type]
    assert on == ["--middleware", "vllm_patch.clef.api.ClefMiddleware",
                  "--worker-extension-cls", "vllm_patch.clef.worker_ext.ClefWorkerExtension"]
    assert clef_argv(SimpleNamespace(clef=False)) == []  # type: ignore[arg-type]
    mod, _, name = on[1].rpartition(".")
    assert hasattr(__import__(mod, fromlist=[name]), name)


# ------------------------------------------------------------------ a real FastAPI app
FASTAPI_CHILD = r'''
import json, os, sys
from types import SimpleNamespace
sys.path.insert(0, "tests")
from clef_fixture import TINY_CONFIG
req = json.loads(sys.stdin.read())
os.environ["SM70_PLUGIN_CONFIG"] = json.dumps({"clef": {"enabled": True, "dir": req["dir"],
                                                        "rank": 8}})
from fastapi import FastAPI, Request
from starlette.testclient import TestClient
from vllm_patch.clef import api

app = FastAPI()

@app.post("/v1/chat/completions")
async def chat(r: Request):
    return {"echo": await r.json()}

app.add_middleware(api.ClefMiddleware)  # as vLLM adds a --middleware class: no arguments

class Tok:
    def encode(self, s, add_special_tokens=True):
        return [ord(c) % 500 for c in s]

class Engine:
    def get_tokenizer(self):
        return Tok()
    async def generate(self, prompt, sp, request_id):
        self.n = len(sp.extra_args["sm70_clef_score"]["positions"])
        yield None
    async def collective_rpc(self, method, args=()):
        return [[0.0] * (self.n - 1) + [3.0]]

app.state.args = SimpleNamespace(served_model_name=["base"], max_model_len=4096)
app.state.engine_client = Engine()
app.state.vllm_config = SimpleNamespace(model_config=SimpleNamespace(
    hf_config=SimpleNamespace(to_dict=lambda: TINY_CONFIG)))

class SP:
    def __init__(self, **kw):
        self.__dict__.update(kw)

run = api.run_scoring
async def scoring(engine, rendered, make_params=None):
    return await run(engine, rendered, SP)
api.run_scoring = scoring
c = TestClient(app)
out = {}
r = c.post("/v1/chat/completions", json={"model": "base", "messages": []})
out["chat"] = [r.status_code, r.json()]
r = c.post("/v1/chat/completions", json={"model": "base-clef", "messages": []})
out["clef_chat"] = [r.status_code, r.json()]
r = c.post("/v1/clef/score", json={"model": "base-clef", "input": "hi there", "questions": [
    {"id": "a", "kind": "choice", "text": "q?", "options": ["x", "y"]}]})
out["score"] = [r.status_code, r.json()]
print(json.dumps(out))
'''


def test_in_a_real_fastapi_app_added_as_vllm_adds_it(clef_dir: Path) -> None:
    import importlib.util
    import subprocess
    import sys

    from serve_venv import SERVE_PY

    py = sys.executable if importlib.util.find_spec("fastapi") else str(SERVE_PY)
    if not Path(py).is_file():
        pytest.skip(f"no fastapi here and no {SERVE_PY}")
    probe = subprocess.run([py, "-c", "import fastapi, httpx"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"{py} has no fastapi/httpx")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([py, "-c", FASTAPI_CHILD], input=json.dumps({"dir": str(clef_dir)}),
                          capture_output=True, text=True, timeout=300, cwd=str(root),
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["chat"] == [200, {"echo": {"model": "base", "messages": []}}]
    assert out["clef_chat"][0] == 400 and out["clef_chat"][1]["error"]["param"] == "model"
    status, body = out["score"]
    assert status == 200 and body["object"] == "clef.score"
    assert body["results"][0]["best"] == "y"  # the last option's logit is the largest
