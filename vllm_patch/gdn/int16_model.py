"""vLLM's Qwen3.5 model class with the int16 GDN pool's state dtypes and shapes (opt-in).

vLLM sizes the hybrid page twice: once from the model class's classmethods, before any
layer exists, to align the attention block size to the GDN page
(Platform.update_block_size_for_backend resolves the class through ModelRegistry), and once
from each layer's own get_state_dtype / get_state_shape (MambaBase.get_kv_cache_spec), to
lay the pool out. Both must say the same, so the plugin registers this subclass under the
checkpoint's architecture name (ModelRegistry.register_model, lazily by "module:class")
together with the layer subclass `layer.Sm70GatedDeltaNetInt16`. Everything else about the
model (weights, forward, MTP) is vLLM's. The third copy function moves the scales with their
codes when prefix caching copies a state between blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration

from vllm_patch.gdn import int16_pool

ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
CLASS_PATH = f"{__name__}:Sm70Qwen3_5Int16"


class Sm70Qwen3_5Int16(Qwen3_5ForConditionalGeneration):
    """Qwen3_5ForConditionalGeneration whose GDN state is (conv, int16 codes, fp32 scales)."""

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> tuple[torch.dtype, ...]:
        conv, temporal = super().get_mamba_state_dtype_from_config(vllm_config)
        problem = int16_pool.base_dtype_problem(str(temporal).removeprefix("torch."))
        if problem is not None:
            raise ValueError(problem)
        return conv, torch.int16, torch.float32

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> tuple[tuple[int, ...], ...]:
        conv, temporal = super().get_mamba_state_shape_from_config(vllm_config)
        return int16_pool.state_shapes(conv, temporal)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        conv_copy, temporal_copy = super().get_mamba_state_copy_func()
        return conv_copy, temporal_copy, temporal_copy
