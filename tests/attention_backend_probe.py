"""Probe child for tests/test_attention_backend.py: vLLM 0.22.1's CPU tree asked about our
attention backend (run by tests/vllm_cpu_tree.run_probe: `python probe.py request result`).

It loads the plugin through vLLM's own plugin loader, then reports what vLLM's registry,
validate_configuration and FullAttentionSpec make of Sm70PagedBackend, and whether our
layout views address the same bytes as TRITON_ATTN's own scale views.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _views_match(block_size: int, hkv: int) -> dict[str, Any]:
    import torch
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_patch.attention import layout

    nb = 3
    cache = layout.new_page(nb, block_size, hkv)
    impl = TritonAttentionImpl.__new__(TritonAttentionImpl)  # only its scale views are used
    impl._k_scale_cache = None
    impl._v_scale_cache = None
    impl._ensure_scale_caches(cache)
    cache.zero_()  # TRITON_ATTN fills its scales with 1.0
    ks, vs = layout.scale_views(cache)
    same = (ks.data_ptr() == impl._k_scale_cache.data_ptr()
            and vs.data_ptr() == impl._v_scale_cache.data_ptr()
            and ks.stride() == impl._k_scale_cache.stride()
            and vs.stride() == impl._v_scale_cache.stride()
            and ks.shape == impl._k_scale_cache.shape)
    k, v, oks, ovs = layout.op_views(cache, impl._k_scale_cache, impl._v_scale_cache)
    # write through our views, read the raw bytes back where TRITON_ATTN's layout puts them
    k[1, hkv - 1, block_size - 1, 7] = 5
    v[2, 0, 3, 255] = -9
    oks[1, hkv - 1, block_size - 1] = 0.25
    raw = cache.view(-1)
    row = 256 + 4
    kv_half = block_size * hkv * row

    def at(blk: int, half: int, tok: int, head: int) -> int:
        return blk * 2 * kv_half + half * kv_half + tok * hkv * row + head * row

    kb = at(1, 0, block_size - 1, hkv - 1)
    return {
        "scale_views_match_triton": bool(same),
        "k_byte": int(raw[kb + 7]),
        "v_byte": int(raw[at(2, 1, 3, 0) + 255]),
        "k_scale": float(raw[kb + 256 : kb + 260].view(torch.float32)[0]),
        "nonzero_bytes": int((raw != 0).sum()),
        "op_view_shapes": [list(t.shape) for t in (k, v, oks, ovs)],
    }


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    import torch
    from vllm.platforms.interface import DeviceCapability
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    load_general_plugins()
    from vllm_patch.plugin import registered

    out: dict[str, Any] = {"plugin": str(registered().get("attention_backend"))}
    cls = AttentionBackendEnum.CUSTOM.get_class()
    out["custom_class"] = f"{cls.__module__}.{cls.__qualname__}"
    out["name"] = cls.get_name()
    out["builder_cudagraph"] = cls.get_builder_cls()._cudagraph_support.name
    out["uniform_batch"] = AttentionCGSupport.UNIFORM_BATCH.name
    out["forward_includes_kv_cache_update"] = cls.forward_includes_kv_cache_update
    cap = DeviceCapability(7, 0)
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    out["validate"] = {}
    for case in request["validate"]:
        out["validate"][case["name"]] = cls.validate_configuration(
            head_size=case["head_size"], dtype=dtypes[case["dtype"]],
            kv_cache_dtype=case["kv_cache_dtype"], block_size=None, use_mla=False,
            has_sink=False, use_sparse=False, use_mm_prefix=False,
            use_per_head_quant_scales=False, device_capability=cap, attn_type="decoder")
    shapes = []
    for bs, hkv in request["shapes"]:
        ours = cls.get_kv_cache_shape(10, bs, hkv, 256, "int8_per_token_head")
        stock = TritonAttentionBackend.get_kv_cache_shape(10, bs, hkv, 256,
                                                          "int8_per_token_head")
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=256,
                                 dtype=torch.int8,
                                 kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)
        elems = 1
        for d in ours:
            elems *= d
        shapes.append({"ours": list(ours), "stock": list(stock),
                       "bytes_per_block": elems // 10, "page_size_bytes": spec.page_size_bytes})
    out["shapes"] = shapes
    out["kernel_block_sizes"] = [repr(s) for s in cls.get_supported_kernel_block_sizes()]
    out["stock_kernel_block_sizes"] = [
        repr(s) for s in TritonAttentionBackend.get_supported_kernel_block_sizes()]
    out["views"] = _views_match(*request["views"])
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
