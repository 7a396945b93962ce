"""The settings as a type checker and a reader see them (GENERATED, do not edit).

Written by `python -m sm70ctl.settings.typegen` from env_schema.yaml: one attribute per
SM70_* variable (the name lower-cased without SM70_). `load_settings` returns an object of
this shape; code that takes settings annotates the parameter `SettingsView`. Importing this
module costs nothing at start-up (no pydantic).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from pydantic import SecretStr


class SettingsView(Protocol):
    """The validated, immutable SM70_* settings (see sm70ctl.settings)."""

    # Paths & caches
    model_dir: Path
    weights_dir: Path
    cache_dir: Path
    build_dir: Path
    mirror_dir: Path | None
    serve_python: Path
    log_dir: Path
    lock_dir: Path
    clef_dir: Path

    # Secrets
    hf_token: SecretStr | None
    api_key: SecretStr | None

    # Server & API
    host: str
    port: int
    served_model_name: str
    max_model_len: int
    enable_prefix_caching: bool
    enable_auto_tool_choice: bool
    tool_call_parser: str
    reasoning_parser: str | None
    max_logprobs: int
    generation_config: str

    # Multimodal
    limit_images: int
    limit_videos: int

    # Supervisor
    startup_timeout: float
    shutdown_grace: float
    restart: bool
    restart_backoff_max: float
    healthy_reset: float
    gpu_busy_mib: int
    log_max_bytes: int
    log_backups: int

    # Parallel
    gpus: list[str]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    p2p: Literal["auto", "on", "off"]
    nccl_cumem: bool
    cuda_device_order: Literal["PCI_BUS_ID", "FASTEST_FIRST"]

    # Memory plan & pools
    gpu_memory_utilization: float
    kv_cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk: int
    block_size: int
    state_block_multiplier: int
    gdn_state_dtype: Literal["float32", "int16"]
    split_pools: bool
    allocator_reserve: int
    cuda_context_reserve: int
    expandable_segments: bool

    # KV cache
    kv_cache_dtype: Literal["int8_per_token_head", "auto"]

    # Attention kernels
    attention_backend: Literal["SM70_PAGED", "TRITON_ATTN", "FLEX_ATTENTION"]
    prefill_attention: Literal["cutlass_fmha", "triton"]
    decode_tensor_cores: bool
    uniform_decode: bool
    decode_max_splits: int
    paged_prefill: bool

    # Sparse prefill
    sparse_prefill: bool
    sparse_prefill_percent: float
    sparse_prefill_mass: float
    sparse_prefill_block: int
    sparse_prefill_min_len: int
    sparse_decode_top_fraction: float

    # GEMM/GEMV routes
    quantization: Literal["gptq", "none"]
    dtype: Literal["float16", "float32"]
    int8_gemv: bool
    attn_weights_12bit: bool
    int8_lm_head: bool
    gemm_tuning: Literal["off", "cached", "full"]
    gemv_max_rows: int

    # All-reduce
    allreduce_mode: Literal["auto", "fp16", "int12"]
    custom_allreduce: bool
    allreduce_buffer_bytes: int

    # Gated DeltaNet
    gdn_kernel: Literal["sm70", "sm70_chunk", "triton"]
    gdn_chunk_size: int
    mamba_cache_mode: Literal["all", "align", "none"]

    # CUDA graphs
    cudagraph_mode: Literal["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]
    cudagraph_sizes: list[int]
    enforce_eager: bool

    # Speculative decoding
    spec_method: Literal["mtp", "ngram", "none"]
    spec_tokens: int
    draft_head_dtype: Literal["int8", "int4", "float16"]
    draft_cudagraph: bool
    ngram_assist: bool
    ngram_min: int
    ngram_max: int
    async_scheduling: bool

    # Clef
    clef: bool
    clef_rank: int
    clef_max_model_len: int
    clef_max_questions: int

    # Prompt-logprobs guard
    prompt_logprobs_chunk: int

    # Build & toolchain
    cuda_home: Path | None
    cuda_arch_list: str
    max_jobs: int
    nvcc_threads: int
    host_cc: Path | None

    # Logging
    log_level: Literal["debug", "info", "warning", "error"]
    profile_dir: Path | None

    def source_of(self, name: str) -> str:
        """'default', 'environment' or 'file:<path>' for a variable name or attribute."""
        ...

    def env_text(self, name: str) -> str:
        """The effective value of a variable in its environment spelling (secrets masked)."""
        ...

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> SettingsView:
        """A copy with some attributes replaced (values are not validated again)."""
        ...
