"""Imports one copy of vLLM 0.22.1's quantization/humming.py as if on CUDA, without humming.

Run by tests/test_patches_series.py in the serving venv with vLLM 0.22.1's Python tree first
on the path; argv[1] is the humming.py to load (the sdist's, patched or not). vLLM's CPU
platform says `is_cuda()` is false, which skips the very import the patch guards, so the
platform is made to answer true, but only after the modules humming.py imports from vLLM
are loaded (some of them import CUDA-only extensions when they believe they are on CUDA).
Prints one JSON line: whether the module imported, what the method probe returned for a
GPTQ checkpoint, and what building a HummingConfig raised.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys

DEPENDENCIES = (
    "vllm.envs",
    "vllm.model_executor.layers.quantization",
    "vllm.model_executor.layers.quantization.base_config",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.fused_moe.config",
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.parameter",
    "vllm.model_executor.utils",
)
MODULE = "vllm.model_executor.layers.quantization.humming"


def main(path: str) -> dict[str, object]:
    for name in DEPENDENCIES:
        importlib.import_module(name)
    from vllm.platforms import current_platform

    current_platform.is_cuda = lambda: True  # type: ignore[method-assign]
    out: dict[str, object] = {"humming_found": importlib.util.find_spec("humming") is not None}
    spec = importlib.util.spec_from_file_location(MODULE, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:  # the unpatched module's failure is the point of the probe
        out["import_error"] = f"{type(exc).__name__}: {exc}"
        return out
    config = mod.HummingConfig
    out["probe_gptq"] = config.override_quantization_method(
        {"quant_method": "gptq", "bits": 8}, "gptq"
    )
    try:
        config.from_config({"quant_method": "humming"})
        out["build_error"] = None
    except Exception as exc:
        out["build_error"] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
