"""The harness decides which tensors to quantize by its own regex (make_checkpoint.KEEP_FP16);
the plugin decides per vLLM layer from the checkpoint's quantization_config. They must agree
on every layer of the real 64-layer layout, or the int8 copy would not load (CPU, no torch)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_checkpoint import KEEP_FP16, LINEAR, reference_quant_config

from vllm_patch.quantization.rules import GptqRules

GDN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
FUSED_OF = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
            "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
            "in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz",
            "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba"}


def _names(layers: int = 64) -> list[str]:
    out = []
    for i in range(layers):
        full = (i + 1) % 4 == 0
        mixer = ("self_attn", ATTN) if full else ("linear_attn", GDN)
        out += [f"model.language_model.layers.{i}.{mixer[0]}.{p}.weight" for p in mixer[1]]
        out += [f"model.language_model.layers.{i}.mlp.{p}.weight" for p in MLP]
    return out


def test_harness_regex_and_plugin_rules_agree_on_every_layer():
    rules = GptqRules.from_config(reference_quant_config())
    names = _names()
    assert all(LINEAR.match(n) for n in names)
    disagree = []
    for name in names:
        module = name.removesuffix(".weight")
        proj = module.rsplit(".", 1)[1]
        fused = module.rsplit(".", 1)[0] + "." + FUSED_OF.get(proj, proj)
        harness_int8 = not KEEP_FP16.search(name)
        plugin_int8 = rules.scheme_for(rules.to_vllm(fused)).quantized
        if harness_int8 != plugin_int8:
            disagree.append((name, harness_int8, plugin_int8))
    assert disagree == []
    int8 = [n for n in names if not KEEP_FP16.search(n)]
    # 47 GDN layers x 3 + 16 full-attention layers x 1, plus the MLPs of layers 1-63
    assert len(int8) == 47 * 3 + 16 + 63 * 3
