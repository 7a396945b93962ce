"""The pure parts of the OpenAI-surface device test (tests/gpu/serving/): the settings it
serves with, the media it sends, the verdicts on what the server answers, and the tiny
checkpoint's serving tokens and processor configs."""

from __future__ import annotations

import base64
import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu" / "serving"))
sys.path.insert(0, str(ROOT / "tests" / "gpu" / "ab"))

import device_openai  # noqa: E402
import make_checkpoint  # noqa: E402
import openai_cases as oc  # noqa: E402
import tiny_serving as ts  # noqa: E402

from sm70ctl.runtime.command_line import vllm_argv  # noqa: E402
from sm70ctl.settings import load_settings  # noqa: E402
from sm70ctl.settings.rules import check_rules  # noqa: E402


# --- settings -------------------------------------------------------------------------------
def _settings(tmp_path: Path, share: float = 0.1):
    values = oc.serve_settings(model_dir=str(tmp_path / "model"), serve_python="/usr/bin/python3",
                               port=18931, share=share, work=str(tmp_path), startup_s=300)
    env_file = tmp_path / "serve.env"
    env_file.write_text(oc.env_file_text(values))
    return load_settings(environ={}, env_file=env_file)


def test_serve_settings_pass_every_rule_and_reach_the_command_line(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    assert check_rules(s) == []
    argv = vllm_argv(s)
    assert argv[:3] == ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server"]
    line = " ".join(argv)
    for words in ("--tool-call-parser qwen3_coder", "--reasoning-parser qwen3",
                  "--enable-auto-tool-choice", "--gpu-memory-utilization 0.1",
                  "--kv-cache-memory-bytes 1073741824", "--tensor-parallel-size 1",
                  "--served-model-name tiny", "--port 18931", "--enforce-eager",
                  "--quantization gptq"):
        assert words in line, words
    assert "--speculative-config" not in argv
    assert json.loads(argv[argv.index("--limit-mm-per-prompt") + 1]) == {"image": 1, "video": 1}


def test_serve_settings_share_bounds(tmp_path: Path) -> None:
    # vLLM's utilisation is the job's share of the GPU (the round call gives 0.07)
    assert "--gpu-memory-utilization 0.07 " in " ".join(vllm_argv(_settings(tmp_path, 0.07)))
    assert "--gpu-memory-utilization 0.25 " in " ".join(vllm_argv(_settings(tmp_path, 0.25)))
    assert "--gpu-memory-utilization 0.99 " in " ".join(vllm_argv(_settings(tmp_path, 1.0)))
    with pytest.raises(ValueError, match="GPU share"):
        oc.serve_settings(model_dir="m", serve_python="p", port=1, share=0, work="w",
                          startup_s=1)


def test_serve_env_drops_the_round_calls_sm70_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # sm70ctl refuses SM70_* names it does not know; the round call sets several
    monkeypatch.setenv("SM70_AB_TINY", "/tmp/ab/tiny")
    monkeypatch.setenv("SM70_GPU_SHARE", "0.1")
    env = device_openai.serve_env({"VLLM_ENFORCE_STRICT_TOOL_CALLING": "1"})
    assert not [k for k in env if k.startswith("SM70_")]
    assert env["VLLM_PLUGINS"] == "sm70"
    assert env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == "/tmp/sm70-site"
    assert env["PYTHONPATH"].split(":")[-1] == str(ROOT)


def test_vllm_pid_from_the_serve_log(tmp_path: Path) -> None:
    (tmp_path / "serve-18931.log").write_text(
        "note: command: x\nserver started, pid 4321 (process group 4321)\n")
    console = tmp_path / "console.log"
    console.write_text("starting vLLM (attempt 2, pid 99); waiting for /health\n")
    assert device_openai.vllm_pid(tmp_path) == 4321
    assert device_openai.vllm_pid(console) == 99
    assert device_openai.vllm_pid(tmp_path / "none", tmp_path / "x.log") is None


def test_case_names_unique() -> None:
    names = [c[0] for c in device_openai.CASES]
    assert len(names) == len(set(names))


# --- media ----------------------------------------------------------------------------------
def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    out, i = [], 8
    while i < len(png):
        (n,) = struct.unpack(">I", png[i:i + 4])
        kind, data = png[i + 4:i + 8], png[i + 8:i + 8 + n]
        (crc,) = struct.unpack(">I", png[i + 8 + n:i + 12 + n])
        assert crc == zlib.crc32(kind + data) & 0xFFFFFFFF, kind
        out.append((kind, data))
        i += 12 + n
    return out


def test_png_is_well_formed_with_the_given_pixels() -> None:
    png = oc.png_bytes(3, 2, lambda x, y: (x, y, 7))
    chunks = _chunks(png)
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    w, h, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (w, h, depth, colour) == (3, 2, 8, 2)
    rows = zlib.decompress(chunks[1][1])
    assert rows == b"\x00" + bytes([0, 0, 7, 1, 0, 7, 2, 0, 7]) + b"\x00" + bytes(
        [0, 1, 7, 1, 1, 7, 2, 1, 7])
    with pytest.raises(ValueError):
        oc.png_bytes(0, 2, lambda x, y: (0, 0, 0))


def test_media_urls() -> None:
    frames = [b"one", b"two"]
    url = oc.video_frames_url(frames)
    head, _, data = url.partition(",")
    assert head == "data:video/jpeg;base64"
    assert [base64.b64decode(p) for p in data.split(",")] == frames
    assert base64.b64decode(oc.image_data_url(b"png").split(",", 1)[1]) == b"png"
    with pytest.raises(ValueError):
        oc.video_frames_url([])


# --- verdicts -------------------------------------------------------------------------------
def test_expected_reasoning_split() -> None:
    assert oc.expected_reasoning_split("abc</think>def</think>g", True) == ("abc",
                                                                           "def</think>g")
    assert oc.expected_reasoning_split("abc</think>", True) == ("abc", None)
    assert oc.expected_reasoning_split("abc", True) == ("abc", None)
    assert oc.expected_reasoning_split("abc", False) == (None, "abc")
    assert oc.expected_reasoning_split("a</think>b", False) == ("a", "b")
    assert oc.expected_reasoning_split("", True) == (None, None)


def test_reasoning_field_names() -> None:
    assert oc.reasoning_of({"reasoning": "r"}) == "r"
    assert oc.reasoning_of({"reasoning": None, "reasoning_content": "old"}) == "old"
    assert oc.reasoning_of({}) is None


def test_token_ids_from_logprobs() -> None:
    assert oc.token_ids_from_logprobs([{"token": "token_id:5"}, {"token": "token_id:1993"}]) \
        == [5, 1993]
    assert oc.token_ids_from_logprobs(None) == []
    with pytest.raises(ValueError, match="token_id"):
        oc.token_ids_from_logprobs([{"token": "abc"}])


PARAMS = oc.WEATHER_TOOL["function"]["parameters"]
GOOD = {"city": "Oslo", "unit": "celsius", "days": 2, "alerts": False}


def test_schema_problems() -> None:
    assert oc.schema_problems(json.dumps(GOOD), PARAMS) == []
    assert oc.schema_problems(GOOD, PARAMS) == []
    assert oc.schema_problems({**GOOD, "city": "Rome"}, PARAMS) == [
        "city='Rome' not in ['Paris', 'Oslo', 'Lima']"]
    assert oc.schema_problems({**GOOD, "days": True}, PARAMS) == ["days=True is not integer"]
    assert oc.schema_problems({**GOOD, "alerts": "no"}, PARAMS) == ["alerts='no' is not boolean"]
    assert oc.schema_problems({k: v for k, v in GOOD.items() if k != "unit"}, PARAMS) == [
        "missing 'unit'"]
    assert oc.schema_problems({**GOOD, "x": 1}, PARAMS) == ["unknown argument 'x'"]
    assert oc.schema_problems("{not json", PARAMS)[0].startswith("arguments are not JSON")
    assert oc.schema_problems("[1]", PARAMS) == ["arguments are list, not an object"]


def _call(name: str, args: object) -> dict:
    return {"function": {"name": name, "arguments": json.dumps(args)}}


def test_tool_call_problems() -> None:
    tools = [oc.WEATHER_TOOL, oc.CLOCK_TOOL]
    assert oc.tool_call_problems([_call("get_weather", GOOD)], tools, only="get_weather") == []
    assert oc.tool_call_problems([_call("get_time", {"zone": "UTC"}), _call("get_weather", GOOD)],
                                 tools) == []
    assert oc.tool_call_problems([_call("get_time", {"zone": "UTC"})], tools,
                                 only="get_weather") == ["call 0: name 'get_time', want "
                                                         "'get_weather'"]
    assert oc.tool_call_problems([_call("nope", {})], tools) == [
        "call 0: unknown function 'nope'"]
    assert oc.tool_call_problems([], tools) == ["no tool call"]
    assert oc.tool_call_problems(None, tools) == ["no tool call"]
    assert oc.tool_call_problems([_call("get_time", {"zone": "PST"})], tools) == [
        "call 0: zone='PST' not in ['UTC', 'CET']"]


def test_assemble_stream_merges_deltas() -> None:
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": None}}]},
        {"choices": [{"delta": {"reasoning": "thi"}}]},
        {"choices": [{"delta": {"reasoning": "nk"}}]},
        {"choices": [{"delta": {"content": "ok "}}]},
        {"choices": [{"delta": {"tool_calls": [
            {"index": 0, "id": "c0", "function": {"name": "get_weather", "arguments": ""}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [
            {"index": 1, "id": "c1", "function": {"name": "get_time", "arguments": "{}"}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty"}'}}]},
                      "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"completion_tokens": 9}},
    ]
    m = oc.assemble_stream(chunks)
    assert m["reasoning"] == "think"
    assert m["content"] == "ok "
    assert m["tool_calls"] == [
        {"id": "c0", "function": {"name": "get_weather", "arguments": '{"city"}'}},
        {"id": "c1", "function": {"name": "get_time", "arguments": "{}"}}]
    assert m["finish_reason"] == "tool_calls"
    assert m["usage"] == {"completion_tokens": 9}
    empty = oc.assemble_stream([{"choices": [{"delta": {}, "finish_reason": "length"}]}])
    assert empty == {"content": None, "reasoning": None, "tool_calls": None,
                     "finish_reason": "length", "usage": None}


def test_completion_stream_text() -> None:
    chunks = [{"choices": [{"text": "ab", "finish_reason": None}]},
              {"choices": [{"text": "c", "finish_reason": "length"}]}, {"choices": []}]
    assert oc.completion_stream_text(chunks) == ("abc", "length")


def test_pick_think_cut() -> None:
    # the smallest bias whose first </think> has reasoning before it and content after it,
    # cut before a second </think>
    assert oc.pick_think_cut({1: [], 2: [0], 4: [7], 8: [3]}, 24) == (4, 24)
    assert oc.pick_think_cut({1: [], 7.5: [7, 21], 8: [7, 20, 22]}, 24) == (7.5, 21)
    assert oc.pick_think_cut({1: [5, 6], 2: [3, 9]}, 24) == (2, 9)  # 1: no room for content
    assert oc.pick_think_cut({1: [23], 2: [0, 5]}, 24) is None
    assert oc.pick_think_cut({}, 24) is None


def test_verdict_and_overall() -> None:
    ok = oc.Verdict("a", True)
    ok.check("x", True)
    bad = oc.Verdict("b", False)
    bad.check("y", True)
    bad.check("z", False, "why")
    empty = oc.Verdict("c", False)
    assert ok.passed and not bad.passed and not empty.passed
    errored = oc.Verdict("d", True)
    errored.check("x", True)
    errored.error = "boom"
    assert not errored.passed
    assert bad.to_dict()["checks"][1] == {"check": "z", "ok": False, "detail": "why"}
    assert oc.overall([ok], ["a"]) is True
    assert oc.overall([ok, bad], ["a", "b"]) is False
    assert oc.overall([ok], ["a", "missing"]) is False
    assert oc.overall([], ["a"]) is None


# --- the tiny checkpoint's serving files ----------------------------------------------------
def _special_ids(vocab: int) -> dict[str, int]:
    """make_checkpoint.build_tokenizer's ids: eos at vocab - 64, the rest from vocab - 63."""
    ids = {make_checkpoint.VOCAB_SPECIALS[0]: vocab - 64}
    for i, tok in enumerate(make_checkpoint.VOCAB_SPECIALS[1:]):
        ids[tok] = vocab - 63 + i
    return ids


@pytest.mark.parametrize("shape", sorted(make_checkpoint.SHAPES))
def test_config_vision_ids_name_the_tokenizers_tokens(shape: str) -> None:
    s = make_checkpoint.SHAPES[shape]
    cfg = make_checkpoint.full_config(s)
    ids = _special_ids(s["vocab"])
    assert cfg["vision_start_token_id"] == ids["<|vision_start|>"]
    assert cfg["vision_end_token_id"] == ids["<|vision_end|>"]
    assert cfg["image_token_id"] == ids["<|image_pad|>"]
    assert cfg["video_token_id"] == ids["<|video_pad|>"]
    assert cfg["text_config"]["eos_token_id"] == ids["<|endoftext|>"]


@pytest.mark.parametrize("shape", sorted(make_checkpoint.SHAPES))
def test_serving_tokens_take_free_ids(shape: str) -> None:
    vocab = make_checkpoint.SHAPES[shape]["vocab"]
    serving = ts.serving_token_ids(vocab)
    assert set(serving) == {"<think>", "</think>", "<tool_call>", "</tool_call>",
                            "<tool_response>", "</tool_response>"}
    taken = set(_special_ids(vocab).values()) | set(range(256))
    assert not taken & set(serving.values())
    assert len(set(serving.values())) == len(serving)
    assert all(256 <= i < vocab for i in serving.values())
    table = {chr(65 + i): i for i in range(3)}
    assert ts.add_serving_tokens(table, vocab) == list(serving)
    assert {t: table[t] for t in serving} == serving
    with pytest.raises(ValueError, match="already"):
        ts.add_serving_tokens({"x": vocab - ts.FIRST_SERVING_OFFSET}, vocab)


def test_image_tokens() -> None:
    assert ts.image_tokens(64, 96) == 6  # (4 x 6 patches of 16) / (2 x 2 merge)
    assert ts.image_tokens(64, 64) == 4
    with pytest.raises(ValueError, match="multiples"):
        ts.image_tokens(64, 80)
    with pytest.raises(ValueError, match="pixels"):
        ts.image_tokens(32, 32)


def test_processor_configs_match_the_vision_tower(tmp_path: Path) -> None:
    vision = make_checkpoint.full_config(make_checkpoint.SHAPES["tiny"])["vision_config"]
    for cfg in (ts.image_processor_config(), ts.video_processor_config()):
        assert cfg["patch_size"] == vision["patch_size"]
        assert cfg["merge_size"] == vision["spatial_merge_size"]
        assert cfg["temporal_patch_size"] == vision["temporal_patch_size"]
        assert cfg["size"]["shortest_edge"] <= cfg["size"]["longest_edge"]
    assert ts.write_serving_files(tmp_path) == ["preprocessor_config.json",
                                                "video_preprocessor_config.json"]
    assert json.loads((tmp_path / "preprocessor_config.json").read_text())[
        "image_processor_type"] == "Qwen2VLImageProcessorFast"
    assert json.loads((tmp_path / "video_preprocessor_config.json").read_text())[
        "video_processor_type"] == "Qwen3VLVideoProcessor"


def test_chat_template_has_the_parsers_markers() -> None:
    # rendering runs on the GPU machine (the `template` case, through the server's
    # /tokenize); here: the markers the parsers and the processor look for are in it
    text = ts.chat_template()
    for marker in ("<tool_call>\\n<function=", "<parameter=", "</tool_call>", "<think>\\n",
                   "</think>", "<|vision_start|><|image_pad|><|vision_end|>",
                   "<|vision_start|><|video_pad|><|vision_end|>", "<tool_response>",
                   "enable_thinking"):
        assert marker in text, marker


# --- what tool_named_stream records -------------------------------------------------------
def test_stream_token_ids_and_chunk_digest() -> None:
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "token_ids": None}]},
              {"choices": [{"delta": {"content": "<", "tool_calls": []}, "token_ids": [60]}]},
              {"choices": [{"delta": {}, "token_ids": [116, 111], "finish_reason": "stop"}]},
              {"choices": [], "usage": {"completion_tokens": 3}}]
    assert oc.stream_token_ids(chunks) == [60, 116, 111]
    assert oc.chunk_digest(chunks[0]) == [{"delta": {"role": "assistant"}}]
    assert oc.chunk_digest(chunks[1]) == [{"delta": {"content": "<"}, "token_ids": [60]}]
    assert oc.chunk_digest(chunks[2]) == [{"delta": {}, "token_ids": [116, 111],
                                           "finish_reason": "stop"}]
    assert oc.chunk_digest(chunks[3]) == []


def test_tag_spelling() -> None:
    assert oc.tag_spelling([5, 9], 9, ["a", "<tool_call>"], "<tool_call>") == "token"
    assert oc.tag_spelling([1, 2, 3], 9, ["<tool", "_call", ">"], "<tool_call>") == "pieces"
    assert oc.tag_spelling([1, 2], 9, ["<tool", "_cal"], "<tool_call>") == "absent"


TAG_ID = 2000
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
            "<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n1\n</parameter>\n"
            "<parameter=alerts>\nfalse\n</parameter>\n</function>\n</tool_call>")


class _ByteTok:
    """The tiny tokenizer as far as the case uses it: byte ids, one added <tool_call>."""

    def convert_tokens_to_ids(self, token: str) -> int:
        return {"<tool_call>": TAG_ID, oc.THINK_END: TAG_ID + 1}[token]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("<tool_call>" if i == TAG_ID else chr(i) for i in ids)


class _Chunk(dict):
    def model_dump(self) -> dict:
        return dict(self)


class _Client:
    def __init__(self, chunks: list[dict]) -> None:
        self.chunks = chunks
        self.kw: dict = {}
        self.chat = self
        self.completions = self

    def create(self, **kw: object) -> list[_Chunk]:
        self.kw = kw
        return [_Chunk(c) for c in self.chunks]


def _stream_case(chunks: list[dict]) -> tuple[oc.Verdict, _Client]:
    client = _Client(chunks)
    v = oc.Verdict("tool_named_stream", True)
    device_openai.case_tool_named_stream(device_openai.Ctx(client, "http://x", _ByteTok()), v)
    return v, client


def test_tool_named_stream_records_a_lost_call() -> None:
    # the H200's failure: the call's XML, one byte token per character, streamed as content
    chunks = [{"choices": [{"delta": {"content": ch}, "token_ids": [ord(ch)]}]}
              for ch in XML_CALL]
    chunks.append({"choices": [{"delta": {}, "token_ids": [1], "finish_reason": "stop"}]})
    v, client = _stream_case(chunks)
    assert client.kw["stream"] is True
    assert client.kw["extra_body"]["return_token_ids"] is True
    assert client.kw["extra_body"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert not v.passed
    assert v.response["tool_call_tag"] == "pieces"
    assert v.response["content"].startswith("<tool_call>\n<function=get_weather>")
    assert v.response["first_chunks"][0] == [{"delta": {"content": "<"}, "token_ids": [60]}]
    assert v.response["first_tokens"][:2] == [(60, "<"), (116, "t")]


def test_tool_named_stream_passes_a_streamed_call() -> None:
    args = '{"city": "Lima", "unit": "celsius", "days": 1, "alerts": false}'
    chunks = [{"choices": [{"delta": {}, "token_ids": [TAG_ID]}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {
                  "name": "get_weather", "arguments": ""}}]}, "token_ids": [10]}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
                  "arguments": args}}]}, "token_ids": [62], "finish_reason": "stop"}]}]
    v, _ = _stream_case(chunks)
    assert v.passed, v.checks
    assert v.response["tool_call_tag"] == "token"
    assert v.response["content"] is None
