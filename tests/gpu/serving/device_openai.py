"""The OpenAI surface through `sm70ctl serve` on the GPU machine, with the tiny int8 checkpoint.

Started by the lead's round call as `python3 tests/gpu/serving/device_openai.py --out DIR
--budget-s N` (cwd: the repository root; SM70_AB_TINY, SM70_SITE, SM70_GPU_SHARE set).

1. settings for serve (openai_cases.serve_settings) into an env file; `sm70ctl serve
   --dry-run --json` first: its pre-flight verdicts and the environment it would give vLLM,
   whose kernel cache folder is pointed at the ops the round call already built;
2. `sm70ctl serve --allow-cold` as a subprocess (its console and its own log under DIR),
   with the plugin's environment (run_ab.side_env("ours")) and
   VLLM_ENFORCE_STRICT_TOOL_CALLING=1, so that vLLM constrains tool calls to the
   qwen3_coder XML format (structural tags) and parses them with the qwen3_coder parser;
3. when /health and /v1/models answer, each case (below) with the openai client; every
   case's verdict lands in DIR/summary.json as soon as it is known, an exception fails only
   its own case;
4. SIGINT to serve (it stops vLLM gracefully), then the port must be free again.

Random weights emit junk, so each case says whether it is `constrained`: its checks hold
whatever the weights prefer (a template or token count, a decode restricted by
allowed_token_ids / logit_bias, a tool call forced by a structural tag) or only check the
shape of the answer. docs/serving_api.md lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "gpu" / "ab"))

import openai_cases as oc  # noqa: E402
import tiny_serving  # noqa: E402

PORT = 18931
MODEL = "tiny"
WORK = Path("/tmp/e_openai")
CASE_RESERVE_S = 120  # what the cases and the stop need after the server is ready
STOP_RESERVE_S = 60  # the stop (serve's grace is 20 s) and the last summary
TOOL_TOKENS = 1024  # one forced get_weather call is about 170 byte-level tokens
RUN_SERVE = (  # the same entry point as the CLI's, for an image whose typer cannot run ours
    "import os, sys; from sm70ctl.settings import load_settings; "
    "from sm70ctl.serve.command import run_serve; dry = sys.argv[2] == 'dry'; "
    "sys.exit(run_serve(load_settings(env_file=sys.argv[1]), environ=dict(os.environ), "
    "device='cuda', dry_run=dry, allow_cold=True, json_mode=dry))"
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    def __init__(self, out: Path, budget_s: float) -> None:
        self.t0 = time.time()
        self.deadline = self.t0 + budget_s
        self.out = out
        self.summary: dict[str, Any] = {"passed": None, "started": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": budget_s, "cases": {}}
        self.verdicts: list[oc.Verdict] = []

    def left(self) -> float:
        return self.deadline - time.time()

    def write(self) -> None:
        self.summary["elapsed_s"] = round(time.time() - self.t0, 1)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1, default=str))
        tmp.replace(self.out / "summary.json")


# --- the server ---------------------------------------------------------------------------
def serve_env(extra: dict[str, str]) -> dict[str, str]:
    from run_ab import side_env

    env = side_env("ours", extra)
    # sm70ctl itself from the installed copy in SM70_SITE, else from the checkout
    env["PYTHONPATH"] = ":".join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    # Settings come from the env file only: sm70ctl refuses SM70_* names it does not know
    # (the round call's SM70_AB_TINY, SM70_GPU_SHARE...), and serve sets the kernel folder.
    return {k: v for k, v in env.items() if not k.startswith("SM70_")}


def serve_cmd(mode: str, env_file: Path, dry: bool) -> list[str]:
    if mode == "cli":
        cmd = [sys.executable, "-m", "sm70ctl", "serve", "--allow-cold", "--env-file",
               str(env_file)]
        return cmd + (["--dry-run", "--json"] if dry else [])
    return [sys.executable, "-c", RUN_SERVE, str(env_file), "dry" if dry else "run"]


def dry_run(run: Run, env_file: Path, env: dict[str, str]) -> str | None:
    """`serve --dry-run --json`: record its checks; returns the mode that worked."""
    for mode in ("cli", "run_serve"):
        r = subprocess.run(serve_cmd(mode, env_file, dry=True), env=env, cwd=WORK,
                           capture_output=True, text=True, timeout=120)
        (run.out / f"dry_run_{mode}.txt").write_text(r.stdout + "\n--- stderr\n" + r.stderr)
        try:
            data = json.loads(r.stdout)
            if "command_line" not in data:
                raise ValueError(data.get("error"))
        except ValueError:
            run.summary.setdefault("dry_run_failures", {})[mode] = {
                "rc": r.returncode, "stderr_tail": r.stderr[-1500:]}
            continue
        run.summary["serve_mode"] = mode
        run.summary["dry_run"] = {"command_line": data.get("command_line"),
                                  "checks": data.get("checks"),
                                  "env": data.get("env")}
        link_kernels(run, data.get("env") or {})
        return mode
    return None


def link_kernels(run: Run, env: dict[str, str]) -> None:
    """Point serve's kernel cache folder at the round call's build (else vLLM's start would
    compile our ops again, a minute of the budget)."""
    target = env.get("SM70_KERNELS_BUILD_DIR")
    built = os.environ.get("SM70_KERNELS_BUILD_DIR")
    note: dict[str, Any] = {"serve_dir": target, "built": built}
    if target and built and Path(built).is_dir() and not Path(target).exists():
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).symlink_to(built)
        note["linked"] = True
    run.summary["kernels"] = note


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError) as exc:
        return 0, str(exc)


def http_post(url: str, body: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(run: Run, proc: subprocess.Popen, base: str, limit: float) -> bool:
    t = time.time()
    while time.time() - t < limit:
        if proc.poll() is not None:
            run.summary["server"]["exited_before_ready"] = proc.returncode
            return False
        code, _ = http_get(base + "/health")
        if code == 200:
            code, body = http_get(base + "/v1/models")
            if code == 200 and MODEL in body:
                run.summary["server"]["ready_s"] = round(time.time() - t, 1)
                return True
        time.sleep(2)
    run.summary["server"]["not_ready_after_s"] = round(time.time() - t, 1)
    return False


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


VLLM_PID = re.compile(r"(?:server started|starting vLLM \(attempt \d+), pid (\d+)")


def vllm_pid(*logs: Path) -> int | None:
    """The last vLLM pid serve reported: its log file says `server started, pid N`, its
    console `starting vLLM (attempt 1, pid N)`."""
    found = None
    for f in logs:
        paths = sorted(f.glob("serve-*.log*")) if f.is_dir() else [f] if f.is_file() else []
        for path in paths:
            for m in VLLM_PID.finditer(path.read_text(errors="replace")):
                found = int(m.group(1))
    return found


def stop_server(run: Run, proc: subprocess.Popen, log_dir: Path) -> None:
    info = run.summary["server"]
    child = vllm_pid(log_dir, run.out / "serve_console.log")
    info["vllm_pid"] = child
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # serve stops vLLM (SIGTERM, SIGKILL after grace)
        try:
            proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            info["serve_killed"] = True
            proc.kill()
            proc.wait()
    info["serve_rc"] = proc.returncode
    if child is not None:
        try:
            os.kill(child, 0)
            info["vllm_left_running"] = True
            os.killpg(child, signal.SIGKILL)  # the supervisor starts vLLM in its own group
        except OSError:
            pass
    time.sleep(1)
    info["port_free_after_stop"] = port_free(PORT)


# --- the cases ----------------------------------------------------------------------------
class Ctx:
    def __init__(self, client: Any, base: str, tok: Any) -> None:
        self.client = client
        self.base = base
        self.tok = tok
        self.think_end = tok.convert_tokens_to_ids(oc.THINK_END)
        self.tool_call = tok.convert_tokens_to_ids("<tool_call>")
        # single-byte tokens that decode to a letter or a space: a decode restricted to
        # them can never produce a marker the parsers react to
        self.letters = [i for i in range(256)
                        if tok.decode([i]) in set(string.ascii_letters + " ")]
        # single-byte whitespace tokens: the qwen_xml grammar lets whitespace pad every
        # value, and random weights like it (values came back as " \n\t\t Oslo \t"); a
        # -100 bias leaves the grammar's one choice where whitespace is all it allows
        self.no_space = {str(i): -100 for i in range(256) if tok.decode([i]).isspace()}
        self.memo: dict[str, Any] = {}

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def dump(obj: Any) -> dict[str, Any]:
    return obj.model_dump() if hasattr(obj, "model_dump") else dict(obj)


def no_think(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"chat_template_kwargs": {"enable_thinking": False}, **(extra or {})}


def chat(ctx: Ctx, **kw: Any) -> dict[str, Any]:
    return dump(ctx.client.chat.completions.create(model=MODEL, temperature=0, **kw))


def chat_stream(ctx: Ctx, **kw: Any) -> dict[str, Any]:
    chunks = ctx.client.chat.completions.create(model=MODEL, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, **kw)
    return oc.assemble_stream(dump(c) for c in chunks)


def message(resp: dict[str, Any]) -> dict[str, Any]:
    return resp["choices"][0]["message"]


def case_models(ctx: Ctx, v: oc.Verdict) -> None:
    ids = [m.id for m in ctx.client.models.list().data]
    v.response = {"models": ids}
    v.check("served model listed", MODEL in ids, ids)


def case_template(ctx: Ctx, v: oc.Verdict) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    ends = {True: "<|im_start|>assistant\n<think>\n",
            False: "<|im_start|>assistant\n<think>\n\n</think>\n\n"}
    for thinking, end in ends.items():
        r = http_post(ctx.base + "/tokenize", {"model": MODEL, "messages": msgs,
                                               "chat_template_kwargs":
                                                   {"enable_thinking": thinking}})
        text = ctx.tok.decode(r["tokens"])
        v.response[f"thinking_{thinking}"] = oc.short(text, 300)
        v.check(f"prompt ends with the {'open' if thinking else 'closed'} think block",
                text.endswith(end), repr(text[-60:]))
    r = http_post(ctx.base + "/tokenize", {"model": MODEL, "messages": msgs,
                                           "tools": [oc.WEATHER_TOOL]})
    text = ctx.tok.decode(r["tokens"])
    v.check("tools rendered in the system turn",
            text.startswith("<|im_start|>system\n") and '"name": "get_weather"' in text,
            oc.short(text, 200))


def case_completion(ctx: Ctx, v: oc.Verdict) -> None:
    prompt = "The capital of France is"
    v.request = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = dump(ctx.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                           temperature=0))
    c = r["choices"][0]
    ctx.memo["completion"] = c["text"]
    v.response = {"text": oc.short(c["text"]), "finish_reason": c["finish_reason"],
                  "usage": r.get("usage")}
    v.check("text is a string", isinstance(c["text"], str))
    v.check("finish_reason", c["finish_reason"] in ("length", "stop"), c["finish_reason"])
    want = len(ctx.tok.encode(prompt))
    v.check("prompt_tokens = the tokenizer's count", r["usage"]["prompt_tokens"] == want,
            f"{r['usage']['prompt_tokens']} vs {want}")
    v.check("1 <= completion_tokens <= 12", 1 <= r["usage"]["completion_tokens"] <= 12,
            r["usage"]["completion_tokens"])


def case_completion_stream(ctx: Ctx, v: oc.Verdict) -> None:
    prompt = "The capital of France is"
    chunks = ctx.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True)
    text, finish = oc.completion_stream_text(dump(c) for c in chunks)
    v.response = {"text": oc.short(text), "finish_reason": finish}
    v.check("finish_reason in the last chunk", finish in ("length", "stop"), finish)
    if "completion" in ctx.memo:
        v.check("streamed text = the non-streamed greedy text", text == ctx.memo["completion"],
                f"{text!r} vs {ctx.memo['completion']!r}")


def case_chat(ctx: Ctx, v: oc.Verdict) -> None:
    kw = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
          "logprobs": True, "extra_body": no_think({"return_tokens_as_token_ids": True})}
    v.request = {k: kw[k] for k in ("messages", "max_tokens")}
    r = chat(ctx, **kw)
    m = message(r)
    ids = oc.token_ids_from_logprobs((r["choices"][0].get("logprobs") or {}).get("content"))
    ctx.memo["chat"] = (m.get("content"), r["choices"][0]["finish_reason"])
    v.response = {"content": oc.short(m.get("content")), "reasoning": oc.short(
        oc.reasoning_of(m)), "finish_reason": r["choices"][0]["finish_reason"],
        "usage": r.get("usage")}
    v.check("assistant message", m.get("role") == "assistant", m.get("role"))
    v.check("finish_reason", r["choices"][0]["finish_reason"] in ("length", "stop"))
    v.check("one logprob per generated token", len(ids) == r["usage"]["completion_tokens"],
            f"{len(ids)} vs {r['usage']['completion_tokens']}")
    if oc.THINK_END not in ctx.decode(ids):
        v.check("thinking off: no reasoning", oc.reasoning_of(m) is None, oc.reasoning_of(m))


def case_chat_stream(ctx: Ctx, v: oc.Verdict) -> None:
    s = chat_stream(ctx, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
                    extra_body=no_think())
    v.response = {k: oc.short(s[k]) for k in ("content", "reasoning", "finish_reason",
                                              "usage")}
    v.check("usage chunk (include_usage)", bool(s["usage"]), s["usage"])
    v.check("finish_reason", s["finish_reason"] in ("length", "stop"), s["finish_reason"])
    if "chat" in ctx.memo:
        content, finish = ctx.memo["chat"]
        v.check("streamed content = the non-streamed greedy content",
                (s["content"] or "") == (content or ""), f"{s['content']!r} vs {content!r}")
        v.check("same finish_reason", s["finish_reason"] == finish)


def reasoning_request(ctx: Ctx, thinking: bool, allowed: list[int],
                      bias: float | None = None, max_tokens: int = 24) -> dict[str, Any]:
    extra: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": thinking},
                             "allowed_token_ids": allowed, "return_tokens_as_token_ids": True}
    kw: dict[str, Any] = {"messages": [{"role": "user", "content": "Think, then answer."}],
                          "max_tokens": max_tokens, "extra_body": extra}
    if bias is not None:
        kw["logit_bias"] = {str(ctx.think_end): bias}  # vLLM takes floats
    return kw


def split_check(ctx: Ctx, v: oc.Verdict, r: dict[str, Any], thinking: bool,
                label: str) -> list[int]:
    m = message(r)
    ids = oc.token_ids_from_logprobs((r["choices"][0].get("logprobs") or {}).get("content"))
    raw = ctx.decode(ids)
    want = oc.expected_reasoning_split(raw, thinking)
    got = (oc.reasoning_of(m), m.get("content") or None)
    v.response[label] = {"raw": oc.short(raw), "reasoning": oc.short(got[0]),
                         "content": oc.short(got[1])}
    v.check(f"{label}: (reasoning, content) = the split of the generated text", got == want,
            f"got {got!r} want {want!r}")
    return ids


def case_reasoning_routing(ctx: Ctx, v: oc.Verdict) -> None:
    for thinking in (True, False):
        r = chat(ctx, logprobs=True, **reasoning_request(ctx, thinking, ctx.letters))
        split_check(ctx, v, r, thinking, f"thinking_{thinking}")
    v.request = {"allowed_token_ids": "letters and space", "max_tokens": 24}


def case_reasoning_split(ctx: Ctx, v: oc.Verdict) -> None:
    allowed = [*ctx.letters, ctx.think_end]
    length = 24
    ends: dict[float, list[int]] = {}
    chosen = None
    for step in range(2, 65):  # biases 1.0, 1.5, ... 32.0
        bias = step / 2
        r = chat(ctx, logprobs=True, **reasoning_request(ctx, True, allowed, bias, length))
        ids = oc.token_ids_from_logprobs(r["choices"][0]["logprobs"]["content"])
        ends[bias] = [i for i, t in enumerate(ids) if t == ctx.think_end]
        chosen = oc.pick_think_cut(ends, length)
        if chosen is not None:
            break
    v.request = {"allowed_token_ids": "letters, space and </think>", "max_tokens": length,
                 "think_end_at_bias": {str(k): ends[k] for k in ends}, "chosen": chosen}
    if not v.check("a bias and cut give one </think> inside the output", chosen is not None,
                   ends):
        return
    bias, cut = chosen
    r = chat(ctx, logprobs=True, **reasoning_request(ctx, True, allowed, bias, cut))
    ids = split_check(ctx, v, r, True, "split")
    v.check("exactly one </think>, not first", [i for i, t in enumerate(ids)
                                                if t == ctx.think_end] == ends[bias][:1], ids)
    m = message(r)
    v.check("both parts non-empty", bool(oc.reasoning_of(m)) and bool(m.get("content")))
    ctx.memo["split"] = (bias, cut, m)


def case_reasoning_split_stream(ctx: Ctx, v: oc.Verdict) -> None:
    if "split" not in ctx.memo:
        v.check("needs reasoning_split's bias", False, "reasoning_split found none")
        return
    bias, cut, m = ctx.memo["split"]
    allowed = [*ctx.letters, ctx.think_end]
    kw = reasoning_request(ctx, True, allowed, bias, cut)
    kw["extra_body"].pop("return_tokens_as_token_ids")
    s = chat_stream(ctx, **kw)
    v.response = {"reasoning": oc.short(s["reasoning"]), "content": oc.short(s["content"])}
    v.check("streamed reasoning = non-streamed", s["reasoning"] == oc.reasoning_of(m),
            f"{s['reasoning']!r} vs {oc.reasoning_of(m)!r}")
    v.check("streamed content = non-streamed", s["content"] == (m.get("content") or None),
            f"{s['content']!r} vs {m.get('content')!r}")


TOOLS = [oc.WEATHER_TOOL, oc.CLOCK_TOOL]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TOOL_MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def case_tool_named(ctx: Ctx, v: oc.Verdict) -> None:
    v.request = {"tools": ["get_weather", "get_time"], "tool_choice": NAMED}
    r = chat(ctx, messages=TOOL_MSGS, tools=TOOLS, tool_choice=NAMED, max_tokens=TOOL_TOKENS,
             logit_bias=ctx.no_space, extra_body=no_think())
    m = message(r)
    ctx.memo["named"] = m.get("tool_calls")
    v.response = {"tool_calls": m.get("tool_calls"), "content": oc.short(m.get("content")),
                  "finish_reason": r["choices"][0]["finish_reason"]}
    problems = oc.tool_call_problems(m.get("tool_calls"), TOOLS, only="get_weather")
    v.check("one get_weather call with schema-valid arguments", not problems, problems)
    v.check("no text beside the call", not (m.get("content") or "").strip(),
            m.get("content"))


def case_tool_required(ctx: Ctx, v: oc.Verdict) -> None:
    v.request = {"tools": ["get_weather", "get_time"], "tool_choice": "required"}
    r = chat(ctx, messages=TOOL_MSGS, tools=TOOLS, tool_choice="required", max_tokens=TOOL_TOKENS,
             logit_bias=ctx.no_space, extra_body=no_think())
    m = message(r)
    v.response = {"tool_calls": m.get("tool_calls"), "content": oc.short(m.get("content")),
                  "finish_reason": r["choices"][0]["finish_reason"]}
    calls = m.get("tool_calls") or []
    if r["choices"][0]["finish_reason"] == "length" and len(calls) > 1:
        # "required" lets the decoder chain calls; one cut by max_tokens is not judged
        v.response["cut_call_dropped"] = calls[-1]
        calls = calls[:-1]
    problems = oc.tool_call_problems(calls, TOOLS)
    v.check(">= 1 call of a listed tool with schema-valid arguments", not problems, problems)


def case_tool_named_stream(ctx: Ctx, v: oc.Verdict) -> None:
    # return_token_ids: each chunk names its tokens, so a lost call shows how its tag came
    chunks = [dump(c) for c in ctx.client.chat.completions.create(
        model=MODEL, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=TOOL_MSGS, tools=TOOLS, tool_choice=NAMED, max_tokens=TOOL_TOKENS,
        logit_bias=ctx.no_space, extra_body=no_think({"return_token_ids": True}))]
    s = oc.assemble_stream(chunks)
    ids = oc.stream_token_ids(chunks)
    pieces = [ctx.tok.decode([i]) for i in ids]
    v.response = {"tool_calls": s["tool_calls"], "finish_reason": s["finish_reason"],
                  "content": oc.short(s["content"], 400),
                  "reasoning": oc.short(s["reasoning"], 400), "usage": s["usage"],
                  "first_chunks": [oc.chunk_digest(c) for c in chunks[:6]],
                  "first_tokens": list(zip(ids[:16], pieces[:16], strict=True)),
                  "tool_call_tag": oc.tag_spelling(ids, ctx.tool_call, pieces,
                                                   "<tool_call>")}
    problems = oc.tool_call_problems(s["tool_calls"], TOOLS, only="get_weather")
    v.check("streamed call assembles to a valid get_weather call", not problems, problems)
    named = ctx.memo.get("named")
    if named and not problems:
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
               for c in s["tool_calls"]]
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in named]
        v.check("same call as the non-streamed greedy one", got == want, f"{got} vs {want}")


def case_tool_auto(ctx: Ctx, v: oc.Verdict) -> None:
    r = chat(ctx, messages=TOOL_MSGS, tools=TOOLS, tool_choice="auto", max_tokens=24,
             extra_body=no_think())
    m = message(r)
    v.response = {"tool_calls": m.get("tool_calls"), "content": oc.short(m.get("content")),
                  "finish_reason": r["choices"][0]["finish_reason"]}
    calls = m.get("tool_calls")
    if calls:
        problems = oc.tool_call_problems(calls, TOOLS)
        v.check("any call the model chose is valid", not problems, problems)
    else:
        v.check("no call: plain content", isinstance(m.get("content"), str), m.get("content"))


HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather",
            "arguments": json.dumps({"city": "Oslo", "unit": "celsius", "days": 1,
                                     "alerts": False})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "snow, -3 C"},
]


def case_tool_history(ctx: Ctx, v: oc.Verdict) -> None:
    r = http_post(ctx.base + "/tokenize", {"model": MODEL, "messages": HISTORY,
                                           "tools": TOOLS})
    text = ctx.tok.decode(r["tokens"])
    v.response["prompt_tail"] = oc.short(text[-400:], 400)
    v.check("the earlier call is rendered as qwen3_coder XML",
            "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>" in text)
    v.check("the tool result is rendered", "<tool_response>\nsnow, -3 C\n</tool_response>"
            in text)
    resp = chat(ctx, messages=HISTORY, tools=TOOLS, max_tokens=12, extra_body=no_think())
    v.response["finish_reason"] = resp["choices"][0]["finish_reason"]
    v.check("the server answers after a tool result",
            resp["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls"))


def mm_pair(ctx: Ctx, part: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    text = {"type": "text", "text": "Describe this."}
    base = chat(ctx, messages=[{"role": "user", "content": [text]}], max_tokens=4,
                extra_body=no_think())
    with_media = chat(ctx, messages=[{"role": "user", "content": [text, part]}], max_tokens=4,
                      extra_body=no_think())
    return base, with_media


def case_image(ctx: Ctx, v: oc.Verdict) -> None:
    h, w = 64, 96
    url = oc.image_data_url(oc.png_bytes(w, h, oc.gradient(1)))
    base, img = mm_pair(ctx, {"type": "image_url", "image_url": {"url": url}})
    delta = img["usage"]["prompt_tokens"] - base["usage"]["prompt_tokens"]
    want = 2 + tiny_serving.image_tokens(h, w)  # <|vision_start|>, the pads, <|vision_end|>
    v.request = {"image": f"PNG {w}x{h}", "max_tokens": 4}
    v.response = {"prompt_tokens": img["usage"]["prompt_tokens"], "delta": delta,
                  "content": oc.short(message(img).get("content"))}
    v.check("prompt grows by the image's placeholder tokens", delta == want,
            f"{delta} vs {want}")
    v.check("an answer", img["choices"][0]["finish_reason"] in ("length", "stop"))


def case_video(ctx: Ctx, v: oc.Verdict) -> None:
    frames = [oc.png_bytes(64, 64, oc.gradient(i)) for i in range(4)]
    url = oc.video_frames_url(frames)
    base, vid = mm_pair(ctx, {"type": "video_url", "video_url": {"url": url}})
    delta = vid["usage"]["prompt_tokens"] - base["usage"]["prompt_tokens"]
    # 4 frames -> 2 temporal patches of 2 frames, each (64/16)^2 / 2^2 = 4 tokens; the
    # Qwen3-VL processor adds a timestamp and vision markers around each
    floor = 2 * 4
    v.request = {"video": "4 PNG frames 64x64 as video/jpeg frame list", "max_tokens": 4}
    v.response = {"prompt_tokens": vid["usage"]["prompt_tokens"], "delta": delta,
                  "content": oc.short(message(vid).get("content"))}
    v.check("prompt grows by at least the video's patch tokens", delta >= floor,
            f"{delta} vs >= {floor}")
    v.check("an answer", vid["choices"][0]["finish_reason"] in ("length", "stop"))


# (name, function, constrained): the order matters (memo), the media cases go last.
CASES: list[tuple[str, Callable[[Ctx, oc.Verdict], None], bool]] = [
    ("models", case_models, True),
    ("template", case_template, True),
    ("completion", case_completion, False),
    ("completion_stream", case_completion_stream, False),
    ("chat", case_chat, False),
    ("chat_stream", case_chat_stream, False),
    ("reasoning_routing", case_reasoning_routing, True),
    ("reasoning_split", case_reasoning_split, True),
    ("reasoning_split_stream", case_reasoning_split_stream, True),
    ("tool_named", case_tool_named, True),
    ("tool_required", case_tool_required, True),
    ("tool_named_stream", case_tool_named_stream, True),
    ("tool_auto", case_tool_auto, False),
    ("tool_history", case_tool_history, True),
    ("image", case_image, True),
    ("video", case_video, False),
]


def run_cases(run: Run, ctx: Ctx) -> None:
    for name, fn, constrained in CASES:
        v = oc.Verdict(name, constrained)
        if run.left() < STOP_RESERVE_S:
            v.error = "skipped: budget"
        else:
            t = time.time()
            try:
                fn(ctx, v)
            except Exception as exc:  # one case's failure keeps the rest
                v.error = f"{type(exc).__name__}: {exc}"[:600]
                v.response["traceback"] = traceback.format_exc()[-1500:]
            v.response["seconds"] = round(time.time() - t, 2)
        run.verdicts.append(v)
        run.summary["cases"][name] = v.to_dict()
        run.summary["passed"] = oc.overall(run.verdicts, [c[0] for c in CASES])
        run.write()
        log(f"{name}: {'pass' if v.passed else 'FAIL'} {v.error or ''}")


# --- main ---------------------------------------------------------------------------------
def checkpoint_files(model: Path) -> dict[str, Any]:
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "preprocessor_config.json",
             "video_preprocessor_config.json"]
    found = {n: (model / n).exists() for n in names}
    cfg = json.loads((model / "tokenizer_config.json").read_text()) if found[
        "tokenizer_config.json"] else {}
    found["template_in_tokenizer_config"] = bool(cfg.get("chat_template"))
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    run = Run(a.out, a.budget_s)
    run.summary["server"] = {}
    try:
        return body(run)
    except Exception as exc:  # whatever happens, summary.json says it
        run.summary["error"] = f"{type(exc).__name__}: {exc}"
        run.summary["traceback"] = traceback.format_exc()[-3000:]
        run.summary["passed"] = False
        run.write()
        return 1


def vit_sdpa_python() -> Path:
    """The serving interpreter for this H200 run: this python, with vLLM's API server told to
    run the vision tower's attention on TORCH_SDPA. On the H200 vLLM picks FLASH_ATTN for the
    ViT, whose library in the device bundle is an empty shell (a CUDA "unknown error" in the
    start-up profile run); on a V100 vLLM picks TORCH_SDPA itself (FLASH_ATTN needs sm_80), so
    this changes nothing the product would run there. Only the API server's argv gets the flag."""
    wrapper = WORK / "python-vit-sdpa"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" vllm.entrypoints.openai.api_server "*)\n'
        f'  exec {sys.executable} "$@" --mm-encoder-attn-backend TORCH_SDPA;;\n'
        "esac\n"
        f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def body(run: Run) -> int:
    model = Path(os.environ.get("SM70_AB_TINY", "/tmp/ab/tiny")) / "int8"
    run.summary["checkpoint"] = {"dir": str(model), **checkpoint_files(model)}
    run.write()
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    log_dir = run.out / "serve_logs"
    share = float(os.environ.get("SM70_GPU_SHARE", "0.1"))
    startup_s = int(max(60.0, run.left() - CASE_RESERVE_S))
    settings = oc.serve_settings(model_dir=str(model), serve_python=str(vit_sdpa_python()),
                                 port=PORT, share=share, work=str(WORK), startup_s=startup_s)
    settings["SM70_LOG_DIR"] = str(log_dir)
    env_file = WORK / "serve.env"
    env_file.write_text(oc.env_file_text(settings))
    (run.out / "serve.env").write_text(oc.env_file_text(settings))
    env = serve_env({"VLLM_ENFORCE_STRICT_TOOL_CALLING": "1"})
    run.summary["settings"] = settings
    run.summary["inherited_for_vllm"] = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "1",
                                         "PYTHONPATH": env["PYTHONPATH"]}
    mode = dry_run(run, env_file, env)
    run.write()
    if mode is None:
        run.summary["passed"] = False
        run.write()
        return 1

    console = open(run.out / "serve_console.log", "w")  # noqa: SIM115 - closed at the end
    t = time.time()
    # serve stays in this job's process group, so the round call's kill at its deadline
    # reaches it; vLLM runs in a group of its own (serve's supervisor), killed on SIGTERM
    proc = subprocess.Popen(serve_cmd(mode, env_file, dry=False), env=env, cwd=WORK,
                            stdout=console, stderr=subprocess.STDOUT)
    run.summary["server"].update({"pid": proc.pid, "mode": mode})
    run.write()

    def terminated(signum: int, _frame: Any) -> None:
        child = vllm_pid(log_dir, run.out / "serve_console.log")
        for kill in (lambda: os.killpg(child, signal.SIGKILL) if child else None, proc.kill):
            with contextlib.suppress(OSError):
                kill()
        run.summary["server"]["terminated_by"] = signal.Signals(signum).name
        run.summary["passed"] = False
        run.write()
        os._exit(1)

    signal.signal(signal.SIGTERM, terminated)
    base = f"http://127.0.0.1:{PORT}"
    try:
        from transformers import AutoTokenizer  # after the start: the GPU check runs first

        tok = AutoTokenizer.from_pretrained(str(model))
        ready = wait_ready(run, proc, base, max(10.0, run.left() - STOP_RESERVE_S - 30))
        run.summary["server"]["start_s"] = round(time.time() - t, 1)
        run.write()
        log(f"server ready={ready}")
        if ready:
            from openai import OpenAI

            client = OpenAI(base_url=base + "/v1", api_key="none", timeout=120,
                            max_retries=0)
            run_cases(run, Ctx(client, base, tok))
    finally:
        stop_server(run, proc, log_dir)
        console.close()
        tail = (run.out / "serve_console.log").read_text(errors="replace")[-4000:]
        run.summary["server"]["console_tail"] = tail
        run.summary["server"]["clean_stop"] = (run.summary["server"].get("serve_rc") == 0 and
                                               run.summary["server"]["port_free_after_stop"])
        if not run.verdicts:
            run.summary["passed"] = False
        elif run.summary["passed"]:
            run.summary["passed"] = bool(run.summary["server"]["clean_stop"])
        run.summary["constrained_cases"] = sorted(v.name for v in run.verdicts if v.constrained)
        run.summary["failed_cases"] = sorted(v.name for v in run.verdicts if not v.passed)
        run.write()
    log(f"passed={run.summary['passed']}")
    return 0 if run.summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
