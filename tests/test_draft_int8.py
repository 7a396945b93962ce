"""The MTP draft layer in int8 (vllm_patch.quantization.draft_int8, SM70_DRAFT_HEAD_DTYPE).

Here (no torch, no vLLM): which layers are the drafter's, the decision per value of the
setting, and the refusals, on both sides (sm70ctl before vLLM starts; the plugin config a
vLLM process reads). In a child with torch (this interpreter or .serve-venv, like
tests/test_ops_reference_gptq.py; skipped without one except under CI=true): the quantizer's
math against `vllm_patch.ops.reference.dequant_repacked` (the GEMV layout's definition),
the layer conversion, and, where the child also has vLLM, sm70_gptq's get_quant_method
handing the drafter's fp16 layers our method (its `apply` through a stand-in for the op:
the CPU build has no sm70 kernels). The GPU run is tests/gpu/serving/device_draft_int8.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from serve_venv import run_json

from sm70ctl.errors import Sm70Error
from sm70ctl.runtime.environment import vllm_env
from sm70ctl.runtime.plugin_config import plugin_config_obj
from sm70ctl.settings import load_settings
from vllm_patch.config import ENV_VAR, PluginConfig
from vllm_patch.quantization import draft_int8
from vllm_patch.quantization.rules import GptqRules, QuantConfigError

REFERENCE_QUANT = {
    "quant_method": "gptq", "checkpoint_format": "gptq", "bits": 8, "group_size": 128,
    "sym": False, "desc_act": False, "lm_head": False,
    "modules_to_not_convert": ["model.visual", "mtp", "lm_head",
                               "model.language_model.embed_tokens", "self_attn.q_proj",
                               "self_attn.k_proj", "self_attn.v_proj"],
    "dynamic": {"-:^mtp\\..*": {}},
}
# vLLM 0.22.1's names for Qwen3_5MTP's linear layers (qwen3_5_mtp.py: prefix "mtp")
DRAFT_LAYERS = ["mtp.fc", "mtp.layers.0.self_attn.qkv_proj", "mtp.layers.0.self_attn.o_proj",
                "mtp.layers.0.mlp.gate_up_proj", "mtp.layers.0.mlp.down_proj"]
TARGET_LAYERS = ["language_model.model.layers.3.self_attn.qkv_proj",
                 "language_model.model.layers.0.mlp.gate_up_proj",
                 "language_model.model.layers.2.linear_attn.in_proj_ba",
                 "language_model.model.layers.3.mlp.smtp.down_proj", "visual.blocks.0.mlp.fc1"]


# ---------------------------------------------------------------------- decisions
@pytest.mark.parametrize("prefix", DRAFT_LAYERS)
def test_drafter_layers_get_int8_only_when_the_setting_says_int8(prefix: str) -> None:
    assert draft_int8.is_draft_layer(prefix)
    assert draft_int8.draft_int8("int8", prefix)
    assert not draft_int8.draft_int8("float16", prefix)


@pytest.mark.parametrize("prefix", TARGET_LAYERS)
def test_target_layers_never_do(prefix: str) -> None:
    assert not draft_int8.is_draft_layer(prefix)
    assert not draft_int8.draft_int8("int8", prefix)


def test_the_reference_checkpoint_leaves_the_drafter_fp16_so_our_method_is_asked() -> None:
    # get_quant_method asks draft_int8 only for layers the checkpoint's rules leave fp16
    rules = GptqRules.from_config(REFERENCE_QUANT)
    for prefix in DRAFT_LAYERS:
        assert not rules.scheme_for(prefix).quantized, prefix


def test_int4_is_refused_naming_the_setting_the_value_and_the_rule() -> None:
    for value in ("int4", "bf16"):
        with pytest.raises(QuantConfigError) as exc:
            draft_int8.draft_int8(value, "mtp.fc")
        msg = str(exc.value)
        assert f"SM70_DRAFT_HEAD_DTYPE={value}" in msg and "int8 or float16 only" in msg
        assert "\n" not in msg


def test_layers_the_int8_path_cannot_hold_are_refused() -> None:
    draft_int8.check_layer("mtp.fc", 1024, "float16")
    with pytest.raises(QuantConfigError, match=r"layer mtp.fc: 1000 input features .* "
                       r"multiple of 128 .*SM70_DRAFT_HEAD_DTYPE=float16"):
        draft_int8.check_layer("mtp.fc", 1000, "float16")
    with pytest.raises(QuantConfigError, match=r"dtype bfloat16; .*float16 weights only"):
        draft_int8.check_layer("mtp.fc", 1024, "bfloat16")


def test_the_plugin_config_refuses_int4_and_keeps_the_served_widths() -> None:
    for value in ("int8", "float16"):
        cfg = PluginConfig.from_json(json.dumps({"spec": {"draft_head_dtype": value}}))
        assert cfg.spec.draft_head_dtype == value
    with pytest.raises(ValueError, match=r"spec.draft_head_dtype is 'int4' "
                       r"\(SM70_DRAFT_HEAD_DTYPE\).*int4 is not implemented"):
        PluginConfig.from_json(json.dumps({"spec": {"draft_head_dtype": "int4"}}))


def test_sm70ctl_refuses_int4_before_vllm_starts_in_one_line() -> None:
    settings = load_settings({"SM70_DRAFT_HEAD_DTYPE": "int4"})
    with pytest.raises(Sm70Error) as exc:
        vllm_env(settings)
    assert exc.value.message.startswith("SM70_DRAFT_HEAD_DTYPE=int4: ")
    assert "int4 is not implemented" in exc.value.message
    assert exc.value.hint == "set SM70_DRAFT_HEAD_DTYPE=int8"
    for value in ("int8", "float16"):
        cfg = plugin_config_obj(load_settings({"SM70_DRAFT_HEAD_DTYPE": value}))
        assert cfg.spec.draft_head_dtype == value


def test_the_served_width_is_read_from_the_processs_plugin_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for env, want in ((None, "int8"), ('{"spec":{"draft_head_dtype":"float16"}}', "float16")):
        monkeypatch.setattr(draft_int8, "_configured", [])
        if env is None:
            monkeypatch.delenv(ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(ENV_VAR, env)
        assert draft_int8.served_dtype() == want
    monkeypatch.setattr(draft_int8, "_configured", [])
    monkeypatch.setenv(ENV_VAR, '{"spec":{"draft_head_dtype":"float16"}}')
    assert draft_int8.method_for("mtp.fc") is None  # float16: vLLM's own method (no vLLM here)


# ---------------------------------------------------------------------- torch, in a child
CHILD = r'''
import json, os, sys
import torch
from vllm_patch.ops import reference as ref
from vllm_patch.quantization import draft_int8 as d

out = {}
g = torch.Generator().manual_seed(0)
# random weights with a per-group offset (asymmetric groups), one all-positive group
n, k = 40, 384
w = torch.randn(n, k, generator=g) * 0.02
off = (torch.rand(n, k // 128, 1, generator=g) - 0.5) * 0.05
w += off.expand(n, k // 128, 128).reshape(n, k)
w[3, 128:256] = torch.rand(128, generator=g) + 0.5
w16 = w.half()
qw, sz = d.quantize_int8_g128(w16)
deq = ref.dequant_repacked(qw, sz, 128)
scale = sz[..., 0].float().repeat_interleave(128, dim=1)
err = (deq - w16.float()).abs() / scale
out["layout"] = [str(qw.dtype), list(qw.shape), str(sz.dtype), list(sz.shape)]
out["max_err_in_scales"] = err.max().item()
out["frac_within_half_scale"] = (err <= 0.5 + 1e-3).float().mean().item()
out["zeros_integral"] = bool((sz[..., 1].float() == sz[..., 1].float().round()).all())
out["zeros_in_range"] = bool(((sz[..., 1] >= 0) & (sz[..., 1] <= 255)).all())
out["positive_group_zero"] = sz[3, 1, 1].item()
out["codes_span"] = [int(qw.min()), int(qw.max())]
# weights already on an int8 grid (power-of-two scale: exact in fp16) come back unchanged
codes = torch.randint(0, 256, (8, 256), generator=g)
codes[:, 0], codes[:, 1], codes[:, 128], codes[:, 129] = 0, 255, 0, 255
z = torch.randint(1, 255, (8, 2), generator=g)
s = 2.0 ** -10
grid = (s * (codes - z.repeat_interleave(128, dim=1))).half()
gq, gsz = d.quantize_int8_g128(grid)
out["grid_codes_equal"] = bool((gq.long() == codes).all())
out["grid_zeros_equal"] = bool((gsz[..., 1].long() == z).all())
out["grid_scales_equal"] = bool((gsz[..., 0].float() == s).all())
# an all-zero group dequantises to exact zeros
zq, zsz = d.quantize_int8_g128(torch.zeros(2, 128, dtype=torch.float16))
out["zero_group_exact"] = bool((ref.dequant_repacked(zq, zsz, 128) == 0).all())
# slices of rows give the same bytes as the whole
sq, ssz = d.quantize_sliced(w16, rows=16)
out["sliced_equal"] = bool(torch.equal(sq, qw) and torch.equal(ssz, sz))
try:
    d.quantize_int8_g128(torch.zeros(2, 100, dtype=torch.float16))
    out["k_refused"] = None
except ValueError as exc:
    out["k_refused"] = str(exc)
# the layer conversion: fp16 weight gone, our tensors in its place
layer = torch.nn.Module()
layer.register_parameter("weight", torch.nn.Parameter(w16.clone(), requires_grad=False))
before = sum(p.numel() * p.element_size() for p in layer.parameters())
d.convert_layer(layer)
d.convert_layer(layer)  # a second pass keeps the converted layer
out["converted"] = {
    "has_weight": hasattr(layer, "weight"),
    "params": {nm: [str(p.dtype), list(p.shape)] for nm, p in layer.named_parameters()},
    "bytes_before": before,
    "bytes_after": sum(p.numel() * p.element_size() for p in layer.parameters()),
    "same_codes": bool(torch.equal(layer.qweight, qw) and torch.equal(layer.sm70_sz, sz)),
    "group": layer.sm70_group_size,
}

# vLLM's side, where this interpreter has vLLM: get_quant_method and the method itself
try:
    import vllm  # noqa: F401
except ImportError:
    out["vllm"] = None
    print(json.dumps(out))
    sys.exit(0)
import vllm.model_executor.parameter as vparam
vparam.get_tensor_model_parallel_rank = lambda: 0
vparam.get_tensor_model_parallel_world_size = lambda: 1
from vllm.model_executor.layers.linear import ReplicatedLinear, WEIGHT_LOADER_V2_SUPPORTED
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm_patch.quantization import sm70_gptq

seen = []
def fake_int8_linear(x, qw, sz, group, bias=None):
    seen.append([list(x.shape), str(qw.dtype), group, bias is None])
    y = x.float() @ ref.dequant_repacked(qw, sz, group).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)
sm70_gptq.int8_linear = fake_int8_linear  # bound by draft_int8's class when it is built

cfg = sm70_gptq.Sm70GptqConfig.from_config(json.loads(sys.stdin.read())["quant"])
cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}
fake = object.__new__(ReplicatedLinear)  # isinstance(LinearBase) is all get_quant_method asks
methods = {}
for conf in ("int8", "float16"):
    os.environ["SM70_PLUGIN_CONFIG"] = json.dumps({"spec": {"draft_head_dtype": conf}})
    d._configured.clear()
    methods[conf] = {p: type(cfg.get_quant_method(fake, p)).__name__ for p in
                     ["mtp.fc", "mtp.layers.0.self_attn.qkv_proj", "mtp.layers.0.mlp.down_proj",
                      "language_model.model.layers.3.self_attn.qkv_proj",
                      "language_model.model.layers.3.mlp.down_proj"]}
out["methods"] = methods
os.environ["SM70_PLUGIN_CONFIG"] = json.dumps({"spec": {"draft_head_dtype": "int8"}})
d._configured.clear()
m = cfg.get_quant_method(fake, "mtp.layers.0.mlp.gate_up_proj")
out["weight_loader_v2"] = type(m).__name__ in WEIGHT_LOADER_V2_SUPPORTED
lay = torch.nn.Module()
m.create_weights(lay, 256, [48, 48], 256, 96, torch.float16, weight_loader=default_weight_loader)
out["created"] = [type(lay.weight).__name__, list(lay.weight.shape), str(lay.weight.dtype)]
wl = (torch.randn(96, 256, generator=g) * 0.02).half()
lay.weight.data.copy_(wl)
m.process_weights_after_loading(lay)
x = torch.randn(3, 256, generator=g).half()
calls0 = dict(d.CALLS)
y = m.apply(lay, x)
out["apply"] = {"seen": seen, "rel_err": ((y.float() - x.float() @ wl.float().t()).norm()
                                          / (x.float() @ wl.float().t()).norm()).item(),
                "calls": {k: d.CALLS[k] - calls0[k] for k in d.CALLS},
                "has_weight": hasattr(lay, "weight")}
try:
    m.create_weights(torch.nn.Module(), 200, [64], 200, 64, torch.float16,
                     weight_loader=default_weight_loader)
    out["k200"] = None
except Exception as exc:
    out["k200"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def child(request: pytest.FixtureRequest) -> dict[str, Any]:
    return run_json(["-c", CHILD], {"quant": REFERENCE_QUANT}, timeout=600)


def test_quantizer_layout_is_the_gemv_layout(child: dict[str, Any]) -> None:
    assert child["layout"] == ["torch.uint8", [40, 384], "torch.float16", [40, 3, 2]]
    assert child["zeros_integral"] and child["zeros_in_range"]
    assert child["codes_span"] == [0, 255]


def test_quantizer_rounds_to_nearest_against_the_stored_scale(child: dict[str, Any]) -> None:
    # round to nearest: half a step, except where the fp16 rounding of the scale clips the
    # group's extreme (at most 255 x 2^-11 of a step more)
    assert child["max_err_in_scales"] <= 0.5 + 255 * 2.0**-11 + 1e-3
    assert child["frac_within_half_scale"] > 0.99
    assert child["positive_group_zero"] == 0.0  # the range includes 0: all-positive -> zero 0


def test_weights_on_an_int8_grid_come_back_exactly(child: dict[str, Any]) -> None:
    assert child["grid_codes_equal"] and child["grid_zeros_equal"] and child["grid_scales_equal"]
    assert child["zero_group_exact"]


def test_slices_and_the_layer_conversion(child: dict[str, Any]) -> None:
    assert child["sliced_equal"]
    assert child["k_refused"] == "K=100 is not a multiple of group_size=128"
    conv = child["converted"]
    assert not conv["has_weight"] and conv["same_codes"] and conv["group"] == 128
    assert conv["params"] == {"qweight": ["torch.uint8", [40, 384]],
                              "sm70_sz": ["torch.float16", [40, 3, 2]]}
    assert conv["bytes_before"] == 40 * 384 * 2
    assert conv["bytes_after"] == 40 * 384 + 40 * 3 * 4


def _vllm(child: dict[str, Any]) -> None:
    if child.get("vllm", True) is None:
        pytest.skip("the torch interpreter has no vLLM (the quantizer was checked above)")


def test_get_quant_method_gives_the_drafter_our_method_only_for_int8(
        child: dict[str, Any]) -> None:
    _vllm(child)
    ours, theirs = "DraftInt8LinearMethod", "UnquantizedLinearMethod"
    assert child["methods"]["int8"] == {
        "mtp.fc": ours, "mtp.layers.0.self_attn.qkv_proj": ours,
        "mtp.layers.0.mlp.down_proj": ours,
        "language_model.model.layers.3.self_attn.qkv_proj": theirs,
        "language_model.model.layers.3.mlp.down_proj": "Sm70GptqLinearMethod"}
    assert set(child["methods"]["float16"].values()) == {theirs, "Sm70GptqLinearMethod"}
    assert child["methods"]["float16"]["mtp.fc"] == theirs


def test_the_method_loads_like_vllm_and_applies_our_int8_linear(child: dict[str, Any]) -> None:
    _vllm(child)
    assert child["weight_loader_v2"]  # vLLM's loaders shard and fuse it as the fp16 method
    assert child["created"] == ["ModelWeightParameter", [96, 256], "torch.float16"]
    app = child["apply"]
    assert app["seen"] == [[[3, 256], "torch.uint8", 128, True]]
    assert app["rel_err"] < 0.01
    assert app["calls"] == {"apply": 1, "rows": 3}
    assert not app["has_weight"]
    assert child["k200"] is not None and "multiple of 128" in child["k200"]
