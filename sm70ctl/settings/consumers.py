"""Per-consumer views of Settings: small frozen dataclasses, one per consumer kind.

Each view names, field by field, what the schema says a consumer kind receives, so a test
(tests/test_settings_consumers.py) proves every variable reaches a field (no dead knobs).
The commands do not take these views: the plan builds `plan.PlanInputs.from_settings` and
the doctor `doctor.config.DoctorConfig.from_settings` (that test checks both directly);
build, serve and weights read the Settings object. The vLLM-facing consumers (argv, env,
plugin configuration) live in sm70ctl/launch.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SupervisorConfig:
    """What `sm70ctl serve` needs besides the vLLM argv/env."""

    python: Path
    model_dir: Path
    port: int
    gpus: tuple[str, ...]
    gpu_busy_bytes: int
    log_file: Path
    log_max_bytes: int
    log_backups: int
    log_level: str
    lock_file: Path
    startup_timeout_s: float
    shutdown_grace_s: float
    restart: bool
    restart_backoff_max_s: float
    healthy_reset_s: float
    warmup_gemm_tuning: str


@dataclass(frozen=True)
class BuildConfig:
    build_dir: Path
    mirror_dir: Path | None
    serve_python: Path
    cuda_home: Path | None
    cuda_arch_list: str
    max_jobs: int  # 0: derive from free memory
    nvcc_threads: int
    host_cc: Path | None


@dataclass(frozen=True)
class PlanInputs:
    """Everything the memory plan reads from settings (per GPU where it applies)."""

    model_dir: Path
    max_model_len: int
    max_logprobs: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpu_memory_utilization: float
    kv_cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    state_block_multiplier: int
    gdn_state_dtype: str
    split_pools: bool
    allocator_reserve_bytes: int
    cuda_context_reserve_bytes: int
    kv_cache_dtype: str
    decode_max_splits: int
    quantization: str
    attn_weights_12bit: bool
    int8_lm_head: bool
    allreduce_buffer_bytes: int
    cudagraph_sizes: tuple[int, ...]
    spec_method: str
    spec_tokens: int
    draft_head_dtype: str
    clef: bool
    clef_rank: int
    prompt_logprobs_chunk: int


@dataclass(frozen=True)
class DoctorConfig:
    gpus: tuple[str, ...]
    gpu_busy_bytes: int
    weights_dir: Path
    build_dir: Path
    serve_python: Path
    cuda_home: Path | None
    host_cc: Path | None


@dataclass(frozen=True)
class WeightsConfig:
    root: Path
    model_dir: Path
    token: str | None  # the secret itself: never print this object's fields

    def __repr__(self) -> str:
        return (f"WeightsConfig(root={self.root!r}, model_dir={self.model_dir!r}, "
                f"token={'***' if self.token else None})")


def supervisor_config(s: Any) -> SupervisorConfig:
    return SupervisorConfig(
        python=s.serve_python,
        model_dir=s.model_dir,
        port=s.port,
        gpus=tuple(s.gpus),
        gpu_busy_bytes=s.gpu_busy_mib,
        log_file=s.log_dir / f"serve-{s.port}.log",
        log_max_bytes=s.log_max_bytes,
        log_backups=s.log_backups,
        log_level=s.log_level,
        lock_file=s.lock_dir / f"serve-{s.port}.lock",
        startup_timeout_s=s.startup_timeout,
        shutdown_grace_s=s.shutdown_grace,
        restart=s.restart,
        restart_backoff_max_s=s.restart_backoff_max,
        healthy_reset_s=s.healthy_reset,
        warmup_gemm_tuning=s.gemm_tuning,
    )


def build_config(s: Any) -> BuildConfig:
    return BuildConfig(
        build_dir=s.build_dir,
        mirror_dir=s.mirror_dir,
        serve_python=s.serve_python,
        cuda_home=s.cuda_home,
        cuda_arch_list=s.cuda_arch_list,
        max_jobs=s.max_jobs,
        nvcc_threads=s.nvcc_threads,
        host_cc=s.host_cc,
    )


def plan_inputs(s: Any) -> PlanInputs:
    return PlanInputs(
        model_dir=s.model_dir,
        max_model_len=s.max_model_len,
        max_logprobs=s.max_logprobs,
        tensor_parallel_size=s.tensor_parallel_size,
        pipeline_parallel_size=s.pipeline_parallel_size,
        gpu_memory_utilization=s.gpu_memory_utilization,
        kv_cache_bytes=s.kv_cache_bytes,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        block_size=s.block_size,
        state_block_multiplier=s.state_block_multiplier,
        gdn_state_dtype=s.gdn_state_dtype,
        split_pools=s.split_pools,
        allocator_reserve_bytes=s.allocator_reserve,
        cuda_context_reserve_bytes=s.cuda_context_reserve,
        kv_cache_dtype=s.kv_cache_dtype,
        decode_max_splits=s.decode_max_splits,
        quantization=s.quantization,
        attn_weights_12bit=s.attn_weights_12bit,
        int8_lm_head=s.int8_lm_head,
        allreduce_buffer_bytes=s.allreduce_buffer_bytes,
        cudagraph_sizes=tuple(sorted(s.cudagraph_sizes)),
        spec_method=s.spec_method,
        spec_tokens=s.spec_tokens,
        draft_head_dtype=s.draft_head_dtype,
        clef=s.clef,
        clef_rank=s.clef_rank,
        prompt_logprobs_chunk=s.prompt_logprobs_chunk,
    )


def doctor_config(s: Any) -> DoctorConfig:
    return DoctorConfig(
        gpus=tuple(s.gpus),
        gpu_busy_bytes=s.gpu_busy_mib,
        weights_dir=s.weights_dir,
        build_dir=s.build_dir,
        serve_python=s.serve_python,
        cuda_home=s.cuda_home,
        host_cc=s.host_cc,
    )


def weights_config(s: Any) -> WeightsConfig:
    return WeightsConfig(
        root=s.weights_dir,
        model_dir=s.model_dir,
        token=s.hf_token.get_secret_value() if s.hf_token is not None else None,
    )


CONSUMER_FUNCTIONS = {
    "supervisor": supervisor_config,
    "build": build_config,
    "plan": plan_inputs,
    "doctor": doctor_config,
    "weights": weights_config,
}
