"""CPU probe of Sm70GatedDeltaNet._forward_core's wiring, run by tests/test_gdn_layer_wiring.py
in the serving venv with vLLM 0.22.1's Python tree first on the path.

The layer is the real subclass (vllm_patch.gdn.layer) on vLLM's real GDNAttentionMetadata;
our two ops are replaced by their float64 references (vllm_patch.ops.reference_gdn, cast to
fp16 like the kernels' outputs), so what is checked is what the layer hands them: the
metadata rows (graph-padded as vLLM's builder pads them), the pool views it updates in
place (strided, as the hybrid pages are), the per-GPU head count at TP=2, the conv weight
view, and where the outputs land. A prefill step must reach vLLM's own _forward_core by
default; with our prefill on (set_prefill("sm70")) a prefill-only step, a step of plain
decodes and prefills (chunk table or none) and a step of MTP rows and prefills must give
what each request alone gives on the references (`expected`), on its own slots only.

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


# --- steps with prefill rows (our prefill on: layer.set_prefill("sm70")) ---------------
# A request of a step: its kind ("decode", "prefill", "spec", "pad"), token count, state
# slot(s), whether it starts from its state, and (spec) accepted tokens.
Req = dict[str, Any]

MIXED = [  # plain decodes first (the builder's order), then prefills; 70 tokens cross a chunk
    {"kind": "decode", "n": 1, "slot": 7, "init": True},
    {"kind": "decode", "n": 1, "slot": 4, "init": True},
    {"kind": "prefill", "n": 70, "slot": 9, "init": True},
    {"kind": "prefill", "n": 5, "slot": 13, "init": False},
]
PREFILL_ONLY = [
    {"kind": "prefill", "n": 65, "slot": 17, "init": False},
    {"kind": "prefill", "n": 3, "slot": 9, "init": True},
]
MIXED_SPEC = [  # MTP rows among prefills; a plain decode the builder counts as a prefill
    {"kind": "spec", "n": 4, "slots": [11, 12, 13, 14], "acc": 2},
    {"kind": "prefill", "n": 66, "slot": 9, "init": True},
    {"kind": "spec", "n": 2, "slots": [21, 22, 23, 24], "acc": 1},
    {"kind": "prefill", "n": 1, "slot": 4, "init": True},
    {"kind": "pad", "n": 0, "slot": 0, "init": False},  # a padded row, at the back
]
PAD_TOKENS = 3  # num_actual_tokens past the real ones, as a padded batch has


def fla_chunk_indices(lens: list[int]) -> torch.Tensor:
    """FLA's table (vllm/model_executor/layers/fla/ops/index.py): (sequence numbered by
    non-empty sequences, chunk) per 64-token chunk."""
    rows, seq = [], -1
    for n in lens:
        for c in range((n + 63) // 64):
            seq += c == 0
            rows.append([seq, c])
    return torch.tensor(rows, dtype=torch.int32).view(-1, 2)


def _cum(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def meta_prefill(gdn_attn: Any, reqs: list[Req], table: bool) -> Any:
    """GDNAttentionMetadata for these requests, laid out as vLLM 0.22.1's builder does."""
    lens = [r["n"] for r in reqs]
    total = sum(lens)
    spec = [r["kind"] == "spec" for r in reqs]
    ns = [r for r, s in zip(reqs, spec, strict=True) if not s]
    ns_lens = [r["n"] for r in ns]
    fields: dict[str, Any] = dict(num_actual_tokens=total + PAD_TOKENS)
    if any(spec):
        starts = _cum(lens).tolist()
        tok_spec = [t for r, s, b in zip(reqs, spec, starts, strict=False) if s
                    for t in range(b, b + r["n"])]
        tok_ns = [t for r, s, b in zip(reqs, spec, starts, strict=False) if not s
                  for t in range(b, b + r["n"])]
        sp = [r for r in reqs if r["kind"] == "spec"]
        fields.update(
            num_prefills=sum(r["kind"] in ("prefill", "decode") for r in ns),
            num_prefill_tokens=sum(ns_lens), num_decodes=0, num_decode_tokens=0,
            num_spec_decodes=len(sp), num_spec_decode_tokens=sum(r["n"] for r in sp),
            spec_sequence_masks=torch.tensor(spec),
            spec_token_indx=torch.tensor(tok_spec), non_spec_token_indx=torch.tensor(tok_ns),
            spec_query_start_loc=_cum([r["n"] for r in sp]),
            spec_state_indices_tensor=torch.tensor([r["slots"] for r in sp], dtype=torch.int32),
            num_accepted_tokens=torch.tensor([r["acc"] for r in sp], dtype=torch.int32))
    else:
        dec = [r for r in ns if r["kind"] == "decode"]
        # split_decodes_and_prefills counts the padded tail as prefill tokens
        fields.update(
            num_prefills=len(ns) - len(dec),
            num_prefill_tokens=total + PAD_TOKENS - len(dec),
            num_decodes=len(dec), num_decode_tokens=len(dec), num_spec_decodes=0,
            num_spec_decode_tokens=0)
    # the slot is column 0 of the (gathered) block table: a strided view, as vLLM's
    block = torch.full((len(ns), 4), -5, dtype=torch.int32)
    block[:, 0] = torch.tensor([r["slot"] for r in ns], dtype=torch.int32)
    fields.update(
        non_spec_query_start_loc=_cum(ns_lens), non_spec_state_indices_tensor=block[:, 0],
        has_initial_state=torch.tensor([r["init"] for r in ns]),
        chunk_indices=fla_chunk_indices(ns_lens) if table else None,
        chunk_offsets=None)
    return gdn_attn.GDNAttentionMetadata(**fields)


def expected(layer: Any, ref: Any, reqs: list[Req], mixed_qkv: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
    """Each request alone on the references, as vLLM's own path defines it (a plain decode
    row is a 1-token prefill from its state there): out [T, HV, D], pools updated."""
    w = layer.conv1d.weight.view(CONV_DIM, 4)
    out = torch.zeros(mixed_qkv.shape[0], HV, D, dtype=torch.float16)
    pos = 0
    for r in reqs:
        rows = slice(pos, pos + r["n"])
        pos += r["n"]
        if r["kind"] == "pad":
            continue
        qsl = torch.tensor([0, r["n"]], dtype=torch.int32)
        if r["kind"] == "spec":
            idx = torch.tensor([r["slots"]], dtype=torch.int32)
            acc = torch.tensor([r["acc"]], dtype=torch.int32)
            x = ref.conv1d_update_reference(mixed_qkv[rows], conv, w, None, qsl, idx, acc).half()
            out[rows] = ref.gdn_recurrent_reference(x, a[rows], b[rows], layer.A_log,
                                                    layer.dt_bias, ssm, qsl, idx, acc, H,
                                                    D**-0.5).half()
            continue
        idx = torch.tensor([r["slot"]], dtype=torch.int32)
        init = torch.tensor([r["init"]])
        x = ref.conv1d_prefill_reference(mixed_qkv[rows], conv, w, None, qsl, idx, init).half()
        out[rows] = ref.gdn_prefill_reference(x, a[rows], b[rows], layer.A_log, layer.dt_bias,
                                              ssm, qsl, idx, init, H, D**-0.5).half()
    return out


def run_prefill_step(layer_mod: Any, ref: Any, gdn_attn: Any, reqs: list[Req], table: bool,
                     seed: int, ops: list[str]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(layer_mod, gen)
    meta = meta_prefill(gdn_attn, reqs, table)
    t = meta.num_actual_tokens
    mixed_qkv, b, a = inputs(t, gen)
    conv0, ssm0 = (x.clone() for x in layer.kv_cache)
    layer_mod.get_forward_context = lambda: SimpleNamespace(attn_metadata={PREFIX: meta})
    core = torch.zeros(t, HV, D, dtype=torch.float16)
    first = len(ops)
    calls0 = dict(layer_mod.CALLS)
    layer._forward_core(mixed_qkv, b, a, core)
    conv_want, ssm_want = conv0.clone(), ssm0.clone()
    want = expected(layer, ref, reqs, mixed_qkv, a, b, conv_want, ssm_want)
    real = t - PAD_TOKENS
    slots = sorted({s for r in reqs if r["kind"] != "pad"
                    for s in (r["slots"] if r["kind"] == "spec" else [r["slot"]])})
    others = [s for s in range(1, SLOTS) if s not in slots]
    return {
        "out_close": bool(torch.allclose(core[:real].float(), want[:real].float(),
                                         atol=2e-3, rtol=1e-3)),
        "out_max_err": float((core[:real].float() - want[:real].float()).abs().max()),
        "conv_state_close": bool(torch.allclose(layer.kv_cache[0].float(),
                                                conv_want.float(), atol=1e-3)),
        "ssm_state_close": bool(torch.allclose(layer.kv_cache[1], ssm_want, atol=1e-5,
                                               rtol=1e-5)),
        "states_changed": bool(not torch.equal(layer.kv_cache[1][slots], ssm0[slots])),
        "other_slots_untouched": bool(torch.equal(layer.kv_cache[1][others], ssm0[others])
                                      and torch.equal(layer.kv_cache[0][others],
                                                      conv0[others])),
        "ops": ops[first:],
        "calls": {k: v - calls0.get(k, 0) for k, v in layer_mod.CALLS.items()
                  if v != calls0.get(k, 0)},
    }


def run_int16_warmup(layer_mod: Any) -> dict[str, Any]:
    """vLLM's prefill warm-up (its profile run) on the int16 layer: the dtypes vLLM's own
    `_warmup_prefill_kernels` reads from get_state_dtype (it unpacks two), FLA's kernels
    left out, and what the layer declares afterwards (three: codes and scales)."""
    import types

    layer = make_layer(layer_mod, torch.Generator().manual_seed(9))
    layer.__class__ = layer_mod.Sm70GatedDeltaNetInt16
    # what vLLM's get_state_dtype reads (the launch's fp16 model, float32 base state)
    layer.model_config = types.SimpleNamespace(dtype=torch.float16)
    layer.cache_config = types.SimpleNamespace(mamba_cache_dtype="auto",
                                               mamba_ssm_cache_dtype="float32")
    base = layer_mod.Sm70GatedDeltaNet.__mro__[1]  # vLLM's QwenGatedDeltaNetAttention
    seen: dict[str, Any] = {}
    real = base._warmup_prefill_kernels

    def warmup(self: Any, qkv: Any, v_dim: int) -> None:
        try:
            _, state_dtype = self.get_state_dtype()  # the unpacking 0.22.1's warm-up does
            seen["state_dtype"] = str(state_dtype)
        except ValueError as exc:
            seen["error"] = str(exc)

    base._warmup_prefill_kernels = warmup
    try:
        layer._warmup_prefill_kernels(torch.zeros(4, 8), 0)
    finally:
        base._warmup_prefill_kernels = real
    seen["after"] = [str(d) for d in layer.get_state_dtype()]
    return seen


def run_prefill_step_int16(layer_mod: Any, ref: Any, gdn_attn: Any, reqs: list[Req],
                           seed: int, ops: list[str]) -> dict[str, Any]:
    """The int16 pool's layer on the same step: our prefill ops on a float32 copy of the
    step's slots, stored back as codes + row scales (int16_scratch.py)."""
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(layer_mod, gen)
    layer.__class__ = layer_mod.Sm70GatedDeltaNetInt16
    conv, ssm = layer.kv_cache
    codes, scales = ref.state_int16_quantize(ssm)
    layer.kv_cache = (conv, codes, scales)
    meta = meta_prefill(gdn_attn, reqs, True)
    t = meta.num_actual_tokens
    mixed_qkv, b, a = inputs(t, gen)
    conv0, codes0, scales0 = (x.clone() for x in layer.kv_cache)
    layer_mod.get_forward_context = lambda: SimpleNamespace(attn_metadata={PREFIX: meta})
    core = torch.zeros(t, HV, D, dtype=torch.float16)
    first = len(ops)
    layer._forward_core(mixed_qkv, b, a, core)
    conv_want = conv0.clone()
    ssm_want = ref.state_int16_dequantize(codes0, scales0).float()
    want = expected(layer, ref, reqs, mixed_qkv, a, b, conv_want, ssm_want)
    got_state = ref.state_int16_dequantize(layer.kv_cache[1], layer.kv_cache[2]).float()
    real = t - PAD_TOKENS
    slots = sorted({r["slot"] for r in reqs if r["kind"] != "pad"})
    others = [s for s in range(1, SLOTS) if s not in slots]
    # one int16 rounding per row: half a step of the row's largest entry
    step = ssm_want.abs().amax(-1, keepdim=True) / 32767
    return {
        "out_close": bool(torch.allclose(core[:real].float(), want[:real].float(),
                                         atol=2e-3, rtol=1e-3)),
        "out_max_err": float((core[:real].float() - want[:real].float()).abs().max()),
        "conv_state_close": bool(torch.allclose(layer.kv_cache[0].float(),
                                                conv_want.float(), atol=1e-3)),
        "ssm_state_close": bool(((got_state - ssm_want).abs() <= step * 0.51 + 1e-7).all()),
        "states_changed": bool(not torch.equal(layer.kv_cache[1][slots], codes0[slots])),
        "other_slots_untouched": bool(torch.equal(layer.kv_cache[1][others], codes0[others])
                                      and torch.equal(layer.kv_cache[2][others],
                                                      scales0[others])),
        "ops": ops[first:],
    }


def prefill_fakes(layer_mod: Any, ref: Any, ops: list[str], tables: list[bool]) -> None:
    """Our prefill ops replaced by their references; the two-pass one also checks the chunk
    table it is handed against the one our wrapper would make for its sequences."""
    from vllm_patch.ops import kernels

    def conv_prefill(x: Any, conv_state: Any, weight: Any, bias: Any, qsl: Any, idx: Any,
                     init: Any, silu: bool = True) -> Any:
        ops.append("conv_prefill")
        return ref.conv1d_prefill_reference(x, conv_state, weight, bias, qsl, idx, init,
                                            silu).half()

    def one_pass(qkv: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, state: Any, qsl: Any,
                 idx: Any, init: Any, h: int, scale: float) -> Any:
        ops.append("chunk_one_pass")
        return ref.gdn_prefill_reference(qkv, a, b, a_log, dt_bias, state, qsl, idx, init, h,
                                         scale).half()

    def two_pass(qkv: Any, a: Any, b: Any, a_log: Any, dt_bias: Any, state: Any, qsl: Any,
                 idx: Any, init: Any, h: int, scale: float, table: Any = None) -> Any:
        ops.append("chunk_two_pass")
        tables.append(table is not None
                      and torch.equal(table, kernels.gdn_chunk_indices(qsl)))
        return ref.gdn_prefill_reference(qkv, a, b, a_log, dt_bias, state, qsl, idx, init, h,
                                         scale).half()

    layer_mod.kernels.gdn_conv1d_prefill = conv_prefill
    layer_mod.kernels.gdn_chunk_prefill = one_pass
    layer_mod.kernels.gdn_chunk_prefill_two_pass = two_pass


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
        result["ops"] = list(ops)
        tables: list[bool] = []
        prefill_fakes(layer_mod, ref, ops, tables)
        layer_mod.set_prefill("sm70")
        try:
            for name, reqs, table, seed in (("prefill_only", PREFILL_ONLY, True, 4),
                                            ("mixed", MIXED, True, 5),
                                            ("mixed_one_pass", MIXED, False, 6),
                                            ("mixed_spec", MIXED_SPEC, True, 7)):
                n_tables = len(tables)
                result[name] = run_prefill_step(layer_mod, ref, gdn_attn, reqs, table, seed,
                                                ops)
                result[name]["tables_ok"] = tables[n_tables:]
            result["mixed_int16"] = run_prefill_step_int16(layer_mod, ref, gdn_attn, MIXED, 8,
                                                           ops)
            result["int16_warmup"] = run_int16_warmup(layer_mod)
        finally:
            layer_mod.set_prefill("fla")
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
