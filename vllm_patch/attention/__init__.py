"""The SM70 attention backend (vllm_patch.attention.backend), registered by the plugin as
SM70_PAGED on the patched tree and CUSTOM otherwise.

`Sm70PagedBackend` is bound lazily (PEP 562 `__getattr__`): the pure pieces of this package
(rules, and layout without vLLM) import on machines without vLLM, and the backend module,
which subclasses vLLM's TRITON_ATTN classes, is imported only when vLLM, or the plugin,
asks for the class. The annotation below is what the plugin's source check
(`vllm_patch.plugin.attention_backend_defined`) reads.
"""

from __future__ import annotations

from typing import Any

Sm70PagedBackend: Any  # bound on first access by __getattr__ below


def __getattr__(name: str) -> Any:
    if name == "Sm70PagedBackend":
        from vllm_patch.attention.backend import Sm70PagedBackend as cls

        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
