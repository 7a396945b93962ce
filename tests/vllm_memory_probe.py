"""What vLLM 0.22.1 allocates for our launch command line (run by tests/test_plan_vllm_parity.py).

Runs like tests/vllm_config_probe.py (its machinery is reused: the serving interpreter with
vLLM 0.22.1's Python tree first on PYTHONPATH, our plugin loaded through its entry point, no
sm70ctl import). `python vllm_memory_probe.py REQUEST.json RESULT.json` reads `{"model_dir",
"cases": [{"name", "argv", "env"}]}` and writes, per case, either the allocation or
`{"error": "..."}`.

Each case builds the VllmConfig the way the API server does (vllm_config_probe.build_config),
then goes the way a CUDA worker goes from there, with vLLM's own functions:

1. the block size: the CPU platform set its own 128 where CUDA keeps CacheConfig's default
   (16), so that default is restored unless --block-size was given, then
   `Platform.update_block_size_for_backend` runs (the CUDA platform does not override it),
   which takes the backend's preferred size and `_align_hybrid_block_size` raises it until
   the attention page holds the GDN page and pads the GDN page to match. The one step that
   needs a built model, `_find_non_ssm_backend` (it reads the layers from the forward
   context), is answered with the backend the config names, TRITON_ATTN when none (what
   CUDA picks on Volta, VLLM_MAP section 8); then `VllmConfig.validate_block_size`;
2. the per-layer specs: `Attention.get_kv_cache_spec` and the GDN layer's
   `MambaBase.get_kv_cache_spec` (`get_state_shape`, `get_state_dtype`), called on layer
   objects holding the attributes their `__init__` sets from the model config at this TP
   size (building the layers themselves needs a TP process group and weights); one
   attention layer per `full_attention` entry of layer_types plus the MTP layers when the
   speculative method is mtp, one GDN layer per `linear_attention` entry;
3. `get_kv_cache_configs` with one spec dict and `--kv-cache-memory-bytes` per TP rank
   (the worker returns that figure as its available memory without profiling), which
   groups the layers, checks that one max-model-len request fits, and gives the blocks.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_config_probe import (  # the shared probe machinery
    build_config,
    in_case_env,
    parse_engine_args,
    write_tokenizer,
)


def cuda_block_size(config: Any) -> str:
    """Step 1 of the module doc; returns the backend's name."""
    from vllm.config.cache import CacheConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cache = config.cache_config
    if not cache.user_specified_block_size:
        cache.block_size = CacheConfig.DEFAULT_BLOCK_SIZE
    cache.mamba_page_size_padded = None
    member = config.attention_config.backend or AttentionBackendEnum.TRITON_ATTN
    backend = member.get_class()

    class CudaWorkerPath(Platform):
        @classmethod
        def _find_non_ssm_backend(cls, vllm_config: Any) -> Any:
            return backend

    CudaWorkerPath.update_block_size_for_backend(config)
    config.validate_block_size()
    return str(member.name)


def layer_specs(config: Any) -> dict[str, Any]:
    """Step 2 of the module doc: layer name -> KVCacheSpec, for one TP rank."""
    import torch
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backend import AttentionType

    model, parallel, cache = config.model_config, config.parallel_config, config.cache_config
    hf = model.hf_text_config
    spec_cfg = config.speculative_config
    num_spec = spec_cfg.num_speculative_tokens if spec_cfg is not None else 0

    attn = object.__new__(Attention)
    torch.nn.Module.__init__(attn)
    attn.attn_type = AttentionType.DECODER
    attn.kv_cache_dtype = cache.cache_dtype
    attn.kv_cache_torch_dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model)
    attn.sliding_window = None
    attn.num_kv_heads = model.get_num_kv_heads(parallel)
    attn.head_size = attn.head_size_v = model.get_head_size()

    gdn = object.__new__(QwenGatedDeltaNetAttention)
    torch.nn.Module.__init__(gdn)
    gdn.tp_size = parallel.tensor_parallel_size
    gdn.num_k_heads = hf.linear_num_key_heads
    gdn.num_v_heads = hf.linear_num_value_heads
    gdn.head_k_dim = hf.linear_key_head_dim
    gdn.head_v_dim = hf.linear_value_head_dim
    gdn.conv_kernel_size = hf.linear_conv_kernel_dim
    gdn.num_spec = num_spec
    gdn.model_config, gdn.cache_config = model, cache

    specs: dict[str, Any] = {}
    for i, kind in enumerate(hf.layer_types):
        if kind == "full_attention":
            specs[f"language_model.model.layers.{i}.self_attn.attn"] = (
                attn.get_kv_cache_spec(config))
        else:
            specs[f"language_model.model.layers.{i}.linear_attn"] = gdn.get_kv_cache_spec(config)
    if spec_cfg is not None and spec_cfg.method == "mtp":
        first = len(hf.layer_types)
        for j in range(getattr(hf, "mtp_num_hidden_layers", 0)):
            specs[f"mtp.layers.{first + j}.self_attn.attn"] = attn.get_kv_cache_spec(config)
    return specs


def allocation(config: Any) -> dict[str, Any]:
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_utils import (
        _estimate_max_model_len_from_groups,
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    backend = cuda_block_size(config)
    cache = config.cache_config
    tp = config.parallel_config.tensor_parallel_size
    memory = cache.kv_cache_memory_bytes
    if not memory:
        raise ValueError("no --kv-cache-memory-bytes: vLLM would profile the GPU")
    specs = layer_specs(config)
    kv_config = get_kv_cache_configs(config, [specs] * tp, [memory] * tp)[0]
    groups = kv_config.kv_cache_groups
    attn_spec = next(s for s in specs.values() if isinstance(s, FullAttentionSpec))
    gdn_spec = next((s for s in specs.values() if isinstance(s, MambaSpec)), None)
    kinds = ["attention" if isinstance(g.kv_cache_spec, FullAttentionSpec) else "gdn"
             for g in groups]
    page = groups[0].kv_cache_spec.page_size_bytes
    out: dict[str, Any] = {
        "attention_backend": backend,
        "block_size": cache.block_size,
        "mamba_block_size": cache.mamba_block_size,
        "mamba_cache_mode": cache.mamba_cache_mode,
        "attention_page_bytes": attn_spec.page_size_bytes,
        "attention_page_bytes_per_token": replace(attn_spec, block_size=1).page_size_bytes,
        "attention_values_page_bytes": attn_spec.real_page_size_bytes,
        "page_bytes": page,
        "num_blocks": kv_config.num_blocks,
        "group_kinds": kinds,
        "group_size": max(len(g.layer_names) for g in groups),
        "group_layers": [len(g.layer_names) for g in groups],
        "tensors": len(kv_config.kv_cache_tensors),
        "tensor_bytes": [t.size for t in kv_config.kv_cache_tensors],
        "attention_layers": sum(isinstance(s, FullAttentionSpec) for s in specs.values()),
        "gdn_layers": sum(isinstance(s, MambaSpec) for s in specs.values()),
        "max_concurrency": get_max_concurrency_for_kv_cache_config(config, kv_config),
    }
    if gdn_spec is not None:
        out["gdn_shapes"] = [list(s) for s in gdn_spec.shapes]
        out["gdn_dtypes"] = [str(d).removeprefix("torch.") for d in gdn_spec.dtypes]
        out["gdn_page_bytes"] = replace(gdn_spec, page_size_padded=None).page_size_bytes
        out["gdn_padded_page_bytes"] = gdn_spec.page_size_bytes
        out["gdn_pages_per_request"] = cdiv(gdn_spec.max_memory_usage_bytes(config), page)
    model = config.model_config
    out["max_model_len"] = model.max_model_len
    out["attention_blocks_per_request"] = cdiv(
        attn_spec.max_memory_usage_bytes(config), page)
    # the longest single request the blocks hold, searched past max_model_len
    saved = model.max_model_len
    model.max_model_len = 1 << 24
    try:
        out["longest_request"] = _estimate_max_model_len_from_groups(config, groups, memory)
    finally:
        model.max_model_len = saved
    return out


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    return in_case_env(case, lambda: allocation(build_config(parse_engine_args(case["argv"]))))


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    write_tokenizer(Path(request["model_dir"]))
    import torch
    import vllm

    # the same AMX rule vllm_config_probe explains: every machine takes the non-AMX path
    torch.cpu._is_amx_tile_supported = lambda: False
    results = {c["name"]: run_case(c) for c in request["cases"]}
    Path(result_path).write_text(json.dumps({"vllm_version": vllm.__version__,
                                             "vllm_file": vllm.__file__, "cases": results}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
