"""The plan's weight bytes are what the sm70 plugin allocates (issue 21 item 4).

- On the shipped Qwen3.8-27B config at TP=2 the plan equals a sum over vLLM's own layers
  (fused names, as vLLM builds them) that asks the plugin's rules module
  (`vllm_patch.quantization.rules`) about every layer and prices it in the plugin's resident
  layout, written here independently of the plan's per-tensor model.
- On the A/B harness's tiny checkpoint (tests/gpu/ab/make_checkpoint.py) the plan equals the
  parameter bytes per dtype that vLLM 0.22.1 held on the H200, stock and ours
  (tests/gpu/ab/results/h200_ab_tiny.json).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sm70ctl.plan.gpus import V100_32GB_TOTAL
from sm70ctl.plan.model_config import builtin_config_path, load_config, parse_config
from sm70ctl.plan.plan import Gpu, PlanInputs, compute_plan
from sm70ctl.plan.shapes import stage_tensors
from sm70ctl.plan.weights import WeightOptions, int8_parts, plugin_rules, tensor_bytes
from vllm_patch.quantization.rules import GptqRules

ROOT = Path(__file__).resolve().parents[1]
AB = ROOT / "tests" / "gpu" / "ab"
GROUP = 128
LINEAR_CLASSES = ("attn.qkv", "attn.o_proj", "gdn.in_proj", "gdn.in_proj_ba", "gdn.out_proj",
                  "mlp")


def _items(plan: Any, gpu: int = 0) -> dict[str, int]:
    return {i.key: i.bytes for i in plan.gpus[gpu].items}


def _layer_bytes(rules: GptqRules, prefix: str, n: int, k: int) -> int:
    """One vLLM linear layer as the plugin stores it: int8 qw + (scale, zero) per group,
    or fp16."""
    if rules.scheme_for(prefix).quantized:
        return n * k + n * (k // GROUP) * 2 * 2
    return n * k * 2


def test_reference_plan_equals_the_plugin_rules_layer_by_layer() -> None:
    raw = json.loads(builtin_config_path().read_text())
    text, tp = raw["text_config"], 2
    rules = GptqRules.from_config(raw["quantization_config"])
    h, inter, hd = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    q_out = text["num_attention_heads"] * hd * 2  # the output gate doubles q
    kv_out = text["num_key_value_heads"] * hd
    kd = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    vd = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    hv = text["linear_num_value_heads"]

    def attention(pfx: str) -> list[tuple[str, int, int]]:
        return [(f"{pfx}self_attn.qkv_proj", (q_out + 2 * kv_out) // tp, h),
                (f"{pfx}self_attn.o_proj", h, text["num_attention_heads"] * hd // tp)]

    def mlp(pfx: str) -> list[tuple[str, int, int]]:
        return [(f"{pfx}mlp.gate_up_proj", 2 * inter // tp, h),
                (f"{pfx}mlp.down_proj", h, inter // tp)]

    layers: list[tuple[str, int, int]] = []
    for i, kind in enumerate(text["layer_types"]):
        pfx = f"language_model.model.layers.{i}."
        if kind == "full_attention":
            layers += attention(pfx)
        else:
            a = f"{pfx}linear_attn."
            layers += [(a + "in_proj_qkvz", (2 * kd + 2 * vd) // tp, h),
                       (a + "in_proj_ba", 2 * hv // tp, h),
                       (a + "out_proj", h, vd // tp)]
        layers += mlp(pfx)
    decoder = sum(_layer_bytes(rules, p, n, k) for p, n, k in layers)
    quantized = [p for p, _n, _k in layers if rules.scheme_for(p).quantized]
    # what FACTS.md says the checkpoint keeps 16-bit: q/k/v, in_proj_ba, layer 0's MLP/GDN
    assert not any(p.endswith(("qkv_proj", "in_proj_ba")) or ".layers.0." in p
                   for p in quantized)
    # 16 qkv_proj, 48 in_proj_ba, and layer 0 (GDN): in_proj_qkvz, out_proj, gate_up, down
    assert len(quantized) == len(layers) - 16 - 48 - 4

    # The MTP drafter's layer and its norms: the checkpoint keeps `mtp` 16-bit, the plugin
    # quantizes its linear layers at load (SM70_DRAFT_HEAD_DTYPE int8, groups of 128).
    mtp = [("mtp.fc", h // tp, 2 * h), *attention("mtp.layers.0."), *mlp("mtp.layers.0.")]
    assert not any(rules.scheme_for(p).quantized for p, _n, _k in mtp)
    norms = (5 * h + 2 * hd) * 2
    mtp_bytes = sum(n * k + n * (k // GROUP) * 2 * 2 for _p, n, k in mtp) + norms

    plan = compute_plan(load_config(builtin_config_path()), PlanInputs(),
                        [Gpu(0, "a", V100_32GB_TOTAL), Gpu(1, "b", V100_32GB_TOTAL)])
    items = _items(plan)
    assert sum(items[f"weights.{c}"] for c in LINEAR_CLASSES) == decoder
    assert items["weights.mtp"] == mtp_bytes
    vocab = 248_320 // tp
    assert items["weights.lm_head"] == vocab * h + vocab * 4  # int8 per row (scale, zero)
    assert items["weights.embed"] == vocab * h * 2
    assert _items(plan, 1) == items  # both TP ranks hold the same
    fp16_draft = compute_plan(load_config(builtin_config_path()),
                              PlanInputs(draft_head_dtype="float16"),
                              [Gpu(0, "a", V100_32GB_TOTAL), Gpu(1, "b", V100_32GB_TOTAL)])
    assert _items(fp16_draft)["weights.mtp"] == sum(n * k * 2 for _p, n, k in mtp) + norms


def test_served_path_counts_only_formats_the_plugin_makes() -> None:
    model = load_config(builtin_config_path())
    gpus = [Gpu(0, "a", V100_32GB_TOTAL), Gpu(1, "b", V100_32GB_TOTAL)]
    served = _items(compute_plan(model, PlanInputs(attn_weights_12bit=True), gpus))
    target = _items(compute_plan(model, PlanInputs(attn_weights_12bit=True, path="target"),
                                 gpus))
    # the int8 draft layer is made on both paths; an int4 one (not served) only on target
    assert served["weights.mtp"] == target["weights.mtp"]
    int4 = _items(compute_plan(model, PlanInputs(draft_head_dtype="int4", path="target"), gpus))
    assert int4["weights.mtp"] < target["weights.mtp"]
    # 12-bit q/k/v is an issue 21 design: fp16 until the plugin does it
    assert served["weights.attn.qkv"] == 16 * 7168 * 5120 * 2
    assert target["weights.attn.qkv"] < served["weights.attn.qkv"]
    # the int8 layers are the plugin's layout on both paths
    assert served["weights.mlp"] == target["weights.mlp"]


def test_int8_layout_bytes_per_weight() -> None:
    parts = int8_parts(5120, 17408, GROUP)
    assert parts == {"qw": 17408 * 5120, "sz": 17408 * 40 * 4}
    assert sum(parts.values()) / (17408 * 5120) == 1 + 4 / GROUP


def test_a_16bit_checkpoint_gets_no_int8_lm_head() -> None:
    raw = json.loads(builtin_config_path().read_text())
    raw.pop("quantization_config")
    plan = compute_plan(parse_config(raw), PlanInputs(quantization="none"),
                        [Gpu(0, "a", V100_32GB_TOTAL), Gpu(1, "b", V100_32GB_TOTAL)])
    # Sm70ParallelLMHead quantises the head only in a model served by sm70_gptq
    assert _items(plan)["weights.lm_head"] == 124_160 * 5120 * 2


def _make_checkpoint() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ab_make_checkpoint",
                                                  AB / "make_checkpoint.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("side", ["stock_eager", "ours_eager"])
def test_tiny_plan_equals_the_bytes_vllm_held_on_the_h200(side: str) -> None:
    measured = json.loads((AB / "results" / "h200_ab_tiny.json").read_text())
    held = measured["sides"][side]["model_summary"]["param_bytes_by_dtype"]
    mk = _make_checkpoint()
    conf = mk.full_config(mk.SHAPES["tiny"])
    ours = side.startswith("ours")
    if ours:  # our side serves the int8 copy, stock the fp16 dequantization
        conf["quantization_config"] = mk.reference_quant_config()
    model = parse_config(conf)
    rules = plugin_rules(model.quant)
    # The harness runs text-only (image and video limits 0: vLLM builds no vision tower),
    # one GPU, and the counted model is the target (a drafter is a model of its own).
    tensors = stage_tensors(model, 1, 1, 0, mtp=False, int8_lm_head=ours, vision=False)
    planned: dict[str, int] = {}
    for t in tensors:
        for dtype, b in tensor_bytes(t, rules, WeightOptions()).by_dtype().items():
            planned[f"torch.{dtype}"] = planned.get(f"torch.{dtype}", 0) + b
    assert planned == held
