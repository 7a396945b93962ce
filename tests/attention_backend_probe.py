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


def _impl_and_routing() -> dict[str, Any]:
    """The impl's refusals, and which rows of a mixed step reach which kernel, with
    recording stand-ins for torch.ops.sm70.paged_decode and vLLM's unified_attention
    (no GPU here): the slicing of queries, outputs, lengths and block tables is ours."""
    import torch

    from vllm_patch.attention import backend, layout, rules

    out: dict[str, Any] = {"refused": {}}
    cases = {"head128": dict(head_size=128), "window": dict(sliding_window=128),
             "gqa4": dict(num_heads=8), "softcap": dict(logits_soft_cap=30.0)}
    for name, change in cases.items():
        kw = dict(num_heads=12, head_size=256, scale=0.0625, num_kv_heads=2,
                  alibi_slopes=None, sliding_window=None, kv_cache_dtype="int8_per_token_head")
        kw.update(change)
        try:
            backend.Sm70PagedImpl(**kw)
            out["refused"][name] = None
        except rules.AttentionConfigError as exc:
            out["refused"][name] = str(exc)
    impl = backend.Sm70PagedImpl(12, 256, 0.0625, 2, None, None, "int8_per_token_head")
    calls: dict[str, Any] = {}

    def fake_decode(q, k, v, ks, vs, bt, seq, qn, scale, splits):
        calls["decode"] = {"q_rows": q.shape[0], "k": [list(k.shape), list(k.stride())],
                           "ks": [list(ks.shape), list(ks.stride())], "bt_rows": bt.shape[0],
                           "seq": seq.tolist(), "qn": qn, "splits": splits,
                           "q_is_prefix": q.data_ptr() == query.data_ptr()}
        return torch.ones_like(q)

    def fake_unified(**kw):
        calls["prefill"] = {"q_rows": kw["q"].shape[0], "cu": kw["cu_seqlens_q"].tolist(),
                            "seq": kw["seqused_k"].tolist(), "bt_rows": kw["block_table"].shape[0],
                            "max_q": kw["max_seqlen_q"],
                            "scales_are_impls": kw["k_scale_cache"] is impl._k_scale_cache}
        kw["out"].fill_(2.0)

    backend.kernels.paged_decode = fake_decode
    backend.unified_attention = fake_unified
    kv = layout.new_page(8, 16, 2)
    t = 12  # 2 decodes of 2 rows, a prefill chunk of 5, then 3 padding tokens
    query = torch.zeros(t, 12, 256, dtype=torch.float16)
    output = torch.zeros_like(query)
    qsl = torch.tensor([0, 2, 4, 9], dtype=torch.int32)
    base = backend.TritonAttentionMetadata(
        num_actual_tokens=9, max_query_len=5, query_start_loc=qsl, max_seq_len=40,
        seq_lens=torch.tensor([30, 31, 40], dtype=torch.int32),
        block_table=torch.arange(9, dtype=torch.int32).view(3, 3),
        slot_mapping=torch.arange(t), seq_threshold_3D=8, num_par_softmax_segments=16,
        softmax_segm_output=None, softmax_segm_max=None, softmax_segm_expsum=None,
        use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None,
        prefix_kv_lens=None, suffix_kv_lens=None)

    class Common:
        query_start_loc = qsl
        query_start_loc_cpu = qsl

    fake_builder = type("B", (), {"reorder_batch_threshold": 4, "prefill_kernel": "triton",
                                  "_splits": lambda self, ctx, n, q: 7})()
    meta = backend.Sm70PagedMetadataBuilder._with_split(fake_builder, base, Common, 40)
    impl.forward(None, query, query[:, :2], query[:, :2], kv, meta, output)
    out["calls"] = calls
    out["meta"] = {k: getattr(meta, k) for k in ("num_decodes", "q_per_seq",
                                                 "num_decode_tokens", "num_prefills",
                                                 "max_prefill_query_len", "decode_splits")}
    out["output_rows"] = [float(output[i].float().mean()) for i in range(t)]
    out["route_calls"] = dict(backend.CALLS)
    return out


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
    def sizes(backend: Any) -> list[str]:
        return [f"multiple of {s.base}" if hasattr(s, "base") else str(s)
                for s in backend.get_supported_kernel_block_sizes()]

    out["kernel_block_sizes"] = sizes(cls)
    out["stock_kernel_block_sizes"] = sizes(TritonAttentionBackend)
    out["views"] = _views_match(*request["views"])
    out["routing"] = _impl_and_routing()
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
