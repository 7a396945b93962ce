"""The `vllm.general_plugins` entry point: `register()`.

vLLM calls `register()` in every process it starts (API server, engine core, each
worker), possibly more than once per process; it must be idempotent and cheap. It reads
the plugin configuration (vllm_patch.config, from SM70_PLUGIN_CONFIG) and registers what
vLLM's hooks reach:

- our custom ops: the prebuilt csrc/ library `sm70ctl build` installs in vllm_patch/_lib/,
  when it matches this runtime (`vllm_patch.ops.loader.load_prebuilt`; torch is imported
  only when a library file exists; kernels that find none build it on first use);
- the `sm70_gptq` quantization config (vllm_patch.quantization): GPTQ-int8 checkpoints'
  linear layers and the int8 lm_head on our GEMV/GEMM, when vLLM is importable and
  `gemm.int8_gemv` is on (off: vLLM's own GPTQ path, which a V100 cannot run);
- the SM70 attention backend, registered with vLLM's backend registry
  (`register_backend`) under SM70_PAGED (the name patch 0002 adds), or in the CUSTOM slot
  of an unpatched vLLM, when its module `vllm_patch.attention` is present.

What hooks cannot reach (the archs vLLM's own kernels are compiled for) is in the patch
series, applied at build time. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from typing import Any

logger = logging.getLogger("vllm_patch")

ATTENTION_MODULE = "vllm_patch.attention"
ATTENTION_CLASS = "vllm_patch.attention.Sm70PagedBackend"

_lock = threading.Lock()
_state: dict[str, Any] = {}


def register() -> dict[str, Any]:
    """Register sm70ctl's extensions with vLLM; later calls return the first call's report."""
    with _lock:
        if _state:
            _state["calls"] += 1
            return dict(_state)
        from vllm_patch.config import PluginConfig

        config = PluginConfig.from_env()
        report: dict[str, Any] = {"calls": 1, "config": config}
        report["custom_ops"] = _load_custom_ops()
        report["attention_backend"] = _register_attention_backend()
        report["quantization"] = _register_quantization(config)
        _state.update(report)
        logger.info("sm70 plugin registered: custom ops %s, attention backend %s, "
                    "quantization %s", report["custom_ops"], report["attention_backend"],
                    report["quantization"])
        return dict(_state)


def registered() -> dict[str, Any]:
    """What `register()` did in this process (empty before the first call)."""
    return dict(_state)


def _load_custom_ops() -> str:
    from vllm_patch.ops.loader import load_prebuilt

    return load_prebuilt()


def _register_attention_backend() -> str:
    if importlib.util.find_spec(ATTENTION_MODULE) is None:
        return f"absent ({ATTENTION_MODULE} not installed)"
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:
        return "skipped (this vLLM has no register_backend)"
    # A vLLM built by `sm70ctl build` has the SM70_PAGED name (patch 0002); an unpatched
    # one only offers the CUSTOM slot (then use --attention-backend CUSTOM).
    slot = getattr(AttentionBackendEnum, "SM70_PAGED", None) or AttentionBackendEnum.CUSTOM
    register_backend(slot, ATTENTION_CLASS)
    return f"{slot.name} -> {ATTENTION_CLASS}"


def _register_quantization(config: Any) -> str:
    if not config.gemm.int8_gemv:
        return "off (gemm.int8_gemv is false)"
    if importlib.util.find_spec("vllm") is None:
        return "absent (vLLM not installed)"
    from vllm_patch.quantization import sm70_gptq

    return sm70_gptq.register(config.gemm.gemv_max_rows, config.gemm.int8_lm_head)
