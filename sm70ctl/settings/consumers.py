"""What each consumer kind receives from Settings, field by field.

The plan and the doctor are their real input objects (`PlanInputs.from_settings`,
`DoctorConfig.from_settings`); supervisor, build and weights read the Settings object
directly, so for them this module names the fields they read as small frozen views. A test
(tests/test_settings_consumers.py) proves every variable reaches a field of its consumer
(no dead knobs) and every field is fed by a variable. The vLLM-facing consumers (argv,
env, plugin configuration) live in sm70ctl/launch.py.
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


def weights_config(s: Any) -> WeightsConfig:
    return WeightsConfig(
        root=s.weights_dir,
        model_dir=s.model_dir,
        token=s.hf_token.get_secret_value() if s.hf_token is not None else None,
    )


def plan_inputs(s: Any) -> Any:
    """The plan's own inputs (what `sm70ctl plan` and serve's pre-flight compute with)."""
    from sm70ctl.plan.plan import PlanInputs

    return PlanInputs.from_settings(s)


def doctor_config(s: Any) -> Any:
    """The doctor's own configuration."""
    from sm70ctl.doctor.config import DoctorConfig

    return DoctorConfig.from_settings(s)


CONSUMER_FUNCTIONS = {
    "supervisor": supervisor_config,
    "build": build_config,
    "plan": plan_inputs,
    "doctor": doctor_config,
    "weights": weights_config,
}
