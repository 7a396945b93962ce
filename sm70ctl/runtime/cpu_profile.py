"""Which settings vLLM's CPU build can run (the CPU test path, `--device cpu`)."""

from __future__ import annotations

from sm70ctl.settings.typed import SettingsView

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


def cpu_problems(settings: SettingsView) -> list[str]:
    """Why these settings cannot run on vLLM's CPU build; [] when they can."""
    out = []
    for name, attr, want, why in _CPU_RULES:
        have = getattr(settings, attr)
        if have != want:
            out.append(f"{name}={have} cannot run on the CPU ({why}); use {want}")
    return out
