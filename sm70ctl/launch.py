"""Pure functions from Settings to what vLLM receives: argv, environment, plugin config.

Nothing here touches the world. Facts only probes can know (is P2P available between the
GPUs? which indices do the GPU UUIDs have?) come in as explicit arguments, so serve's
pre-flight probes them and this module decides.

With default settings the argv starts with the reference deployment's command, flag for
flag and in the same order (FACTS.md), followed by our additions; tests pin it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error
from sm70ctl.settings.problems import MASK

VLLM_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
PLUGIN_CONFIG_ENV = "SM70_PLUGIN_CONFIG"
SECRET_FLAGS = ("--api-key",)


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def speculative_config(settings: Any) -> dict[str, Any] | None:
    """vLLM's --speculative-config, or None when speculation is off."""
    if settings.spec_method == "none":
        return None
    config: dict[str, Any] = {
        "method": settings.spec_method,
        "num_speculative_tokens": settings.spec_tokens,
    }
    if settings.spec_method == "ngram":
        config["prompt_lookup_min"] = settings.ngram_min
        config["prompt_lookup_max"] = settings.ngram_max
    return config


def compilation_config(settings: Any) -> dict[str, Any]:
    return {
        "cudagraph_mode": settings.cudagraph_mode,
        "cudagraph_capture_sizes": sorted(settings.cudagraph_sizes),
    }


def vllm_argv(settings: Any, *, secrets_file: Path | None = None) -> list[str]:
    """The full command line of the vLLM API server (argv[0] is the serving interpreter).

    The model goes in as `--model`: `python -m vllm.entrypoints.openai.api_server` ignores
    a positional model (only the `vllm serve` front end reads one) and would try to fetch
    vLLM's default model instead. The API key never goes on the command line (any local
    user can read it in `ps`): it goes into `secrets_file`, a 0600 YAML file vLLM reads
    through `--config` (write it with `secrets_yaml`).
    """
    s = settings
    argv = [str(s.serve_python), "-m", VLLM_ENTRYPOINT, "--model", str(s.model_dir)]
    # --- the reference deployment, in its order -------------------------------------
    if s.quantization != "none":
        argv += ["--quantization", s.quantization]
    argv += ["--dtype", s.dtype, "--tensor-parallel-size", str(s.tensor_parallel_size)]
    if not s.custom_allreduce:
        argv.append("--disable-custom-all-reduce")
    argv += ["--gpu-memory-utilization", f"{s.gpu_memory_utilization:g}"]
    if s.kv_cache_bytes > 0:
        argv += ["--kv-cache-memory-bytes", str(s.kv_cache_bytes)]
    argv += ["--kv-cache-dtype", s.kv_cache_dtype]
    argv.append("--enable-prefix-caching" if s.enable_prefix_caching
                else "--no-enable-prefix-caching")
    argv += [
        "--max-model-len", str(s.max_model_len),
        "--max-num-seqs", str(s.max_num_seqs),
        "--max-num-batched-tokens", str(s.max_num_batched_tokens),
        "--limit-mm-per-prompt", _json({"image": s.limit_images, "video": s.limit_videos}),
    ]
    if s.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    argv += ["--tool-call-parser", s.tool_call_parser]
    if s.reasoning_parser:
        argv += ["--reasoning-parser", s.reasoning_parser]
    argv += ["--compilation-config", _json(compilation_config(s))]
    argv += ["--mamba-cache-mode", s.mamba_cache_mode]
    spec = speculative_config(s)
    if spec is not None:  # exactly once: a second copy silently fell back to k=1
        argv += ["--speculative-config", _json(spec)]
    # --- our additions ----------------------------------------------------------------
    argv += [
        "--host", s.host,
        "--port", str(s.port),
        "--served-model-name", s.served_model_name,
        "--attention-backend", s.attention_backend,
        "--pipeline-parallel-size", str(s.pipeline_parallel_size),
        "--long-prefill-token-threshold", str(s.prefill_chunk),
        "--max-logprobs", str(s.max_logprobs),
        "--generation-config", s.generation_config,
    ]
    if s.block_size:
        argv += ["--block-size", str(s.block_size)]
    if s.enforce_eager:
        argv.append("--enforce-eager")
    argv.append("--async-scheduling" if s.async_scheduling else "--no-async-scheduling")
    if s.api_key is not None:
        argv += ["--config", str(secrets_file or secrets_path(s))]
    return argv


def secrets_path(settings: Any) -> Path:
    """Where serve writes the secrets file while the server runs: beside its port lock."""
    return Path(settings.lock_dir).expanduser() / f"serve-{settings.port}.secrets.yaml"


def secrets_yaml(settings: Any) -> str | None:
    """The YAML for vLLM's `--config` file carrying the secrets, or None when there are none.

    JSON string quoting is valid YAML, so any key survives as written.
    """
    if settings.api_key is None:
        return None
    return f"api-key: {json.dumps(settings.api_key.get_secret_value())}\n"


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv safe to print or log: values of secret flags (`--api-key X` or
    `--api-key=X`) become ***."""
    out = list(argv)
    for i, arg in enumerate(out):
        flag, eq, _ = arg.partition("=")
        if flag in SECRET_FLAGS and eq:
            out[i] = f"{flag}={MASK}"
        elif arg in SECRET_FLAGS and i + 1 < len(out):
            out[i + 1] = MASK
    return out


# --- compile cache ------------------------------------------------------------------------
def compile_key_items(settings: Any) -> dict[str, str]:
    """Every setting marked compile_key in the schema, in its environment spelling."""
    from sm70ctl.settings.schema import load_schema

    return {
        v.name: settings.env_text(v.name)
        for v in load_schema().variables
        if v.compile_key
    }


def compile_fingerprint(settings: Any) -> str:
    """Short hash of the kernel-shaping settings: names the compile-cache folder."""
    text = _json(sorted(compile_key_items(settings).items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compile_cache_dir(settings: Any) -> Path:
    """The default cache entry, keyed on settings alone; serve and warmup pass the entry
    `sm70ctl warmup` fingerprints (sources, compilers, library versions too)."""
    return Path(settings.cache_dir) / compile_fingerprint(settings)


# Where each compiler keeps its cache inside one cache entry (`sm70ctl warmup` fills them;
# SM70_KERNELS_BUILD_DIR is read by our kernel loader in the server process).
CACHE_SUBDIRS = {
    "VLLM_CACHE_ROOT": "vllm",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "SM70_KERNELS_BUILD_DIR": "kernels",
}


def cache_env(entry: Path) -> dict[str, str]:
    """The variables that point vLLM, Triton, TorchInductor and our kernel loader at one
    cache entry."""
    return {var: str(Path(entry) / sub) for var, sub in CACHE_SUBDIRS.items()}


# --- environment --------------------------------------------------------------------------
def plugin_config(settings: Any) -> dict[str, Any]:
    """What vllm_patch reads from SM70_PLUGIN_CONFIG (see vllm_patch/config.py)."""
    return plugin_config_obj(settings).to_dict()


def plugin_config_obj(settings: Any) -> Any:
    from vllm_patch.config import (
        AllreduceConfig,
        AttentionConfig,
        ClefConfig,
        GdnConfig,
        GemmConfig,
        LogprobsConfig,
        MemoryConfig,
        PluginConfig,
        SparsePrefillConfig,
        SpecConfig,
    )

    s = settings
    return PluginConfig(
        memory=MemoryConfig(
            state_block_multiplier=s.state_block_multiplier, split_pools=s.split_pools
        ),
        attention=AttentionConfig(
            prefill_kernel=s.prefill_attention,
            decode_tensor_cores=s.decode_tensor_cores,
            uniform_decode=s.uniform_decode,
            decode_max_splits=s.decode_max_splits,
            paged_prefill=s.paged_prefill,
        ),
        sparse_prefill=SparsePrefillConfig(
            enabled=s.sparse_prefill,
            percent=float(s.sparse_prefill_percent),
            mass=float(s.sparse_prefill_mass),
            block=s.sparse_prefill_block,
            min_len=s.sparse_prefill_min_len,
            decode_top_fraction=float(s.sparse_decode_top_fraction),
        ),
        gemm=GemmConfig(
            int8_gemv=s.int8_gemv,
            attn_weights_12bit=s.attn_weights_12bit,
            int8_lm_head=s.int8_lm_head,
            tuning=s.gemm_tuning,
            gemv_max_rows=s.gemv_max_rows,
        ),
        allreduce=AllreduceConfig(
            mode=s.allreduce_mode, buffer_bytes=s.allreduce_buffer_bytes
        ),
        gdn=GdnConfig(
            kernel=s.gdn_kernel, chunk_size=s.gdn_chunk_size, state_dtype=s.gdn_state_dtype
        ),
        spec=SpecConfig(
            draft_head_dtype=s.draft_head_dtype,
            draft_cudagraph=s.draft_cudagraph,
            ngram_assist=s.ngram_assist,
            ngram_min=s.ngram_min,
            ngram_max=s.ngram_max,
        ),
        clef=ClefConfig(
            enabled=s.clef,
            dir=str(s.clef_dir),
            rank=s.clef_rank,
            max_model_len=s.clef_max_model_len,
            max_questions=s.clef_max_questions,
        ),
        logprobs=LogprobsConfig(prompt_chunk=s.prompt_logprobs_chunk),
    )


def visible_devices(settings: Any, gpu_indices: Sequence[int] | None = None) -> str:
    """CUDA_VISIBLE_DEVICES as integers (vLLM parses it as ints, not UUIDs)."""
    if gpu_indices is not None:
        if len(gpu_indices) != len(settings.gpus):
            raise Sm70Error(
                f"resolved {len(gpu_indices)} GPU indices for SM70_GPUS="
                f"{','.join(settings.gpus)} ({len(settings.gpus)} GPUs)",
                hint="resolve every entry of SM70_GPUS",
            )
        return ",".join(str(i) for i in gpu_indices)
    unresolved = [g for g in settings.gpus if not g.isdigit()]
    if unresolved:
        raise Sm70Error(
            f"SM70_GPUS holds GPU UUIDs {unresolved} that were not resolved to indices",
            hint="serve resolves UUIDs through NVML and passes gpu_indices",
        )
    return ",".join(settings.gpus)


def p2p_disable(settings: Any, p2p_available: bool | None) -> str | None:
    """NCCL_P2P_DISABLE: forced by SM70_P2P, else from the topology (None: leave unset)."""
    if settings.p2p == "on":
        return "0"
    if settings.p2p == "off":
        return "1"
    if p2p_available is None:
        return None
    return "0" if p2p_available else "1"


def vllm_env(
    settings: Any,
    *,
    p2p_available: bool | None = None,
    gpu_indices: Sequence[int] | None = None,
    cache_entry: Path | None = None,
) -> dict[str, str]:
    """The variables sm70ctl sets for vLLM, NCCL and PyTorch (on top of the inherited env).

    `p2p_available`: whether driver P2P works between every pair of the GPUs (probed by
    serve); None when unknown. `gpu_indices`: SM70_GPUS resolved to CUDA indices.
    `cache_entry`: the warmed cache entry (default: `compile_cache_dir(settings)`).
    """
    s = settings
    env = {
        "CUDA_DEVICE_ORDER": s.cuda_device_order,
        "CUDA_VISIBLE_DEVICES": visible_devices(s, gpu_indices),
        "TORCH_CUDA_ARCH_LIST": s.cuda_arch_list,
        "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{s.expandable_segments}",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "NCCL_CUMEM_ENABLE": "1" if s.nccl_cumem else "0",
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
        **cache_env(cache_entry or compile_cache_dir(s)),
        "VLLM_LOGGING_LEVEL": s.log_level.upper(),
        PLUGIN_CONFIG_ENV: plugin_config_obj(s).to_json(),
    }
    disable = p2p_disable(s, p2p_available)
    if disable is not None:
        env["NCCL_P2P_DISABLE"] = disable
    if s.profile_dir is not None:
        env["VLLM_TORCH_PROFILER_DIR"] = str(s.profile_dir)
    return env


__all__ = [
    "CACHE_SUBDIRS",
    "PLUGIN_CONFIG_ENV",
    "cache_env",
    "compilation_config",
    "compile_cache_dir",
    "compile_fingerprint",
    "compile_key_items",
    "p2p_disable",
    "plugin_config",
    "plugin_config_obj",
    "redact_argv",
    "secrets_path",
    "secrets_yaml",
    "speculative_config",
    "visible_devices",
    "vllm_argv",
    "vllm_env",
]
