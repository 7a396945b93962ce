"""Clef's HTTP routes through `sm70ctl serve` on the GPU machine (issue 25 item 2 and 3),
for device_clef_vllm.py: the serve settings, the server's start and stop, the requests, and
the verdicts on what came back against the engine-level results of the `ours` engine.

The server serves the same 64-layer int8 checkpoint and Clef folder as `ours` (images off:
its encoder profile would only cost start-up; the two-image bursts run on `ours`). Cases:
- `base_completion`: the base model name on /v1/completions with a prompt of token ids
  (one of the batch's Clef prompts), 16 greedy tokens: the same tokens as `ours`' chat-only
  row for that prompt, and not those of its Clef row (the route did not correct it);
- `base_chat`: a chat completion naming the base model is answered;
- `clef_chat_refused`: a chat completion naming the Clef model, and a completion whose
  vllm_xargs carry the Clef flag, are refused with the OpenAI-style error body (Clef scores,
  it does not write: `vllm_patch.clef.routing`);
- `clef_too_long`: a scoring request of more than 16,384 prompt tokens is refused (HTTP 400,
  param `input`, the limit named);
- `clef_score`: typed questions on POST /v1/clef/score: the per-option scores within
  SCORE_TOL of the same request scored engine-side on `ours` (`score_reference`, no
  speculation there), the same prompt token count;
- `clef_no_drafts`: the server runs MTP k=3 (serve's default method): vLLM's own counter
  of verified drafts (`vllm:spec_decode_num_drafts` on /metrics) does not move over a
  scoring request and does move over a base completion after it (speculation is live, and
  a Clef request never enters it: routing.py).
The pure parts (settings, rows from a completion, the verdicts) have CPU tests in
tests/test_clef_http_cases.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PORT = 18947
SERVED = "tiny"
CLEF_NAME = SERVED + "-clef"  # vllm_patch.clef.routing.clef_model_name
CLEF_MAX_LEN = 16384  # SM70_CLEF_MAX_MODEL_LEN's default
# per-option probabilities: the server and `ours` run the same int8 kernels on the same
# weights; a lone scoring request's prefill differs at most by the batch's rounding, far
# below this (a wrong row, position or role moves a softmax over 2-5 options by more)
SCORE_TOL = 0.02
LONG_WORDS = CLEF_MAX_LEN + 600  # each "billing " is at least one token


# ------------------------------------------------------------------ pure
def serve_settings(*, model_dir: str, clef_dir: str, rank: int, share: float, work: str,
                   startup_s: int, serve_python: str) -> dict[str, str]:
    """SM70_* settings for the Clef server: openai_cases.serve_settings' test deployment
    (one GPU, eager, a GPU share, private folders) with Clef on, images and videos off,
    and a context that holds Clef's 16,384 tokens (SM70_CLEF_MAX_MODEL_LEN <= the model's),
    on the attention backend of the engine-level reference rows it is judged against
    (ab_side.engine_kwargs: TRITON_ATTN). With serve's default SM70_PAGED the base completion
    kept every token but its log-probs moved 0.36 over 64 layers, past the tolerance the
    same-kernel noise sets (r4 call 4): a kernel difference, not a routing one. Speculation
    is on (MTP k=3, serve's default) so `clef_no_drafts` has drafts to count."""
    import openai_cases as oc

    s = oc.serve_settings(model_dir=model_dir, serve_python=serve_python, port=PORT,
                          share=share, work=work, startup_s=startup_s, kv_cache="1GiB")
    s.update({"SM70_CLEF": "true", "SM70_CLEF_DIR": clef_dir, "SM70_CLEF_RANK": str(rank),
              "SM70_CLEF_MAX_MODEL_LEN": str(CLEF_MAX_LEN),
              "SM70_MAX_MODEL_LEN": str(CLEF_MAX_LEN + 256), "SM70_LIMIT_IMAGES": "0",
              "SM70_LIMIT_VIDEOS": "0", "SM70_SERVED_MODEL_NAME": SERVED,
              "SM70_ATTENTION_BACKEND": "TRITON_ATTN", "SM70_SPEC_METHOD": "mtp",
              "SM70_SPEC_TOKENS": "3"})
    return s


def completion_row(body: Mapping[str, Any], prompt_len: int) -> dict[str, Any]:
    """A /v1/completions answer (logprobs=2, return_tokens_as_token_ids) as the A/B row
    shape (ab_side.run_phase): tokens, chosen log-probs, top-2 per step."""
    lp = body["choices"][0]["logprobs"]

    def tid(t: str) -> int:
        if not str(t).startswith("token_id:"):
            raise ValueError(f"logprob token {t!r} is not 'token_id:N'")
        return int(str(t).split(":", 1)[1])

    tokens = [tid(t) for t in lp["tokens"]]
    top2 = []
    for step in lp["top_logprobs"]:
        ranked = sorted(((tid(t), float(v)) for t, v in step.items()), key=lambda kv: -kv[1])
        second = ranked[1] if len(ranked) > 1 else (None, None)
        top2.append([ranked[0][0], ranked[0][1], second[0], second[1]])
    return {"prompt_len": prompt_len, "tokens": tokens,
            "logprobs": [float(v) for v in lp["token_logprobs"]], "top2": top2}


def score_table(body: Mapping[str, Any]) -> dict[str, list[float]]:
    """Per question id, its options' scores in order, from a /v1/clef/score body."""
    return {r["id"]: [float(s["score"]) for s in r["scores"]] for r in body["results"]}


def score_verdict(http: Mapping[str, Any], engine: Mapping[str, Any],
                  tol: float = SCORE_TOL) -> dict[str, Any]:
    """The HTTP scores against the engine-side ones for the same request."""
    a, b = score_table(http), score_table(engine)
    same_shape = list(a) == list(b) and all(len(a[k]) == len(b[k]) for k in a)
    diff = max((abs(x - y) for k in a if k in b for x, y in zip(a[k], b[k], strict=False)),
               default=None)
    pt = (http.get("usage", {}).get("prompt_tokens"), engine.get("usage", {}).get(
        "prompt_tokens"))
    return {"passed": same_shape and diff is not None and diff <= tol and pt[0] == pt[1],
            "questions": len(a), "max_abs_score_diff": diff, "tolerance": tol,
            "prompt_tokens": list(pt)}


DRAFTS_METRIC = "vllm:spec_decode_num_drafts"


def verified_drafts(metrics: str) -> float | None:
    """The server's count of verified drafts (summed over engines) from its /metrics text;
    None when the counter is absent (speculation off, or stats disabled)."""
    total, seen = 0.0, False
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (DRAFTS_METRIC, DRAFTS_METRIC + "_total"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def no_drafts_verdict(before: float | None, after_score: float | None,
                      after_chat: float | None, score_status: int) -> dict[str, Any]:
    """A scoring request verifies no draft while a chat request after it does (else the
    counter proves nothing: speculation off, or not counted)."""
    out: dict[str, Any] = {"passed": False, "score_status": score_status,
                           "drafts_over_score": None, "drafts_over_chat": None}
    if before is None or after_score is None or after_chat is None:
        return out
    out["drafts_over_score"] = after_score - before
    out["drafts_over_chat"] = after_chat - after_score
    out["passed"] = score_status == 200 and out["drafts_over_score"] == 0 \
        and out["drafts_over_chat"] > 0
    return out


def refusal_ok(status: int, body: Any, param: str, needle: str) -> bool:
    """An OpenAI-style refusal: HTTP 400, {"error": {message, type, param, code}}."""
    e = body.get("error") if isinstance(body, Mapping) else None
    return status == 400 and isinstance(e, Mapping) and e.get("param") == param and \
        e.get("code") == 400 and e.get("type") == "BadRequestError" and \
        needle in str(e.get("message", ""))


def base_verdict(server: Mapping[str, Any], chat_row: Mapping[str, Any],
                 clef_row: Mapping[str, Any], tol: float) -> dict[str, Any]:
    """The base model name's completion against `ours`' rows for the same prompt: its
    log-probs within `tol` of the chat row's while their tokens agree, and told apart from
    the Clef row (so the answer is the base route's, not a corrected one): where the Clef row
    left the chat row's tokens, the server's tokens are the chat row's at least up to and
    including that step; where it did not, the server's log-probs are more than `tol` from
    the Clef row's. A later divergence from the chat row is allowed only at a near-tie (the
    chat row's top-2 margin within `tol`): the server runs its steps eagerly and alone,
    `ours` in graphs in a batch of 12."""
    from compare import compare_request

    vs_chat = compare_request(chat_row, server)
    clef_left = compare_request(chat_row, clef_row)
    ok = vs_chat["max_abs_dlogprob"] <= tol
    out: dict[str, Any] = {"vs_chat": vs_chat, "tolerance": tol}
    if clef_left["equal"]:
        vs_clef = compare_request(clef_row, server)
        out["vs_clef_max_abs_dlogprob"] = vs_clef["max_abs_dlogprob"]
        ok = ok and vs_chat["equal"] and vs_clef["max_abs_dlogprob"] > tol
        return {"passed": bool(ok), **out}
    left_at = clef_left["first_diff"]["step"]
    out["clef_row_left_at"] = left_at
    if not vs_chat["equal"]:
        d = vs_chat["first_diff"]
        ok = ok and d["step"] > left_at and d["ref_margin"] is not None and \
            d["ref_margin"] <= tol
    return {"passed": bool(ok), **out}


# ------------------------------------------------------------------ the world
def http(method: str, url: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except (OSError, ValueError) as exc:
        return 0, str(exc)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")[:2000]


class Server:
    """`sm70ctl serve` with the Clef settings, as device_openai.py starts it."""

    def __init__(self, out: Path, work: Path, settings: dict[str, str]) -> None:
        self.out, self.work, self.settings = out, work, settings
        self.info: dict[str, Any] = {"settings": settings}
        self.proc: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{PORT}"

    def env(self) -> dict[str, str]:
        from device_openai import serve_env

        return serve_env({})

    def start(self) -> bool:
        import device_openai as do

        self.work.mkdir(parents=True, exist_ok=True)
        self.settings["SM70_LOG_DIR"] = str(self.out / "serve_logs")
        env_file = self.work / "serve.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in sorted(self.settings.items())))
        env = self.env()
        for mode in ("cli", "run_serve"):
            r = subprocess.run(do.serve_cmd(mode, env_file, dry=True), env=env, cwd=self.work,
                               capture_output=True, text=True, timeout=120)
            (self.out / f"serve_dry_run_{mode}.txt").write_text(r.stdout + "\n--- stderr\n"
                                                               + r.stderr)
            try:
                data = json.loads(r.stdout)
            except ValueError:
                self.info.setdefault("dry_run_failures", {})[mode] = r.stderr[-1500:]
                continue
            if "command_line" not in data:
                self.info.setdefault("dry_run_failures", {})[mode] = data
                continue
            self.info.update(mode=mode, command_line=data.get("command_line"),
                             checks=data.get("checks"))
            target = (data.get("env") or {}).get("SM70_KERNELS_BUILD_DIR")
            built = os.environ.get("SM70_KERNELS_BUILD_DIR")
            if target and built and Path(built).is_dir() and not Path(target).exists():
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                Path(target).symlink_to(built)  # else serve's vLLM builds our ops again
            console = open(self.out / "serve_console.log", "w")  # noqa: SIM115
            # serve stays in the job's process group, so the round call's kill at its
            # deadline reaches it (its vLLM runs in a group of its own: `stop`)
            self.proc = subprocess.Popen(do.serve_cmd(mode, env_file, dry=False), env=env,
                                         cwd=self.work, stdout=console,
                                         stderr=subprocess.STDOUT)
            self.info["pid"] = self.proc.pid
            # past serve's pre-flight (its busy-GPU check) before the engines beside it
            # take their memory: until it reports vLLM's pid, exits, or 20 s pass
            t = time.time()
            while time.time() - t < 20 and self.proc.poll() is None and do.vllm_pid(
                    self.out / "serve_logs", self.out / "serve_console.log") is None:
                time.sleep(0.5)
            self.info["preflight_wait_s"] = round(time.time() - t, 1)
            return True
        return False

    def wait_ready(self, until_wall: float) -> bool:
        t = time.time()
        while time.time() < until_wall:
            if self.proc is None or self.proc.poll() is not None:
                self.info["exited_before_ready"] = None if self.proc is None else \
                    self.proc.returncode
                return False
            code, body = http("GET", self.base + "/v1/models", timeout=5)
            if code == 200 and SERVED in json.dumps(body):
                self.info["ready_after_s"] = round(time.time() - t, 1)
                return True
            time.sleep(2)
        self.info["not_ready_at_deadline"] = True
        return False

    def stop(self) -> None:
        import device_openai as do

        child = do.vllm_pid(self.out / "serve_logs", self.out / "serve_console.log")
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # serve stops vLLM itself
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.info["serve_killed"] = True
        if child is not None:
            try:
                os.kill(child, 0)
                self.info["vllm_left_running"] = True
                os.killpg(child, signal.SIGKILL)  # the supervisor starts it in its own group
            except OSError:
                pass
        self.info["serve_rc"] = None if self.proc is None else self.proc.returncode
        time.sleep(1)
        self.info["port_free_after_stop"] = do.port_free(PORT)
        tail = (self.out / "serve_console.log")
        self.info["console_tail"] = tail.read_text(errors="replace")[-3000:] \
            if tail.exists() else None


def run_cases(base: str, prompt: list[int], score_body: dict[str, Any],
              new_tokens: int) -> dict[str, Any]:
    """Every request; the raw answers (judged later against `ours`' results). An exception
    fails only its own case."""
    got: dict[str, Any] = {}

    def case(name: str, fn: Any) -> None:
        t = time.time()
        try:
            got[name] = fn()
        except Exception as exc:  # one case's failure keeps the rest
            got[name] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        got[name]["seconds"] = round(time.time() - t, 2)

    def base_completion() -> dict[str, Any]:
        code, body = http("POST", base + "/v1/completions", {
            "model": SERVED, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, "return_tokens_as_token_ids": True})
        out: dict[str, Any] = {"status": code}
        if code == 200:
            out["row"] = completion_row(body, len(prompt))
        else:
            out["body"] = body
        return out

    def base_chat() -> dict[str, Any]:
        code, body = http("POST", base + "/v1/chat/completions", {
            "model": SERVED, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}})
        ok = code == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")
        return {"status": code, "passed": bool(ok), "usage": body.get("usage")
                if isinstance(body, dict) else body}

    def clef_chat_refused() -> dict[str, Any]:
        c1, b1 = http("POST", base + "/v1/chat/completions", {
            "model": CLEF_NAME, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8})
        c2, b2 = http("POST", base + "/v1/completions", {
            "model": SERVED, "prompt": prompt, "max_tokens": 4,
            "vllm_xargs": {"sm70_clef": 1}})
        ok = refusal_ok(c1, b1, "model", "/v1/clef/score") and \
            refusal_ok(c2, b2, "vllm_xargs.sm70_clef", "reserved")
        return {"passed": ok, "chat": [c1, b1], "flagged_completion": [c2, b2]}

    def clef_too_long() -> dict[str, Any]:
        body = dict(score_body, input=" ".join(["billing"] * LONG_WORDS))
        code, resp = http("POST", base + "/v1/clef/score", body)
        return {"passed": refusal_ok(code, resp, "input", f"{CLEF_MAX_LEN:,}"),
                "status": code, "body": resp}

    def clef_score() -> dict[str, Any]:
        code, resp = http("POST", base + "/v1/clef/score", score_body)
        return {"status": code, "body": resp}

    def drafts() -> float | None:
        from device_openai import http_get

        time.sleep(1.0)  # the server records a step's stats just after it answers
        code, text = http_get(base + "/metrics", timeout=30)
        return verified_drafts(text) if code == 200 else None

    def clef_no_drafts() -> dict[str, Any]:
        before = drafts()
        code, _ = http("POST", base + "/v1/clef/score", score_body)
        after_score = drafts()
        http("POST", base + "/v1/completions", {
            "model": SERVED, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True})
        return no_drafts_verdict(before, after_score, drafts(), code)

    for name, fn in (("base_completion", base_completion), ("base_chat", base_chat),
                     ("clef_chat_refused", clef_chat_refused),
                     ("clef_too_long", clef_too_long), ("clef_score", clef_score),
                     ("clef_no_drafts", clef_no_drafts)):
        case(name, fn)
    return got


def judge(got: Mapping[str, Any], ours: Mapping[str, Any], prompt_idx: int,
          tol: float) -> dict[str, Any]:
    """Each case's verdict; those needing `ours`' engine-level results compare here."""
    phases = ours.get("phases", {})
    v: dict[str, Any] = {}
    bc = got.get("base_completion", {})
    if "row" in bc and "chat_only" in phases and "mixed" in phases:
        v["base_completion"] = base_verdict(bc["row"], phases["chat_only"][prompt_idx],
                                            phases["mixed"][prompt_idx], tol)
    else:
        v["base_completion"] = {"passed": False if "error" in bc or "status" in bc else None,
                                "got": bc}
    for name in ("base_chat", "clef_chat_refused", "clef_too_long", "clef_no_drafts"):
        g = got.get(name, {})
        v[name] = {"passed": bool(g.get("passed")) if g else None, **g}
    cs, ref = got.get("clef_score", {}), phases.get("http_ref")
    if cs.get("status") == 200 and ref and "response" in ref:
        try:
            v["clef_score"] = score_verdict(cs["body"], ref["response"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a malformed body
            v["clef_score"] = {"passed": False, "error": f"{type(exc).__name__}: {exc}",
                               "got": cs}
    else:
        v["clef_score"] = {"passed": False if cs else None, "got": cs,
                           "engine_side": ref}
    return v


if __name__ == "__main__":  # pragma: no cover - a module of device_clef_vllm.py
    sys.exit("run tests/gpu/clef/device_clef_vllm.py")
