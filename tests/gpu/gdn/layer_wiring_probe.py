"""CPU probe of Sm70GatedDeltaNet._forward_core's wiring, run by tests/test_gdn_layer_wiring.py
in the serving venv with vLLM 0.22.1's Python tree first on the path.

The layer is the real subclass (vllm_patch.gdn.layer) on vLLM's real GDNAttentionMetadata;
our two ops are replaced by their float64 references (vllm_patch.ops.reference_gdn, cast to
fp16 like the kernels' outputs), so what is checked is what the layer hands them: the
metadata rows (graph-padded as vLLM's builder pads them), the pool views it updates in
place (strided, as the hybrid pages are), the per-GPU head count at TP=2, the conv weight
view, and where the outputs land. A prefill step must reach vLLM's own _forward_core.

    python layer_wiring_probe.py RESULT.json
"""

from __future__ import annotations

import json
import sys
import traceback
from types import SimpleNamespace
from typing import Any

import torch

H_ALL, HV_ALL, TP = 4, 12, 2  # per GPU: 2 key heads, 6 value heads
H, HV, D = H_ALL // TP, HV_ALL // TP, 128
CONV_DIM = 2 * H * D + HV * D
ROWS = 3 + 3  # conv state rows with MTP k = 3
SLOTS = 30
PREFIX = "model.layers.0.linear_attn"


def make_layer(layer_mod: Any, gen: torch.Generator) -> Any:
    layer = layer_mod.Sm70GatedDeltaNet.__new__(layer_mod.Sm70GatedDeltaNet)
    torch.nn.Module.__init__(layer)
    layer.prefix = PREFIX
    layer.tp_size = TP
    layer.num_k_heads, layer.num_v_heads = H_ALL, HV_ALL
    layer.head_k_dim = layer.head_v_dim = D
    layer.conv_kernel_size = 4
    layer.activation = "silu"
    layer.num_spec = 3
    layer.conv1d = SimpleNamespace(
        weight=(torch.randn(CONV_DIM, 1, 4, generator=gen) * 0.5).half(), bias=None)
    layer.A_log = torch.log(torch.rand(HV, generator=gen) * 15 + 1).float()
    layer.dt_bias = (torch.randn(HV, generator=gen) * 0.5).half()
    layer._sm70_checked = False
    layer._sm70_reason = None
    # pool views with a page stride wider than the state, as vLLM's hybrid pages
    conv_raw = torch.randn(SLOTS, ROWS * CONV_DIM + 64, generator=gen).half()
    ssm_raw = torch.randn(SLOTS, HV * D * D + 256, generator=gen) * 0.1
    layer.kv_cache = (conv_raw[:, : ROWS * CONV_DIM].view(SLOTS, ROWS, CONV_DIM),
                      ssm_raw[:, : HV * D * D].view(SLOTS, HV, D, D))
    return layer


def inputs(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    z = HV * D
    qkvz = torch.randn(tokens, CONV_DIM + z, generator=gen).half()
    ba = torch.randn(tokens, 2 * HV, generator=gen).half()
    return qkvz[:, :CONV_DIM], ba[:, :HV].contiguous(), ba[:, HV:].contiguous()


def meta_decode(gdn_attn: Any) -> tuple[Any, list[int]]:
    """3 plain decodes padded to an 8-token graph; slots are column 0 of a block table."""
    table = torch.full((8, 4), -5, dtype=torch.int32)
    table[:, 0] = torch.tensor([7, 4, 9, 0, 0, 0, 0, 0], dtype=torch.int32)
    m = gdn_attn.GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=3, num_decode_tokens=3,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=8,
        non_spec_query_start_loc=torch.tensor([0, 1, 2, 3, 3, 3, 3, 3, 3], dtype=torch.int32),
        non_spec_state_indices_tensor=table[:, 0])
    return m, [7, 4, 9]


def meta_spec(gdn_attn: Any) -> tuple[Any, list[int]]:
    """2 MTP rows (4 and 3 tokens) padded to a 12-token graph."""
    idx = torch.zeros(12, 4, dtype=torch.int32)
    idx[0] = torch.tensor([11, 12, 13, 14])
    idx[1] = torch.tensor([21, 22, 23, 24])
    m = gdn_attn.GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=2, num_spec_decode_tokens=7, num_actual_tokens=12,
        spec_sequence_masks=torch.tensor([True, True] + [False] * 10),
        spec_query_start_loc=torch.tensor([0, 4, 7] + [7] * 10, dtype=torch.int32),
        spec_state_indices_tensor=idx,
        num_accepted_tokens=torch.tensor([3, 1] + [1] * 10, dtype=torch.int32))
    return m, [11, 12, 13, 14, 21, 22, 23]


def run_step(layer_mod: Any, ref: Any, gdn_attn: Any, kind: str, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(layer_mod, gen)
    meta, slots = (meta_decode if kind == "decode" else meta_spec)(gdn_attn)
    t = meta.num_actual_tokens
    mixed_qkv, b, a = inputs(t, gen)
    conv0, ssm0 = (x.clone() for x in layer.kv_cache)
    layer_mod.get_forward_context = lambda: SimpleNamespace(attn_metadata={PREFIX: meta})
    core = torch.zeros(t, HV, D, dtype=torch.float16)
    layer._forward_core(mixed_qkv, b, a, core)

    # what the layer must have computed: the references on the real rows only
    n = meta.num_decodes if kind == "decode" else meta.num_spec_decodes
    if kind == "decode":
        qsl, idx, acc = meta.non_spec_query_start_loc[: n + 1], torch.tensor(slots), None
    else:
        qsl, idx = meta.spec_query_start_loc[: n + 1], meta.spec_state_indices_tensor[:n]
        acc = meta.num_accepted_tokens[:n]
    conv_want, ssm_want = conv0.clone(), ssm0.clone()
    w = layer.conv1d.weight.view(CONV_DIM, 4)
    x = ref.conv1d_update_reference(mixed_qkv, conv_want, w, None, qsl, idx, acc).half()
    out = ref.gdn_recurrent_reference(x, a, b, layer.A_log, layer.dt_bias, ssm_want, qsl, idx,
                                      acc, H, D**-0.5).half()
    covered = int(qsl[-1])
    conv_named = [int(s) for s in (idx if idx.dim() == 1 else idx[:, 0])]
    others = [s for s in range(SLOTS) if s not in slots and s not in conv_named]
    return {
        "kind": kind,
        "out_equal": bool(torch.equal(core[:covered], out[:covered])),
        "conv_state_equal": bool(torch.equal(layer.kv_cache[0], conv_want)),
        "ssm_state_equal": bool(torch.equal(layer.kv_cache[1], ssm_want)),
        "states_changed": bool(not torch.equal(layer.kv_cache[1][slots], ssm0[slots])),
        "other_slots_untouched": bool(torch.equal(layer.kv_cache[1][others], ssm0[others])),
        "calls": dict(layer_mod.CALLS),
    }


def run_prefill(layer_mod: Any, gdn_attn: Any) -> dict[str, Any]:
    """A step with a prefill row reaches vLLM's _forward_core, our ops untouched."""
    gen = torch.Generator().manual_seed(3)
    layer = make_layer(layer_mod, gen)
    meta = gdn_attn.GDNAttentionMetadata(
        num_prefills=1, num_prefill_tokens=5, num_decodes=2, num_decode_tokens=2,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=7)
    layer_mod.get_forward_context = lambda: SimpleNamespace(attn_metadata={PREFIX: meta})
    seen: list[str] = []
    base = layer_mod.QwenGatedDeltaNetAttention
    saved = base._forward_core
    base._forward_core = lambda self, *a, **k: seen.append("stock")
    try:
        mixed_qkv, b, a = inputs(7, gen)
        layer._forward_core(mixed_qkv, b, a, torch.zeros(7, HV, D, dtype=torch.float16))
    finally:
        base._forward_core = saved
    return {"stock_called": seen == ["stock"], "calls": dict(layer_mod.CALLS)}


def main() -> int:
    result: dict[str, Any] = {}
    try:
        import vllm.v1.attention.backends.gdn_attn as gdn_attn

        import vllm_patch.gdn.layer as layer_mod
        from vllm_patch.ops import reference_gdn as ref

        ops: list[str] = []

        def conv(x: Any, conv_state: Any, weight: Any, bias: Any, qsl: Any, idx: Any,
                 acc: Any = None, silu: bool = True) -> Any:
            ops.append("conv")
            return ref.conv1d_update_reference(x, conv_state, weight, bias, qsl, idx, acc,
                                               silu).half()

        def rec(qkv: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, state: Any, qsl: Any,
                idx: Any, acc: Any, h: int, scale: float, state_scale: Any = None) -> Any:
            ops.append("recurrent")
            return ref.gdn_recurrent_reference(qkv, a, b, a_log, dt_bias, state, qsl, idx, acc,
                                               h, scale, state_scale).half()

        layer_mod.kernels.gdn_conv1d_update = conv
        layer_mod.kernels.gdn_recurrent_decode = rec
        result["decode"] = run_step(layer_mod, ref, gdn_attn, "decode", 1)
        result["spec"] = run_step(layer_mod, ref, gdn_attn, "spec", 2)
        n_ops = len(ops)
        result["prefill"] = run_prefill(layer_mod, gdn_attn)
        result["ops_in_prefill_step"] = len(ops) - n_ops
        result["ops"] = ops
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
