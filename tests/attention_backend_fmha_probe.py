"""Probe child for tests/test_attention_backend_fmha.py: the SM70 backend's opt-in FMHA prefill
route (SM70_PREFILL_ATTENTION=cutlass_fmha) on vLLM 0.22.1's CPU tree (run by
tests/vllm_cpu_tree.run_probe: `python probe.py request result`).

No GPU here: torch.ops.sm70.fmha_prefill is replaced by vllm_patch.ops.reference_fmha's
reference, called with exactly the arguments the backend passes (and the op's argument rules
checked on them), so what is proven is ours: the row split, the context lengths built in
`build`, the block-table rows, the chunk offsets and the page strides. The expected outputs
are computed here independently (plain causal softmax over the dequantised context and the
chunk's fp16 K/V). The builder part constructs the real builder with each setting; the routing
part sets the builder's choice directly (its other fields need a whole engine config).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

HQ, HKV, BS, NBLK, SCALE = 12, 2, 16, 10, 0.0625


def _builder(kernel: str) -> str | None:
    """Construct the real builder with SM70_PREFILL_ATTENTION=kernel in the plugin config
    (vLLM's own builder __init__ stubbed: it needs a whole engine config); the refusal text,
    or None when it starts."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    from vllm_patch.attention import backend, rules
    from vllm_patch.config import AttentionConfig, PluginConfig

    def base_init(self: Any, spec: Any, names: Any, config: Any, device: Any) -> None:
        self.vllm_config, self.num_heads_q, self.num_heads_kv = config, HQ, HKV

    config = types.SimpleNamespace(speculative_config=None, parallel_config=types.SimpleNamespace(
                                       decode_context_parallel_size=1),
                                   model_config=types.SimpleNamespace(max_model_len=4096))
    os.environ["SM70_PLUGIN_CONFIG"] = PluginConfig(
        attention=AttentionConfig(prefill_kernel=kernel)).to_json()
    saved = TritonAttentionMetadataBuilder.__init__
    TritonAttentionMetadataBuilder.__init__ = base_init  # type: ignore[method-assign]
    try:
        b = backend.Sm70PagedMetadataBuilder(types.SimpleNamespace(block_size=BS), [], config,
                                             "cpu")
        return None if b.prefill_kernel == kernel else f"read {b.prefill_kernel}"
    except rules.AttentionConfigError as exc:
        return str(exc)
    finally:
        TritonAttentionMetadataBuilder.__init__ = saved  # type: ignore[method-assign]
        del os.environ["SM70_PLUGIN_CONFIG"]


def _stand_in(calls: list[dict[str, Any]]) -> Any:
    import torch

    from vllm_patch.ops.reference_fmha import fmha_prefill_reference

    def fmha(q, k, v, kc, vc, ks, vs, cs, ss, bt, qsl, ctx, block_size, max_q, scale):
        # the op's argument rules: cache strides and bases multiples of 4 bytes (its
        # narrowest load), the index tensors int32 and contiguous, the chunk rows matching
        assert all(x % 4 == 0 for x in cs) and kc.storage_offset() % 4 == 0
        assert vc.storage_offset() % 4 == 0
        assert q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == HKV
        assert qsl.dtype == ctx.dtype == bt.dtype == torch.int32
        assert qsl.is_contiguous() and ctx.is_contiguous() and bt.stride(1) == 1
        assert qsl.numel() == ctx.numel() + 1 and bt.shape[0] >= ctx.numel()
        lens = (qsl[1:] - qsl[:-1]).tolist()
        assert int(qsl[-1]) == q.shape[0] and max_q >= max(lens, default=0)
        calls.append({"rows": q.shape[0], "qsl": qsl.tolist(), "ctx": ctx.tolist(),
                      "bt": bt[:, :3].tolist(), "cs": list(cs), "ss": list(ss),
                      "block_size": block_size, "max_q": max_q})
        return fmha_prefill_reference(q, k, v, kc, vc, ks, vs, cs, ss, bt, qsl, ctx,
                                      block_size, scale).half()

    return fmha


def _routing(shift: dict[str, int]) -> dict[str, Any]:
    """A mixed step (decodes of 2 rows, an extend of 5 tokens after 21 cached ones, a fresh
    prefill of 3 tokens, padding) through `_with_split` and `forward`; per-row error against
    the independent expectation. `shift` perturbs the input to show the check can fail."""
    import torch

    from vllm_patch.attention import backend, layout
    from vllm_patch.ops.reference_fmha import quantize_per_token_head

    torch.manual_seed(0)
    calls: list[dict[str, Any]] = []
    backend.kernels.fmha_prefill = _stand_in(calls)
    backend.kernels.paged_decode = lambda q, *a: torch.ones_like(q)

    def no_triton(**kw: Any) -> None:
        raise AssertionError("the triton prefill ran on the FMHA route")

    backend.unified_attention = no_triton
    impl = backend.Sm70PagedImpl(HQ, 256, SCALE, HKV, None, None, "int8_per_token_head")
    kv = layout.new_page(NBLK, BS, HKV)
    impl._ensure_scale_caches(kv)  # TRITON_ATTN sets every scale to 1.0 when it makes them
    q_lens, seqs = [2, 2, 5, 3], [30, 31, 26, 3]
    tables = [[0, 1, 9], [2, 3, 9], [7, 4, 9], [5, 9, 9]]  # the extend's context: 7 then 4
    t_real = sum(q_lens)
    t = t_real + 3
    query = torch.randn(t, HQ, 256).half()
    key = torch.randn(t, HKV, 256).half()
    value = torch.randn(t, HKV, 256).half()
    # every block holds something, so reading a wrong block or token changes the result
    full_k = torch.randn(NBLK, BS, HKV, 256)
    full_v = torch.randn(NBLK, BS, HKV, 256)
    for half, src in ((0, full_k), (1, full_v)):
        codes, scales = quantize_per_token_head(src)
        kv[:, half, :, :, :256] = codes
        kv[:, half].view(torch.float32)[..., 64] = scales
    deq_k = kv[:, 0, :, :, :256].float() * kv[:, 0].view(torch.float32)[..., 64:65]
    deq_v = kv[:, 1, :, :, :256].float() * kv[:, 1].view(torch.float32)[..., 64:65]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32)
    seq_t = torch.tensor(seqs, dtype=torch.int32) + shift.get("seq", 0)
    bt = torch.tensor(tables, dtype=torch.int32)
    base = backend.TritonAttentionMetadata(
        num_actual_tokens=t_real, max_query_len=5, query_start_loc=qsl, max_seq_len=31,
        seq_lens=seq_t, block_table=bt, slot_mapping=torch.arange(t), seq_threshold_3D=8,
        num_par_softmax_segments=16, softmax_segm_output=None, softmax_segm_max=None,
        softmax_segm_expsum=None, use_cascade=False, common_prefix_len=0,
        cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None)

    class Common:
        query_start_loc = qsl
        query_start_loc_cpu = qsl

    fake = type("B", (), {"reorder_batch_threshold": 4, "prefill_kernel": "cutlass_fmha",
                          "_splits": lambda self, ctx, n, q: 3})()
    meta = backend.Sm70PagedMetadataBuilder._with_split(fake, base, Common, 31)
    output = torch.zeros_like(query)
    before = dict(backend.CALLS)
    backend.count_on_device(True, "cpu")  # the device counters, here on the CPU
    dev_before = {r: backend.device_count(r) for r in backend.DEVICE_ROUTES}
    impl.forward(None, query, key, value, kv, meta, output)
    dev_after = {r: backend.device_count(r) for r in backend.DEVICE_ROUTES}
    backend.count_on_device(False)
    errors = []
    for r in (2, 3):  # the two prefill rows, expected independently
        n, ctx = q_lens[r], seqs[r] - q_lens[r]
        pos = torch.arange(ctx)
        blk = torch.tensor(tables[r])[pos // BS]
        keys = torch.cat([deq_k[blk, pos % BS], key[starts[r]:starts[r] + n].float()])
        vals = torch.cat([deq_v[blk, pos % BS], value[starts[r]:starts[r] + n].float()])
        qq = query[starts[r]:starts[r] + n].float()
        g = HQ // HKV
        s = torch.einsum("qhd,khd->hqk", qq, keys.repeat_interleave(g, 1)) * SCALE
        mask = torch.arange(ctx + n)[None, :] > (ctx + torch.arange(n))[:, None]
        p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
        want = torch.einsum("hqk,khd->qhd", p, vals.repeat_interleave(g, 1))
        got = output[starts[r]:starts[r] + n].float()
        errors.append(float((got - want).abs().max()))
    return {"calls": calls, "errors": errors,
            "decode_rows": [float(output[i].float().mean()) for i in range(4)],
            "padding_rows": [float(output[i].float().abs().max()) for i in range(t_real, t)],
            "route": {k: backend.CALLS[k] - before[k] for k in backend.CALLS},
            "device_route": {r: dev_after[r] - dev_before[r] for r in dev_after},
            "ctx_lens": meta.prefill_ctx_lens.tolist() if meta.prefill_ctx_lens is not None
            else None}


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    out = {"builder": {k: _builder(k) for k in request["kernels"]},
           "routing": _routing({}), "shifted": _routing({"seq": 1})}
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
