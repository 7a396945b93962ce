"""The vLLM API server's command line, from the settings (pure).

With default settings the argv starts with the reference deployment's command, flag for
flag and in the same order (FACTS.md), but for two values vLLM 0.22.1 would not keep (the
mamba cache mode and the capture sizes, sm70ctl.runtime.config_parity), followed by our
additions; tests pin it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sm70ctl.errors import Sm70Error
from sm70ctl.runtime.secrets import secrets_path
from sm70ctl.runtime.spec_flag import speculative_config_words
from sm70ctl.secrets import mask_argv
from sm70ctl.settings.typed import SettingsView

VLLM_ENTRYPOINT = "vllm.entrypoints.openai.api_server"
SECRET_FLAGS = ("--api-key",)


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def speculative_config(settings: SettingsView) -> dict[str, Any] | None:
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


def compilation_config(settings: SettingsView) -> dict[str, Any]:
    return {
        "cudagraph_mode": settings.cudagraph_mode,
        "cudagraph_capture_sizes": sorted(settings.cudagraph_sizes),
    }


CUSTOM_SLOT = "CUSTOM"  # vLLM's slot for a backend registered from outside its tree


def attention_backend_flag(setting: str, has_name: bool | None) -> str:
    """The --attention-backend value for SM70_ATTENTION_BACKEND=`setting` on a serving vLLM
    that has patch 0002's SM70_PAGED name (True), lacks it (False: the plugin registers the
    same backend in the CUSTOM slot there) or was not read (None: the setting as set)."""
    return CUSTOM_SLOT if setting == "SM70_PAGED" and has_name is False else setting


def vllm_argv(settings: SettingsView, *, secrets_file: Path | None = None,
              attention_backend: str | None = None) -> list[str]:
    """The full command line of the vLLM API server (argv[0] is the serving interpreter).

    attention_backend: the --attention-backend value when it is not the setting's own name
    (serve passes CUSTOM for SM70_PAGED on a vLLM without patch 0002's name:
    sm70ctl.serve.backend_name); None: SM70_ATTENTION_BACKEND as set.

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
        "--attention-backend", attention_backend or s.attention_backend,
        "--pipeline-parallel-size", str(s.pipeline_parallel_size),
        "--long-prefill-token-threshold", str(s.prefill_chunk),
        "--max-logprobs", str(s.max_logprobs),
        "--generation-config", s.generation_config,
        # Gated DeltaNet prefill on flash-linear-attention's Triton kernels: what vLLM's
        # "auto" picks on Volta anyway (FlashInfer's GDN prefill needs sm_90), named so a
        # newer card (the H200 test machine) runs the path a V100 runs
        "--gdn-prefill-backend", "triton",
    ]
    if s.block_size:
        argv += ["--block-size", str(s.block_size)]
    if s.enforce_eager:
        argv.append("--enforce-eager")
    argv.append("--async-scheduling" if s.async_scheduling else "--no-async-scheduling")
    if s.api_key is not None:
        argv += ["--config", str(secrets_file or secrets_path(s))]
    _check_one_speculative_config(s, argv, 0 if spec is None else 1)
    return argv


def _check_one_speculative_config(s: SettingsView, argv: list[str], want: int) -> None:
    """vLLM keeps the last --speculative-config with only a warning (runtime/spec_flag.py),
    so a setting's value that vLLM reads as one more is refused here."""
    words = speculative_config_words(argv)
    if len(words) == want:
        return
    free_form = {str(s.model_dir): "SM70_MODEL_DIR", s.generation_config: "SM70_GENERATION_CONFIG"}
    named = [f"{free_form[w]}={w!r}" for w in words if w in free_form]
    raise Sm70Error(
        f"the vLLM command line would carry --speculative-config {len(words)} times "
        f"(want {want}): {', '.join(named) or ', '.join(map(repr, words))} reads as that flag",
        hint="vLLM 0.22.1 keeps the last copy with only a warning; give the setting a value "
             "that does not start with '-'")


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv safe to print or log: values of secret flags (`--api-key X` or
    `--api-key=X`) become ***."""
    return mask_argv(argv, SECRET_FLAGS)


def shell_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def base_url(settings: SettingsView) -> str:
    """Where the server answers (a wildcard bind address is reached on loopback)."""
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"
