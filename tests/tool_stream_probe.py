"""Runs in the serving venv with vLLM 0.22.1's Python tree first on the path (see
tests/vllm_cpu_tree.py): a streamed chat answer through 0.22.1's own parsers, built as its
serving_chat builds them, on the tiny checkpoint's tokenizer. Driven by
tests/test_tool_stream_split_tag.py.

Request (JSON file argv[1]) -> result (JSON file argv[2]):
- "strict": VLLM_ENFORCE_STRICT_TOOL_CALLING (set before vLLM is imported: 0.22.1 reads it
  into the qwen3_coder parser's class at import);
- "plugins": load vLLM's general plugins first, as the API server does (ours then arms R9);
- "tokenizer": the folder to build the tiny tokenizer in (make_checkpoint.build_tokenizer);
- "cases": each {name, pieces: [[text, "added"|"bytes"], ...], tool_choice, thinking}: the
  generated text is the pieces' texts, tokenised whole ("added": `<tool_call>` and the other
  added tokens as single tokens) or one token per character ("bytes"), then the
  end-of-sequence token. Each token is one engine step: the delta text is what 0.22.1's
  incremental detokenizer gives for it with the request's skip_special_tokens, and
  DelegatingParser.parse_delta gets it with the prompt's ids, as the stream generator does.
Per case: the deltas assembled (openai_cases.assemble_stream), the first raw deltas, the
token count, the tool parser's prev_tool_call_arr, and the request's skip_special_tokens.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def token_ids(tok: Any, pieces: list[list[str]]) -> list[int]:
    ids: list[int] = []
    for text, spelling in pieces:
        if spelling == "added":
            ids += tok.encode(text, add_special_tokens=False)
        elif spelling == "bytes":
            for ch in text:
                ids += tok.encode(ch, add_special_tokens=False)
        else:
            raise ValueError(f"spelling {spelling!r}: expected added or bytes")
    return ids


def run_case(tok: Any, parser_cls: Any, tools: list[dict], case: dict[str, Any]) -> dict:
    import openai_cases as oc
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    kwargs = {"enable_thinking": bool(case.get("thinking", False))}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    req = ChatCompletionRequest(model="tiny", messages=msgs, tools=tools,
                                tool_choice=case["tool_choice"], stream=True,
                                chat_template_kwargs=kwargs)
    # what 0.22.1's render step does to the request before it is scheduled
    req = parser_cls.reasoning_parser_cls(tok, chat_template_kwargs=kwargs).adjust_request(req)
    req = parser_cls.tool_parser_cls(tok, req.tools).adjust_request(req)
    enc = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                  tokenize=True, **kwargs)
    prompt = list(enc if isinstance(enc, list) else enc["input_ids"])
    ids = [*token_ids(tok, case["pieces"]), tok.eos_token_id]
    params = SamplingParams(skip_special_tokens=req.skip_special_tokens,
                            spaces_between_special_tokens=req.spaces_between_special_tokens)
    detok = IncrementalDetokenizer.from_new_request(
        tok, SimpleNamespace(sampling_params=params, prompt_token_ids=prompt,
                             request_id="probe"))
    parser = parser_cls(tok, req.tools, chat_template_kwargs=kwargs)
    deltas: list[dict[str, Any]] = []
    for n, tid in enumerate(ids):
        last = n == len(ids) - 1
        detok.update([tid], stop_terminated=last)  # the end-of-sequence token stops it
        text = detok.get_next_output_text(finished=last, delta=True)
        msg = parser.parse_delta(text, [tid], req, prompt_token_ids=prompt)
        if msg is not None:
            deltas.append(msg.model_dump(exclude_none=True))
    chunks = [{"choices": [{"delta": d}]} for d in deltas]
    return {"assembled": oc.assemble_stream(chunks), "first_deltas": deltas[:6],
            "tokens": len(ids), "text": detok.output_text,
            "prev_tool_call_arr": parser.tool_parser.prev_tool_call_arr,
            "skip_special_tokens": req.skip_special_tokens}


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    os.environ["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "1" if request["strict"] else "0"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    sys.path[:0] = [str(REPO / "tests" / "gpu" / "ab"), str(REPO / "tests" / "gpu" / "serving")]
    import make_checkpoint as mc

    result: dict[str, Any] = {}
    if request["plugins"]:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        from vllm_patch import plugin

        result["plugin"] = str(plugin.registered().get("tool_call_split_tag"))
    import openai_cases as oc
    from vllm.parser.parser_manager import ParserManager
    from vllm.tokenizers import get_tokenizer

    folder = Path(request["tokenizer"])
    shape = mc.SHAPES["tiny"]
    mc.build_tokenizer(shape["vocab"], mc.full_config(shape)["text_config"]["eos_token_id"],
                       folder)
    tok = get_tokenizer(str(folder))
    parser_cls = ParserManager.get_parser(tool_parser_name="qwen3_coder",
                                          reasoning_parser_name="qwen3",
                                          enable_auto_tools=True, model_name="tiny")
    result["supports_required_and_named"] = parser_cls.tool_parser_cls.supports_required_and_named
    from vllm.tool_parsers import qwen3coder_tool_parser as q

    method = q.Qwen3CoderToolParser.__dict__["extract_tool_calls_streaming"]
    result["rebound"] = getattr(method, "__sm70_split_start_tag__", False)
    if request["plugins"]:
        from vllm_patch import plugin

        result["plugin_after"] = str(plugin.registered().get("tool_call_split_tag"))
        from vllm_patch.tool_calls import split_start_tag

        result["outcome"] = split_start_tag.outcome()
    tools = [oc.WEATHER_TOOL, oc.CLOCK_TOOL]
    result["cases"] = {c["name"]: run_case(tok, parser_cls, tools, c) for c in request["cases"]}
    Path(sys.argv[2]).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
