"""Does vLLM keep what we ask for? Requested versus resulting engine config (pure).

tests/test_vllm_config_parity.py hands `vllm_argv`'s command line to vLLM 0.22.1's own parser
and engine-config builder (tests/vllm_config_probe.py reads the fields of `FIELDS` off the
resulting `VllmConfig`) and compares them with `requested(settings)` through `compare`. A
value vLLM changes, drops or refuses is a mismatch: vLLM often rewrites a setting with no
more than a log line (the mamba cache mode `all` became `align` that way).

Values are in the probe's plain form: enums by member name, torch dtypes without `torch.`.
`CUDA_GRAPH_FIELDS` are not read off the config: on the CPU platform the probe replays what
settles them on a GPU (see the probe). Fields the probe's platform rewrites for its own
reasons are expected with that platform's value (`cpu_platform_rewrites`), never skipped, so
a rewrite that stops happening is reported too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sm70ctl.settings.typed import SettingsView

# Our name -> attribute path in vLLM 0.22.1's VllmConfig.
FIELDS: dict[str, str] = {
    "mamba_cache_mode": "cache_config.mamba_cache_mode",
    "max_model_len": "model_config.max_model_len",
    "block_size": "cache_config.block_size",
    "max_num_seqs": "scheduler_config.max_num_seqs",
    "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
    "long_prefill_token_threshold": "scheduler_config.long_prefill_token_threshold",
    "kv_cache_dtype": "cache_config.cache_dtype",
    "kv_cache_memory_bytes": "cache_config.kv_cache_memory_bytes",
    "gpu_memory_utilization": "cache_config.gpu_memory_utilization",
    "enable_prefix_caching": "cache_config.enable_prefix_caching",
    "cudagraph_mode": "compilation_config.cudagraph_mode",
    "cudagraph_capture_sizes": "compilation_config.cudagraph_capture_sizes",
    "speculative_method": "speculative_config.method",
    "num_speculative_tokens": "speculative_config.num_speculative_tokens",
    "prompt_lookup_min": "speculative_config.prompt_lookup_min",
    "prompt_lookup_max": "speculative_config.prompt_lookup_max",
    "enforce_eager": "model_config.enforce_eager",
    "async_scheduling": "scheduler_config.async_scheduling",
    "tensor_parallel_size": "parallel_config.tensor_parallel_size",
    "pipeline_parallel_size": "parallel_config.pipeline_parallel_size",
    "disable_custom_all_reduce": "parallel_config.disable_custom_all_reduce",
    "dtype": "model_config.dtype",
    "quantization": "model_config.quantization",
    "max_logprobs": "model_config.max_logprobs",
    "served_model_name": "model_config.served_model_name",
    "generation_config": "model_config.generation_config",
    "attention_backend": "attention_config.backend",
}
# Settled on a GPU only; the probe reports them under these names.
CUDA_GRAPH_FIELDS = ("cuda_cudagraph_mode", "cuda_cudagraph_capture_sizes")

# Our plugin claims GPTQ checkpoints under its own method name (vllm_patch.quantization).
PLUGIN_GPTQ_METHOD = "sm70_gptq"


@dataclass(frozen=True)
class Mismatch:
    field: str
    requested: object
    resulting: object
    expected: object  # what the comparison wanted: the request, or a platform's rewrite

    def line(self) -> str:
        if self.expected != self.requested:
            return (f"{self.field}: requested {self.requested!r}, expected {self.expected!r} "
                    f"on this platform, vLLM holds {self.resulting!r}")
        return f"{self.field}: requested {self.requested!r}, vLLM holds {self.resulting!r}"


def _graphs_on(s: SettingsView) -> bool:
    return s.cudagraph_mode != "none" and not s.enforce_eager


def requested(settings: SettingsView) -> dict[str, object]:
    """What the settings ask vLLM for, per field (a field we leave to vLLM is absent)."""
    s = settings
    spec = s.spec_method != "none"
    ngram = s.spec_method == "ngram"
    graphs = _graphs_on(s)
    quant: str | None = None
    if s.quantization == "gptq":
        quant = PLUGIN_GPTQ_METHOD if s.int8_gemv else "gptq"
    out: dict[str, object] = {
        "mamba_cache_mode": s.mamba_cache_mode,
        "max_model_len": s.max_model_len,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "long_prefill_token_threshold": s.prefill_chunk,
        "kv_cache_dtype": s.kv_cache_dtype,
        "gpu_memory_utilization": s.gpu_memory_utilization,
        "enable_prefix_caching": s.enable_prefix_caching,
        "cudagraph_mode": s.cudagraph_mode.upper() if graphs else "NONE",
        "cudagraph_capture_sizes": sorted(s.cudagraph_sizes) if graphs else [],
        "speculative_method": s.spec_method if spec else None,
        "num_speculative_tokens": s.spec_tokens if spec else None,
        "enforce_eager": s.enforce_eager,
        "async_scheduling": s.async_scheduling,
        "tensor_parallel_size": s.tensor_parallel_size,
        "pipeline_parallel_size": s.pipeline_parallel_size,
        "disable_custom_all_reduce": not s.custom_allreduce,
        "dtype": s.dtype,
        "quantization": quant,
        "max_logprobs": s.max_logprobs,
        "served_model_name": s.served_model_name,
        "generation_config": s.generation_config,
        "attention_backend": s.attention_backend,
        "cuda_cudagraph_mode": s.cudagraph_mode.upper() if graphs else "NONE",
        "cuda_cudagraph_capture_sizes": sorted(s.cudagraph_sizes) if graphs else [],
    }
    if s.block_size:
        out["block_size"] = s.block_size
    if s.kv_cache_bytes > 0:
        out["kv_cache_memory_bytes"] = s.kv_cache_bytes
    if ngram:
        out["prompt_lookup_min"] = s.ngram_min
        out["prompt_lookup_max"] = s.ngram_max
    return out


def cpu_platform_rewrites(want: Mapping[str, object]) -> dict[str, object]:
    """The values vLLM 0.22.1's CPU platform holds instead of `want`, for its own reasons.

    None of these happens on the CUDA platform: the CPU has no CUDA graphs (the config's
    mode becomes NONE and its capture sizes empty: `VllmConfig.__post_init__` and
    `CpuPlatform.check_and_update_config`), the CPU platform always turns async scheduling
    off, and it has no custom all-reduce (`ParallelConfig` disables it where
    `use_custom_allreduce()` is false; CUDA's is true). The AMX-only rule (prefix caching
    off for linear attention) is kept out by the probe itself.
    """
    out: dict[str, object] = {}
    if "cudagraph_mode" in want:
        out["cudagraph_mode"] = "NONE"
    if "cudagraph_capture_sizes" in want:
        out["cudagraph_capture_sizes"] = []
    if "async_scheduling" in want:
        out["async_scheduling"] = False
    if "disable_custom_all_reduce" in want:
        out["disable_custom_all_reduce"] = True
    return out


def compare(want: Mapping[str, object], resulting: Mapping[str, object],
            rewrites: Mapping[str, object] | None = None) -> list[Mismatch]:
    """Every requested field whose resulting value is not the request (or, for a field in
    `rewrites`, not the platform's value); a field the result lacks counts as a mismatch."""
    rewrites = rewrites or {}
    missing = object()
    out = []
    for field, asked in want.items():
        expected = rewrites.get(field, asked)
        got = resulting.get(field, missing)
        if got is missing:
            out.append(Mismatch(field, asked, "(not reported)", expected))
        elif not _same(expected, got):
            out.append(Mismatch(field, asked, got, expected))
    return out


def _same(a: object, b: object) -> bool:
    # bool is an int in Python: True must not pass for 1.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
