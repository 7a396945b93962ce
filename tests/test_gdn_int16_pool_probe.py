"""CPU probe of the int16 GDN pool inside vLLM 0.22.1, run by tests/test_gdn_int16_pool_vllm.py
in the serving venv with the 0.22.1 tree first on the path (holds no tests itself; pytest
imports it and finds none: everything that needs torch or vLLM is imported inside main).

    python test_gdn_int16_pool_probe.py REQUEST.json RESULT.json

Part `allocation` (one process per request, because vLLM loads the plugins once per
process): each case builds the VllmConfig the API server builds, with our plugin loaded
through its entry point and the case's SM70_PLUGIN_CONFIG (int16 on), then
tests/vllm_memory_probe.py's `allocation` with the GDN layer class the plugin registered
(the class PluggableLayer would build), and records which model class ModelRegistry
resolves the architecture to (the class whose classmethods aligned the block size).

Part `layer` (when the request asks): Sm70GatedDeltaNetInt16 on vLLM's real
GDNAttentionMetadata with strided int16 pool views: a decode step and an MTP step reach our
op (replaced by its reference) with the scales; a prefill step reaches vLLM's _forward_core
(replaced by a recorder that checks and edits the float32 scratch) and comes back stored
as int16 at exactly the named slots; the refusals' messages.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

H_ALL, HV_ALL, TP = 4, 12, 2
H, HV, D = H_ALL // TP, HV_ALL // TP, 128
CONV_DIM = 2 * H * D + HV * D
ROWS = 3 + 3
SLOTS = 30
PREFIX = "model.layers.0.linear_attn"


def _allocation(request: dict[str, Any]) -> dict[str, Any]:
    from vllm_config_probe import build_config, in_case_env, parse_engine_args
    from vllm_memory_probe import allocation

    out: dict[str, Any] = {}
    for case in request["cases"]:
        def work(case: dict[str, Any] = case) -> dict[str, Any]:
            from vllm.model_executor.custom_op import op_registry_oot
            from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn_mod
            from vllm.model_executor.models.registry import ModelRegistry

            config = build_config(parse_engine_args(case["argv"]))
            name = gdn_mod.QwenGatedDeltaNetAttention.__name__
            oot = op_registry_oot.get(name)
            model_cls, _ = ModelRegistry.resolve_model_cls(
                config.model_config.architecture, model_config=config.model_config)
            saved = gdn_mod.QwenGatedDeltaNetAttention
            if oot is not None:  # what PluggableLayer builds in place of vLLM's class
                gdn_mod.QwenGatedDeltaNetAttention = oot
            try:
                res = allocation(config)
            finally:
                gdn_mod.QwenGatedDeltaNetAttention = saved
            res["gdn_layer_class"] = None if oot is None else oot.__name__
            res["model_class"] = model_cls.__name__
            return res

        out[case["name"]] = in_case_env(case, work)
    return out


def _make_layer(layer_mod: Any, gen: Any) -> Any:
    import torch

    cls = layer_mod.Sm70GatedDeltaNetInt16
    layer = cls.__new__(cls)
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
    # one raw page per slot holding conv, codes and scales at their offsets, as vLLM lays
    # them out (page stride wider than the three states)
    conv_b, code_b, scale_b = ROWS * CONV_DIM * 2, HV * D * D * 2, HV * D * 4
    page = conv_b + code_b + scale_b + 512
    raw = torch.zeros(SLOTS * page, dtype=torch.uint8)
    conv = torch.as_strided(raw.view(torch.float16), (SLOTS, ROWS, CONV_DIM),
                            (page // 2, CONV_DIM, 1), 0)
    codes = torch.as_strided(raw.view(torch.int16), (SLOTS, HV, D, D),
                             (page // 2, D * D, D, 1), conv_b // 2)
    scale = torch.as_strided(raw.view(torch.float32), (SLOTS, HV, D),
                             (page // 4, D, 1), (conv_b + code_b) // 4)
    conv.copy_(torch.randn(SLOTS, ROWS, CONV_DIM, generator=gen).half())
    from vllm_patch.gdn.int16_scratch import quantize_rows

    c, s = quantize_rows(torch.randn(SLOTS, HV, D, D, generator=gen) * 0.1)
    codes.copy_(c)
    scale.copy_(s)
    layer.kv_cache = [conv, codes, scale]
    return layer


def _inputs(tokens: int, gen: Any) -> tuple[Any, ...]:
    import torch

    qkv = torch.randn(tokens, CONV_DIM, generator=gen).half()
    ba = torch.randn(tokens, 2 * HV, generator=gen).half()
    return qkv, ba[:, :HV].contiguous(), ba[:, HV:].contiguous()


def _decode_step(layer_mod: Any, ref: Any, gdn_attn: Any, kind: str, seen: list) -> dict:
    import torch

    gen = torch.Generator().manual_seed(3 if kind == "decode" else 4)
    layer = _make_layer(layer_mod, gen)
    if kind == "decode":
        idx = torch.tensor([7, 4, 9, 0, 0, 0, 0, 0], dtype=torch.int32)
        meta = gdn_attn.GDNAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=3, num_decode_tokens=3,
            num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=8,
            non_spec_query_start_loc=torch.tensor([0, 1, 2, 3, 3, 3, 3, 3, 3],
                                                  dtype=torch.int32),
            non_spec_state_indices_tensor=idx)
        qsl, ridx, acc, slots = meta.non_spec_query_start_loc[:4], idx[:3], None, [7, 4, 9]
    else:
        sidx = torch.zeros(6, 4, dtype=torch.int32)
        sidx[0] = torch.tensor([11, 12, 13, 14])
        sidx[1] = torch.tensor([21, 22, 23, 24])
        meta = gdn_attn.GDNAttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
            num_spec_decodes=2, num_spec_decode_tokens=7, num_actual_tokens=8,
            spec_sequence_masks=torch.tensor([True, True] + [False] * 4),
            spec_query_start_loc=torch.tensor([0, 4, 7, 7, 7, 7, 7], dtype=torch.int32),
            spec_state_indices_tensor=sidx,
            num_accepted_tokens=torch.tensor([3, 1, 1, 1, 1, 1], dtype=torch.int32))
        qsl, ridx = meta.spec_query_start_loc[:3], sidx[:2]
        acc, slots = meta.num_accepted_tokens[:2], [11, 12, 13, 14, 21, 22, 23]
    t = meta.num_actual_tokens
    mixed_qkv, b, a = _inputs(t, gen)
    conv0, codes0, scale0 = (x.clone() for x in layer.kv_cache)
    layer_mod.get_forward_context = lambda: SimpleNamespace(attn_metadata={PREFIX: meta})
    core = torch.zeros(t, HV, D, dtype=torch.float16)
    seen.clear()
    layer._forward_core(mixed_qkv, b, a, core)
    conv_w, codes_w, scale_w = conv0.clone(), codes0.clone(), scale0.clone()
    w = layer.conv1d.weight.view(CONV_DIM, 4)
    x = ref.conv1d_update_reference(mixed_qkv, conv_w, w, None, qsl, ridx, acc).half()
    out = ref.gdn_recurrent_reference(x, a, b, layer.A_log, layer.dt_bias, codes_w, qsl, ridx,
                                      acc, H, D**-0.5, scale_w).half()
    covered = int(qsl[-1])
    others = [s for s in range(SLOTS) if s not in slots]
    return {
        "scale_passed": bool(seen and seen[-1] is not None
                             and seen[-1].data_ptr() == layer.kv_cache[2].data_ptr()),
        "out_equal": bool(torch.equal(core[:covered], out[:covered])),
        "codes_equal": bool(torch.equal(layer.kv_cache[1], codes_w)),
        "scales_equal": bool(torch.equal(layer.kv_cache[2], scale_w)),
        "states_changed": bool(not torch.equal(layer.kv_cache[1][slots], codes0[slots])),
        "other_slots_untouched": bool(torch.equal(layer.kv_cache[1][others], codes0[others])
                                      and torch.equal(layer.kv_cache[2][others],
                                                      scale0[others])),
    }


def _prefill_step(layer_mod: Any, gdn_attn: Any) -> dict[str, Any]:
    """2 prefills (slots 5, 17) + 1 decode (slot 9) batched by vLLM, with a PAD (-1) row."""
    import torch
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from vllm_patch.gdn.int16_scratch import dequantize_rows

    gen = torch.Generator().manual_seed(5)
    layer = _make_layer(layer_mod, gen)
    idx = torch.tensor([17, 5, 9, -1], dtype=torch.int32)
    meta = gdn_attn.GDNAttentionMetadata(
        num_prefills=2, num_prefill_tokens=6, num_decodes=1, num_decode_tokens=1,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=7,
        has_initial_state=torch.tensor([True, False, True, False]),
        non_spec_query_start_loc=torch.tensor([0, 3, 6, 7, 7], dtype=torch.int32),
        non_spec_state_indices_tensor=idx)
    fc = SimpleNamespace(attn_metadata={PREFIX: meta})
    layer_mod.get_forward_context = lambda: fc
    conv0, codes0, scale0 = (x.clone() for x in layer.kv_cache)
    pool_before = list(layer.kv_cache)
    seen: dict[str, Any] = {}

    def stock(self: Any, mixed_qkv: Any, b: Any, a: Any, core: Any) -> None:
        m = fc.attn_metadata[PREFIX]
        conv, state = self.kv_cache
        seen["state_dtype"] = str(state.dtype)
        seen["indices"] = m.non_spec_state_indices_tensor.tolist()
        real = [int(i) for i in m.non_spec_state_indices_tensor if i >= 0]
        orig = [17, 5, 9]
        want = dequantize_rows(codes0[orig], scale0[orig])
        seen["scratch_holds_the_slots"] = bool(torch.equal(state[real], want)
                                               and torch.equal(conv[real], conv0[orig]))
        # what FLA would do: write a new final state and conv window for each row
        for n, i in enumerate(real):
            state[i] = state[i] * 0.5 + (n + 1) * 0.01
            conv[i] = conv[i] + 1
        core.fill_(1)

    saved = QwenGatedDeltaNetAttention._forward_core
    QwenGatedDeltaNetAttention._forward_core = stock
    try:
        core = torch.zeros(7, HV, D, dtype=torch.float16)
        layer._forward_core(*_inputs(7, gen), core)
    finally:
        QwenGatedDeltaNetAttention._forward_core = saved
    orig = [17, 5, 9]
    new = dequantize_rows(layer.kv_cache[1][orig], layer.kv_cache[2][orig])
    want = torch.stack([dequantize_rows(codes0[s], scale0[s]) * 0.5 + (n + 1) * 0.01
                        for n, s in enumerate(orig)])
    step = scale0[orig].unsqueeze(-1).amax() * 2  # a rounding step, with room
    others = [s for s in range(SLOTS) if s not in orig]
    return {
        **seen,
        "stock_output": bool(torch.all(core == 1)),
        "state_stored": bool((new - want).abs().max() <= step),
        "state_changed": bool(not torch.equal(layer.kv_cache[1][orig], codes0[orig])),
        "conv_stored": bool(torch.equal(layer.kv_cache[0][orig], conv0[orig] + 1)),
        "other_slots_untouched": bool(
            torch.equal(layer.kv_cache[1][others], codes0[others])
            and torch.equal(layer.kv_cache[2][others], scale0[others])
            and torch.equal(layer.kv_cache[0][others], conv0[others])),
        "pool_restored": all(x is y for x, y in zip(layer.kv_cache, pool_before, strict=True)),
        "meta_restored": fc.attn_metadata[PREFIX] is meta,
        "calls": dict(layer_mod.CALLS),
    }


def _refusals(layer_mod: Any, gdn_attn: Any) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(6)
    layer = _make_layer(layer_mod, gen)
    meta = gdn_attn.GDNAttentionMetadata(
        num_prefills=1, num_prefill_tokens=2, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=2,
        has_initial_state=torch.tensor([False]),
        non_spec_query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor([3], dtype=torch.int32))
    layer_mod.get_forward_context = lambda: SimpleNamespace(attn_metadata={PREFIX: meta})
    saved = layer_mod.is_conv_state_dim_first
    layer_mod.is_conv_state_dim_first = lambda: True  # VLLM_SSM_CONV_STATE_LAYOUT=DS
    try:
        layer._forward_core(*_inputs(2, gen), torch.zeros(2, HV, D, dtype=torch.float16))
        out["ds_layout_forward"] = None
    except RuntimeError as exc:  # the guard on the pool vLLM bound, behind construction's
        out["ds_layout_forward"] = str(exc)
    finally:
        layer_mod.is_conv_state_dim_first = saved
    out.update(_construction(layer_mod))
    # vLLM's own calculator choosing a non-float32 state (say --mamba-ssm-cache-dtype float16)
    from vllm_patch.gdn.int16_model import Sm70Qwen3_5Int16

    base = Sm70Qwen3_5Int16.__mro__[1]
    saved_dtype = base.get_mamba_state_dtype_from_config
    base.get_mamba_state_dtype_from_config = classmethod(
        lambda cls, cfg: (torch.float16, torch.float16))
    try:
        Sm70Qwen3_5Int16.get_mamba_state_dtype_from_config(None)
        out["fp16_base"] = None
    except ValueError as exc:
        out["fp16_base"] = str(exc)
    finally:
        base.get_mamba_state_dtype_from_config = saved_dtype
    return out


def _construction(layer_mod: Any) -> dict[str, Any]:
    """Each layer class built through its real __init__ (vLLM's own __init__ replaced by one
    that sets what it would: the model's shapes, dtypes and configs), as PluggableLayer
    builds it while the model loads: what the int16 layer refuses there, and that the
    plain layer and a supported int16 layer are built."""
    import torch

    base = layer_mod.QwenGatedDeltaNetAttention
    built: list[str] = []

    def fake_init(self: Any, model_dtype: Any = torch.float16) -> None:
        torch.nn.Module.__init__(self)
        self.prefix, self.tp_size = PREFIX, TP
        self.num_k_heads, self.num_v_heads = H_ALL, HV_ALL
        self.head_k_dim = self.head_v_dim = D
        self.conv_kernel_size, self.activation, self.num_spec = 4, "silu", 3
        self.A_log = torch.nn.Parameter(torch.zeros(HV, dtype=torch.float32))
        self.dt_bias = torch.nn.Parameter(torch.ones(HV, dtype=model_dtype))
        self.model_config = SimpleNamespace(dtype=model_dtype)
        # Qwen3.5's config verification sets the recurrent state's float32
        self.cache_config = SimpleNamespace(mamba_cache_dtype="auto",
                                            mamba_ssm_cache_dtype="float32")

    def build(cls: Any, **kw: Any) -> str | None:
        try:
            cls(**kw)
        except ValueError as exc:
            return str(exc)
        built.append(cls.__name__)
        return None

    saved = (base.__init__, layer_mod.load_ops, layer_mod.is_conv_state_dim_first)
    base.__init__ = fake_init
    layer_mod.load_ops = lambda: "not loaded (probe)"
    out: dict[str, Any] = {}
    try:
        int16, plain = layer_mod.Sm70GatedDeltaNetInt16, layer_mod.Sm70GatedDeltaNet
        out["ok_int16"] = build(int16)
        out["bf16_at_construction"] = build(int16, model_dtype=torch.bfloat16)
        out["bf16_plain"] = build(plain, model_dtype=torch.bfloat16)
        layer_mod.is_conv_state_dim_first = lambda: True  # VLLM_SSM_CONV_STATE_LAYOUT=DS
        out["ds_layout"] = build(int16)
        out["ds_plain"] = build(plain)
    finally:
        base.__init__, layer_mod.load_ops, layer_mod.is_conv_state_dim_first = saved
    out["built"] = built
    return out


def _layer() -> dict[str, Any]:
    import vllm.v1.attention.backends.gdn_attn as gdn_attn

    import vllm_patch.gdn.layer as layer_mod
    from vllm_patch.ops import reference_gdn as ref

    seen: list[Any] = []

    def conv(x: Any, conv_state: Any, weight: Any, bias: Any, qsl: Any, idx: Any,
             acc: Any = None, silu: bool = True) -> Any:
        return ref.conv1d_update_reference(x, conv_state, weight, bias, qsl, idx, acc,
                                           silu).half()

    def rec(qkv: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, state: Any, qsl: Any,
            idx: Any, acc: Any, h: int, scale: float, state_scale: Any = None) -> Any:
        seen.append(state_scale)
        return ref.gdn_recurrent_reference(qkv, a, b, a_log, dt_bias, state, qsl, idx, acc,
                                           h, scale, state_scale).half()

    layer_mod.kernels.gdn_conv1d_update = conv
    layer_mod.kernels.gdn_recurrent_decode = rec
    return {"decode": _decode_step(layer_mod, ref, gdn_attn, "decode", seen),
            "spec": _decode_step(layer_mod, ref, gdn_attn, "spec", seen),
            "prefill": _prefill_step(layer_mod, gdn_attn),
            "refusals": _refusals(layer_mod, gdn_attn)}


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    result: dict[str, Any] = {}
    try:
        import torch
        import vllm
        from vllm_config_probe import write_tokenizer

        torch.cpu._is_amx_tile_supported = lambda: False  # as vllm_memory_probe does
        result["vllm_version"] = vllm.__version__
        if request.get("cases"):
            write_tokenizer(Path(request["model_dir"]))
            result["cases"] = _allocation(request)
        if request.get("layer"):
            result["layer"] = _layer()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
