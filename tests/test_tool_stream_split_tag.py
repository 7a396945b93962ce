"""R9 (vllm_patch/tool_calls/split_start_tag.py): a streamed qwen3_coder tool call whose
`<tool_call>` arrives in several tokens, on vLLM 0.22.1's own parsers and detokenizer
(tests/tool_stream_probe.py) and in its pure parts here."""

from __future__ import annotations

import json
from typing import Any

import pytest
from vllm_cpu_tree import REPO, require_tree, run_probe

from vllm_patch.tool_calls.split_start_tag import TARGET, plan_delta, split_held

PROBE = REPO / "tests" / "tool_stream_probe.py"
TAG = "<tool_call>"
WEATHER = {"city": "Lima", "unit": "fahrenheit", "days": 2, "alerts": False}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
        "<parameter=unit>\nfahrenheit\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "<parameter=alerts>\nfalse\n</parameter>\n</function>\n</tool_call>")
CLOCK_CALL = ("<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n"
              "</function>\n</tool_call>")
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# --- the pure parts ---------------------------------------------------------------------------
def test_split_held_keeps_the_longest_tag_prefix() -> None:
    assert split_held("abc", TAG) == ("abc", "")
    assert split_held("abc<", TAG) == ("abc", "<")
    assert split_held("a <tool_cal", TAG) == ("a ", "<tool_cal")
    assert split_held("<<tool", TAG) == ("<", "<tool")
    assert split_held("<tip", TAG) == ("<tip", "")  # no longer a start of the tag
    assert split_held("", TAG) == ("", "")
    with pytest.raises(ValueError, match="whole tag"):
        split_held("x<tool_call>", TAG)


def test_plan_delta() -> None:
    # a character of the tag is held, the completed tag goes to vLLM's method whole
    assert plan_delta("", "<", [60], TAG, 9) == ("", "<")
    assert plan_delta("<tool_call", ">", [62], TAG, 9) == ("<tool_call>", "")
    # a whole tag in one delta, nothing held: handed on unchanged (the wrapper has no
    # shortcut of its own for it)
    assert plan_delta("", "x<tool_call>", [120, 9], TAG, 9) == ("x<tool_call>", "")
    # the tag's own token, after held text that was content
    assert plan_delta("<", "<tool_call>", [9], TAG, 9) == ("<<tool_call>", "")
    # held text that stops matching goes out in front of the delta
    assert plan_delta("<to", "y", [121], TAG, 9) == ("<toy", "")
    # end of sequence (ids, no text) releases what is held; an empty step keeps it
    assert plan_delta("<too", "", [2], TAG, 9) == ("<too", "")
    assert plan_delta("<too", "", [], TAG, 9) == ("", "<too")


def test_target_names_the_state_the_wrapper_reads() -> None:
    assert TARGET.version == "0.22.1"
    assert {"is_tool_call_started", "tool_call_start_token"} <= TARGET.names


# --- vLLM 0.22.1's parsers on the CPU ------------------------------------------------------
CASES: list[dict[str, Any]] = [
    {"name": "named_added", "pieces": [[CALL, "added"]], "tool_choice": NAMED},
    {"name": "named_bytes", "pieces": [[CALL, "bytes"]], "tool_choice": NAMED},
    {"name": "content_then_call", "pieces": [["Sure <tip> ", "bytes"], [CALL, "bytes"]],
     "tool_choice": "auto"},
    {"name": "content_ends_in_tag_start", "pieces": [["see <tool", "bytes"]],
     "tool_choice": "auto"},
    {"name": "two_calls_bytes", "pieces": [[CALL + "\n" + CLOCK_CALL, "bytes"]],
     "tool_choice": "required"},
]
WANT: dict[str, tuple[str | None, list[tuple[str, dict[str, Any]]]]] = {
    "named_added": (None, [("get_weather", WEATHER)]),
    "named_bytes": (None, [("get_weather", WEATHER)]),
    "content_then_call": ("Sure <tip> ", [("get_weather", WEATHER)]),
    "content_ends_in_tag_start": ("see <tool", []),
    "two_calls_bytes": (None, [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
}


def _got(case: dict[str, Any]) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    a = case["assembled"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in a["tool_calls"] or []]
    return a["content"], calls


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, dict[str, Any]]:
    require_tree()
    out = {}
    for plugins in (False, True):
        tmp = tmp_path_factory.mktemp(f"plugins_{plugins}")
        out[plugins], _ = run_probe(PROBE, {"strict": True, "plugins": plugins,
                                            "tokenizer": str(tmp / "tok"), "cases": CASES},
                                    tmp)
    return out


def test_stock_parser_loses_a_call_whose_tag_is_spelled_in_pieces(
        probed: dict[bool, dict[str, Any]]) -> None:
    stock = probed[False]
    assert stock["rebound"] is False
    # the server's setting: strict tool calling sends named choices to the XML parser
    assert stock["supports_required_and_named"] is False
    cases = stock["cases"]
    assert cases["named_bytes"]["skip_special_tokens"] is True
    assert _got(cases["named_added"]) == WANT["named_added"]
    # the H200's tool_named_stream: the whole call streamed as content, no call
    assert _got(cases["named_bytes"]) == (CALL, [])
    assert cases["named_bytes"]["text"] == CALL


def test_plugin_rebinds_it_in_the_process_that_loads_vllms_plugins(
        probed: dict[bool, dict[str, Any]]) -> None:
    fixed = probed[True]
    assert fixed["rebound"] is True
    assert fixed["plugin"].startswith("deferred"), fixed["plugin"]
    assert fixed["outcome"].startswith("wrapped"), fixed["outcome"]


@pytest.mark.parametrize("name", sorted(WANT))
def test_fixed_stream_assembles_the_call_and_the_content(
        probed: dict[bool, dict[str, Any]], name: str) -> None:
    case = probed[True]["cases"][name]
    assert _got(case) == WANT[name], case["first_deltas"]
    # the serving layer's finish_reason and remaining-arguments step read this list
    assert [c["name"] for c in case["prev_tool_call_arr"]] == [n for n, _ in WANT[name][1]]


def test_fix_leaves_single_token_tags_and_plain_content_as_vllm_streams_them(
        probed: dict[bool, dict[str, Any]]) -> None:
    for name in ("named_added", "content_ends_in_tag_start"):
        assert _got(probed[True]["cases"][name]) == _got(probed[False]["cases"][name])
