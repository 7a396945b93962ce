"""sm70_gptq's per-layer decisions (vllm_patch.quantization.rules): the reference checkpoint's
config read in both of its conventions, fused layers, prefix mapping and every refusal."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from fresh_import import loaded_by_import

from vllm_patch.quantization.rules import (
    GptqRules,
    QuantConfigError,
    _dotted_contains,
)

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "sm70ctl" / "data" / "qwen3.8-27b" / "config.json"
L = "language_model.model.layers"

# vLLM layer name -> int8? for the reference checkpoint (layer 3 is full attention).
EXPECTED = {
    f"{L}.3.self_attn.qkv_proj": False,
    f"{L}.3.self_attn.o_proj": True,
    f"{L}.3.mlp.gate_up_proj": True,
    f"{L}.3.mlp.down_proj": True,
    f"{L}.1.linear_attn.in_proj_qkvz": True,
    f"{L}.1.linear_attn.in_proj_ba": False,
    f"{L}.1.linear_attn.out_proj": True,
    f"{L}.1.linear_attn.conv1d": False,
    f"{L}.0.linear_attn.in_proj_qkvz": False,
    f"{L}.0.linear_attn.out_proj": False,
    f"{L}.0.mlp.gate_up_proj": False,
    f"{L}.0.mlp.down_proj": False,
    f"{L}.10.mlp.gate_up_proj": True,
    f"{L}.63.mlp.down_proj": True,
    "visual.blocks.0.attn.qkv": False,
    "visual.merger.linear_fc1": False,
    "mtp.fc": False,
    "mtp.layers.0.self_attn.o_proj": False,
    "mtp.layers.0.mlp.gate_up_proj": False,
}


@pytest.fixture
def qc() -> dict:
    return copy.deepcopy(json.loads(REFERENCE.read_text())["quantization_config"])


def _decisions(config: dict) -> dict[str, bool]:
    rules = GptqRules.from_config(config)
    return {name: rules.scheme_for(name).quantized for name in EXPECTED}


def test_reference_config_decisions(qc):
    assert _decisions(qc) == EXPECTED
    rules = GptqRules.from_config(qc)
    s = rules.scheme_for(f"{L}.3.self_attn.o_proj")
    assert (s.bits, s.group_size, s.sym, s.desc_act) == (8, 128, False, False)
    assert rules.zero_offset == 1  # checkpoint_format "gptq" stores zero - 1


def test_modules_to_not_convert_alone_gives_the_same_answer(qc):
    # Checkpoint (HF, unfused) names only: mapped to vLLM prefixes and expanded for fused layers.
    qc.pop("dynamic")
    assert _decisions(qc) == EXPECTED


def test_dynamic_alone_gives_the_same_answer(qc):
    qc.pop("modules_to_not_convert")
    assert _decisions(qc) == EXPECTED


def test_dynamic_written_for_checkpoint_names_still_matches(qc):
    qc.pop("modules_to_not_convert")
    qc["dynamic"] = {
        r"-:model\.language_model\.layers\.\d+\.self_attn\.(q|k|v)_proj$": {},
        r"-:.*in_proj_(a|b)$": {},
        r"-:model\.language_model\.layers\.0\.(mlp|linear_attn)\.": {},
        r"-:model\.visual\.": {},
        r"-:mtp\.": {},
    }
    assert _decisions(qc) == EXPECTED


def test_without_any_rule_everything_but_vision_and_conv_is_int8(qc):
    qc.pop("dynamic")
    qc.pop("modules_to_not_convert")
    got = _decisions(qc)
    assert got[f"{L}.3.self_attn.qkv_proj"] and got["mtp.fc"]
    assert not got["visual.blocks.0.attn.qkv"] and not got[f"{L}.1.linear_attn.conv1d"]


def test_shards_that_disagree_are_refused_naming_the_layer(qc):
    # The "!!!!!!" checkpoint: only q_proj kept 16-bit, k/v quantized, fused into one layer.
    qc.pop("dynamic")
    qc["modules_to_not_convert"] = ["self_attn.q_proj", "model.visual"]
    rules = GptqRules.from_config(qc)
    with pytest.raises(QuantConfigError, match=r"layer language_model\.model\.layers\.3\.self_attn"
                       r"\.qkv_proj: its shards disagree.*q_proj is fp16.*k_proj is int8"):
        rules.scheme_for(f"{L}.3.self_attn.qkv_proj")
    assert rules.scheme_for(f"{L}.3.self_attn.o_proj").quantized  # other layers are fine


def test_in_proj_ba_half_kept_is_refused(qc):
    qc.pop("dynamic")
    qc["modules_to_not_convert"] = ["linear_attn.in_proj_b"]
    with pytest.raises(QuantConfigError, match=r"layers\.1\.linear_attn\.in_proj_ba"):
        GptqRules.from_config(qc).scheme_for(f"{L}.1.linear_attn.in_proj_ba")


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("bits", 4, r"layer .*o_proj: bits=4 .*serves bits=8 only"),
        ("group_size", 64, r"layer .*o_proj: group_size=64 .*group_size=128 only"),
        ("group_size", -1, r"group_size=-1"),
        ("desc_act", True, r"layer .*o_proj: desc_act=true"),
    ],
)
def test_unservable_global_settings_are_refused(qc, key, value, pattern):
    qc[key] = value
    rules = GptqRules.from_config(qc)
    with pytest.raises(QuantConfigError, match=pattern):
        rules.scheme_for(f"{L}.3.self_attn.o_proj")
    # layers kept fp16 do not care about the int8 settings
    assert not rules.scheme_for(f"{L}.3.self_attn.qkv_proj").quantized


def test_positive_dynamic_override_is_checked_per_layer(qc):
    qc["dynamic"] = {r"+:.*\.mlp\.down_proj$": {"bits": 4}, **qc["dynamic"]}
    rules = GptqRules.from_config(qc)
    with pytest.raises(QuantConfigError, match=r"layers\.5\.mlp\.down_proj: bits=4 \(dynamic"):
        rules.scheme_for(f"{L}.5.mlp.down_proj")
    assert rules.scheme_for(f"{L}.5.mlp.gate_up_proj").bits == 8


def test_first_dynamic_rule_wins(qc):
    qc.pop("modules_to_not_convert")
    qc["dynamic"] = {r"+:.*o_proj$": {"group_size": 128}, r"-:.*o_proj$": {}}
    assert GptqRules.from_config(qc).scheme_for(f"{L}.3.self_attn.o_proj").quantized
    qc["dynamic"] = {r"-:.*o_proj$": {}, r"+:.*o_proj$": {"group_size": 128}}
    assert not GptqRules.from_config(qc).scheme_for(f"{L}.3.self_attn.o_proj").quantized


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"bits": None}, r"quantization_config\.bits is missing"),
        ({"bits": "8"}, r"quantization_config\.bits must be an integer"),
        ({"sym": "no"}, r"quantization_config\.sym must be true or false"),
        ({"quant_method": "awq"}, r"quant_method is 'awq'"),
        ({"checkpoint_format": "marlin"}, r"checkpoint_format is 'marlin'"),
        ({"dynamic": {"-:(open": {}}}, r"dynamic rule '-:\(open' is not a regular expression"),
        ({"dynamic": ["x"]}, r"dynamic must be an object"),
        ({"modules_to_not_convert": "lm_head"}, r"modules_to_not_convert must be a list"),
    ],
)
def test_bad_config_values_are_one_line_errors(qc, change, pattern):
    qc.update(change)
    with pytest.raises(QuantConfigError, match=pattern) as info:
        GptqRules.from_config(qc)
    assert "\n" not in str(info.value)


def test_quantized_lm_head_is_refused(qc):
    qc["lm_head"] = True
    with pytest.raises(QuantConfigError, match="lm_head is true"):
        GptqRules.from_config(qc).lm_head_scheme()
    qc["lm_head"] = False
    assert not GptqRules.from_config(qc).lm_head_scheme().quantized


def test_gptq_v2_has_no_zero_offset(qc):
    qc["checkpoint_format"] = "gptq_v2"
    assert GptqRules.from_config(qc).zero_offset == 0


def test_prefix_mapping_round_trips(qc):
    rules = GptqRules.from_config(qc)
    for hf, vl in [
        ("model.language_model.layers.7.mlp.up_proj", f"{L}.7.mlp.up_proj"),
        ("model.visual.blocks.0.attn.qkv", "visual.blocks.0.attn.qkv"),
        ("lm_head", "lm_head"),  # no trailing dot: not the "lm_head." prefix
        ("mtp.fc", "mtp.fc"),
    ]:
        assert rules.to_vllm(hf) == vl
        assert rules.to_hf(vl) == hf


def test_model_mappings_extend_the_defaults(qc):
    rules = GptqRules.from_config(qc).with_mappings(
        prefixes={"model.": "backbone."}, fused={"wqkv": ["wq", "wk", "wv"]}
    )
    assert rules.to_vllm("model.layers.1.x") == "backbone.layers.1.x"
    assert rules.to_vllm("model.language_model.layers.1.x") == f"{L}.1.x"  # longest prefix
    assert rules.shards("backbone.layers.1.attn.wqkv") == [
        "backbone.layers.1.attn.wq", "backbone.layers.1.attn.wk", "backbone.layers.1.attn.wv"]


def test_fused_layers_expand_to_their_checkpoint_shards(qc):
    rules = GptqRules.from_config(qc)
    assert rules.shards(f"{L}.2.linear_attn.in_proj_qkvz") == [
        f"{L}.2.linear_attn.in_proj_qkv", f"{L}.2.linear_attn.in_proj_z"]
    assert rules.shards(f"{L}.2.mlp.gate_up_proj") == [
        f"{L}.2.mlp.gate_proj", f"{L}.2.mlp.up_proj"]
    assert rules.shards(f"{L}.2.linear_attn.out_proj") == [f"{L}.2.linear_attn.out_proj"]


def test_dotted_contains_respects_component_boundaries():
    assert _dotted_contains(f"{L}.1.mlp.gate_proj", "layers.1.mlp")
    assert not _dotted_contains(f"{L}.10.mlp.gate_proj", "layers.1.mlp")
    assert _dotted_contains("language_model.lm_head", "lm_head")
    assert not _dotted_contains("model.language_model.lm_head_extra", "lm_head")


def test_rules_module_imports_neither_torch_nor_vllm():
    assert loaded_by_import("vllm_patch.quantization.rules, vllm_patch.quantization",
                            ("torch", "vllm")) == []
