"""Parsing config.json / quantization_config, GPU specs, and a tiny model whose plan scales."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from sm70ctl.errors import Sm70Error, UsageError
from sm70ctl.plan.gpus import V100_32GB_TOTAL, parse_gpus, parse_size, resolve_gpus
from sm70ctl.plan.model_config import builtin_config_path, load_config, parse_config
from sm70ctl.plan.plan import Gpu, PlanInputs, compute_plan

TINY = {
    "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
}
TINY_INPUTS = dict(tensor_parallel_size=1, kv_cache_bytes=0, kv_cache_dtype="auto",
                   spec_method="none", int8_lm_head=False, max_num_seqs=2,
                   state_block_multiplier=1, max_model_len=1024, path="target")


def _item(plan, key, gpu=0):
    return next(i.bytes for i in plan.gpus[gpu].items if i.key == key)


def _tiny(layers=4, **kw):
    cfg = {**TINY, "num_hidden_layers": layers}
    inputs = PlanInputs(**{**TINY_INPUTS, **kw})
    n = inputs.tensor_parallel_size
    return compute_plan(parse_config(cfg), inputs, [Gpu(i, "g", 1 << 30) for i in range(n)])


def test_builtin_config_is_the_reference_model():
    raw = json.loads(builtin_config_path().read_text())
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    m = load_config(builtin_config_path())
    assert (m.hidden_size, m.intermediate_size, m.num_layers) == (5120, 17408, 64)
    assert len(m.full_layers) == 16 and m.full_layers[:2] == (3, 7)
    assert (m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (24, 4, 256)
    assert m.gdn_key_dim == 2048 and m.gdn_value_dim == 6144
    assert m.vocab_size == 248_320 and m.mtp_num_hidden_layers == 1
    assert m.vision is not None and m.vision.depth == 27 and m.vision.out_hidden_size == 5120
    q = m.quant
    assert (q.default.bits, q.default.group_size, q.default.sym, q.default.desc_act) == (
        8, 128, False, False)
    pfx = "model.language_model.layers."
    # q/k/v 16-bit everywhere, under both checkpoint and fused names
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.qkv_proj"):
        assert q.scheme_for(f"{pfx}7.{name}") is None
    assert q.scheme_for(f"{pfx}7.self_attn.o_proj") is not None
    # layer 0 MLP and GDN 16-bit; layer 10's quantised (boundary: 0 is not a prefix of 10)
    assert q.scheme_for(f"{pfx}0.mlp.gate_proj") is None
    assert q.scheme_for(f"{pfx}0.linear_attn.in_proj_qkv") is None
    assert q.scheme_for(f"{pfx}10.mlp.gate_proj") is not None
    assert q.scheme_for(f"{pfx}1.linear_attn.in_proj_ba") is None
    assert q.scheme_for("model.visual.blocks.0.attn.qkv") is None
    assert q.scheme_for("mtp.layers.0.mlp.down_proj") is None


def test_builtin_plan_has_no_fused_name_warnings():
    m = load_config(builtin_config_path())
    p = compute_plan(m, PlanInputs(), [Gpu(0, "a", V100_32GB_TOTAL), Gpu(1, "b", V100_32GB_TOTAL)])
    assert [w for w in p.warnings if not w.startswith("plan path")] == []


def _quantised_tiny(quant: dict) -> object:
    cfg = copy.deepcopy(TINY)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": 128,
                                  "sym": True, "desc_act": False, **quant}
    return parse_config(cfg)


def test_quant_rules_boundaries_and_the_plugin_layout():
    m = _quantised_tiny({
        "modules_to_not_convert": ["model.layers.1.mlp"],
        "dynamic": {"-:.*self_attn\\.(q_proj|k_proj|v_proj|qkv_proj)$": {}},
    })
    q = m.quant
    assert q.scheme_for("model.layers.1.mlp.up_proj") is None
    assert q.scheme_for("model.layers.10.mlp.up_proj").bits == 8
    p = compute_plan(m, PlanInputs(**TINY_INPUTS), [Gpu(0, "g", 1 << 30)])
    # the plugin's resident layout: qw uint8 [n, k] + sz fp16 [n, k/128, 2]
    gate8 = 256 * 512 + 512 * (256 // 128) * 4  # k=256 (hidden), n=512 (MLP)
    down8 = 512 * 256 + 256 * (512 // 128) * 4
    fp16_layer1 = 3 * 256 * 512 * 2  # modules_to_not_convert on a dotted boundary
    assert _item(p, "weights.mlp") == 3 * (2 * gate8 + down8) + fp16_layer1


@pytest.mark.parametrize(("quant", "needle"), [
    # q_proj kept 16-bit by name but k/v not: the fused qkv_proj's shards disagree
    ({"dynamic": {"-:.*self_attn\\.q_proj$": {}}},
     r"layer model\.layers\.3\.self_attn\.qkv_proj: its shards disagree"),
    ({"dynamic": {"+:.*down_proj": {"bits": 4}}},
     r"layer model\.layers\.0\.mlp\.down_proj: bits=4 .*serves bits=8 only"),
    ({"group_size": 64}, r"group_size=64 .*serves group_size=128 only"),
    ({"lm_head": True}, r"lm_head is true"),
])
def test_a_config_the_plugin_refuses_is_refused_by_the_plan(quant, needle):
    m = _quantised_tiny(quant)
    with pytest.raises(Sm70Error, match=needle):
        compute_plan(m, PlanInputs(**TINY_INPUTS), [Gpu(0, "g", 1 << 30)])


@pytest.mark.parametrize("patch,needle", [
    ({"hidden_size": None}, "hidden_size"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding"]}, "unknown kinds"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 5, "group_size": 128}}, "bits"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "awq"),
])
def test_bad_configs_are_named(patch, needle):
    cfg = copy.deepcopy(TINY)
    for k, v in patch.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    with pytest.raises(Sm70Error, match=needle):
        parse_config(cfg)


def test_load_config_errors(tmp_path):
    # the bounded reader's one-line messages (sm70ctl/readers.py), each naming the file
    with pytest.raises(Sm70Error, match=r"missing\.json: cannot read: No such file"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(Sm70Error, match="not valid JSON"):
        load_config(bad)
    bad.write_bytes(b"\xff\xfe{}")
    with pytest.raises(Sm70Error, match="not UTF-8 text"):
        load_config(bad)
    # a weights file given as --config: refused past 16 MiB
    from sm70ctl.plan.model_config import CONFIG_MAX_BYTES

    big = tmp_path / "model.safetensors"
    with big.open("wb") as f:
        f.truncate(CONFIG_MAX_BYTES + 2)
    with pytest.raises(Sm70Error, match=r"model config .*model\.safetensors: .*over the limit "
                                        r"of 16,777,216 bytes"):
        load_config(big)
    # a character device (/dev/zero never ends) is refused before it is read
    with pytest.raises(Sm70Error, match="not a regular file"):
        load_config(Path("/dev/zero"))


def test_tiny_model_by_hand():
    p = _tiny()
    # vocabulary 1000 padded to 1024 (multiple of 64) x hidden 256 x fp16
    assert _item(p, "weights.embed") == 1024 * 256 * 2
    assert _item(p, "weights.lm_head") == 1024 * 256 * 2
    assert _item(p, "weights.mlp") == 4 * 3 * 256 * 512 * 2
    # fp16 KV: 1 attention layer x K,V x 2 heads x 64 x 2 B
    assert p.gpus[0].layout.kv_bytes_per_token == 2 * 2 * 64 * 2
    # GDN page: 4 heads x 32 x 32 int16 + 4 x 32 fp32 row scales + conv 3 x (2*64 + 128)
    # fp16; 3 layers per slot
    page = 4 * 32 * 32 * 2 + 4 * 32 * 4 + 3 * 256 * 2
    assert p.gdn_page.total == page
    assert p.gpus[0].layout.state_bytes_per_slot == 3 * page
    # auto pool: everything the budget leaves
    g = p.gpus[0]
    assert g.layout.pool_bytes == int((1 << 30) * 0.96) - g.fixed_bytes
    assert g.free_bytes == 0 and p.fits


def test_tiny_model_scales_with_layers_and_tp():
    p4, p8 = _tiny(4), _tiny(8)
    assert _item(p8, "weights.mlp") == 2 * _item(p4, "weights.mlp")
    assert _item(p8, "weights.norms") - _item(p4, "weights.norms") == 4 * 2 * 256 * 2 + 2 * 64 * 2
    assert p8.gpus[0].layout.kv_bytes_per_token == 2 * p4.gpus[0].layout.kv_bytes_per_token
    assert p8.gpus[0].layout.state_bytes_per_slot == 2 * p4.gpus[0].layout.state_bytes_per_slot
    assert _item(p8, "pool.state") == 2 * _item(p4, "pool.state")
    t2 = _tiny(4, tensor_parallel_size=2)
    assert len(t2.gpus) == 2
    assert _item(t2, "weights.mlp") * 2 == _item(p4, "weights.mlp")
    assert _item(t2, "weights.embed") * 2 == _item(p4, "weights.embed")
    # KV heads 2 / TP 2 = 1 per GPU; GDN value heads 4 / 2 = 2
    assert t2.gpus[0].layout.kv_bytes_per_token * 2 == p4.gpus[0].layout.kv_bytes_per_token
    assert t2.gdn_page.recurrent * 2 == p4.gdn_page.recurrent


def test_longest_sequence_grows_with_memory():
    small, big = _tiny(), compute_plan(parse_config(TINY), PlanInputs(**TINY_INPUTS),
                                       [Gpu(0, "g", 2 << 30)])
    assert big.longest_sequence > small.longest_sequence > 0


def test_too_few_gpus_and_bad_settings():
    m = parse_config(TINY)
    with pytest.raises(Sm70Error, match="needs 2"):
        compute_plan(m, PlanInputs(**{**TINY_INPUTS, "tensor_parallel_size": 2}),
                     [Gpu(0, "g", 1 << 30)])
    with pytest.raises(Sm70Error, match="SM70_GPU_MEMORY_UTILIZATION"):
        compute_plan(m, PlanInputs(**{**TINY_INPUTS, "gpu_memory_utilization": 1.5}),
                     [Gpu(0, "g", 1 << 30)])
    with pytest.raises(Sm70Error, match="SM70_GDN_STATE_DTYPE"):
        compute_plan(m, PlanInputs(**{**TINY_INPUTS, "gdn_state_dtype": "int4"}),
                     [Gpu(0, "g", 1 << 30)])


def test_from_settings_reads_the_schema():
    from sm70ctl.settings import load_settings

    s = load_settings(environ={"SM70_MAX_NUM_SEQS": "4", "SM70_GDN_STATE_DTYPE": "float32",
                               "SM70_CUDAGRAPH_SIZES": "4,8,12", "SM70_KV_CACHE_BYTES": "8GiB"})
    inp = PlanInputs.from_settings(s, max_model_len=131072, max_num_seqs=None)
    assert inp.max_num_seqs == 4 and inp.gdn_state_dtype == "float32"
    assert inp.cudagraph_sizes == (4, 8, 12) and inp.kv_cache_bytes == 8 << 30
    assert inp.max_model_len == 131072
    defaults = load_settings(environ={})
    # the dataclass defaults are the reference settings; only the folder is the user's
    assert PlanInputs.from_settings(defaults) == PlanInputs(model_dir=defaults.model_dir)


def test_state_pool_larger_than_the_pool_gives_no_negative_counts():
    # SM70_KV_CACHE_BYTES smaller than the state pool: once "longest single sequence:
    # -233,920 tokens" and "-1 sequence(s) at once"
    for split in (True, False):
        p = _tiny(kv_cache_bytes=4096, max_num_seqs=2, split_pools=split)
        assert not p.fits and p.gpus[0].layout.kv_blocks < 0
        assert p.longest_sequence == 0
        c = p.concurrency(1024)
        assert c["by_kv"] == 0 and c["sequences"] == 0


def test_quantization_setting_against_the_checkpoint():
    # SM70_QUANTIZATION was declared a plan input but changed nothing in the plan
    from sm70ctl.settings import load_settings

    gptq = load_config(builtin_config_path())
    fp16 = parse_config(TINY)
    one = [Gpu(0, "g", 1 << 30)]
    inputs = {**TINY_INPUTS}
    assert PlanInputs.from_settings(load_settings({"SM70_QUANTIZATION": "none"})
                                    ).quantization == "none"
    w = compute_plan(fp16, PlanInputs(**inputs), one).warnings
    assert any(x.startswith("SM70_QUANTIZATION=gptq, but the model config has no "
                            "quantization_config") for x in w)
    assert not any("SM70_QUANTIZATION" in x for x in
                   compute_plan(fp16, PlanInputs(**inputs, quantization="none"), one).warnings)
    ref = [Gpu(i, "v", V100_32GB_TOTAL) for i in range(2)]
    assert not any("SM70_QUANTIZATION" in x for x in compute_plan(gptq, PlanInputs(), ref).warnings)
    w = compute_plan(gptq, PlanInputs(quantization="none"), ref).warnings
    assert any(x.startswith("SM70_QUANTIZATION=none, but the model config has a GPTQ") for x in w)


def test_gpu_specs():
    assert [g.total_bytes for g in parse_gpus("2x16GiB")] == [16 << 30] * 2
    assert [g.total_bytes for g in parse_gpus("32GiB,16GB")] == [32 << 30, 16 * 10**9]
    assert parse_gpus("2xv100")[1].total_bytes == 34_089_730_048
    assert parse_size("1.5GiB") == 3 << 29
    for bad in ("2xlots", "0GiB", "x16GiB", ""):
        with pytest.raises(UsageError):
            parse_gpus(bad)
    ref = resolve_gpus(None, 2, None)
    assert ref.source == "reference" and [g.total_bytes for g in ref.gpus] == [V100_32GB_TOTAL] * 2
    nv = resolve_gpus(None, 2, [{"index": 0, "name": "Tesla V100-SXM2-32GB", "total": 7}])
    assert nv.source == "nvml" and nv.gpus[0].total_bytes == 7
    assert resolve_gpus("1x8GiB", 2, [{"index": 0, "name": "x", "total": 7}]).source == "--gpus"


def test_nvml_gpus_follow_sm70_gpus():
    # the plan used NVML's first cards whatever SM70_GPUS named: a host with a small card
    # at index 0 was planned on the wrong GPU
    nvml = [{"index": 0, "name": "small", "uuid": "GPU-aaa", "total": 16 << 30},
            {"index": 1, "name": "V100", "uuid": "GPU-bbb", "total": V100_32GB_TOTAL},
            {"index": 2, "name": "V100", "uuid": "GPU-ccc", "total": V100_32GB_TOTAL}]
    src = resolve_gpus(None, 2, nvml, ["2", "GPU-bbb"])
    assert [(g.index, g.total_bytes) for g in src.gpus] == [(2, V100_32GB_TOTAL),
                                                           (1, V100_32GB_TOTAL)]
    assert "SM70_GPUS=2,GPU-bbb" in src.note
    assert [g.index for g in resolve_gpus(None, 2, nvml).gpus] == [0, 1, 2]
    with pytest.raises(Sm70Error, match=r"SM70_GPUS=1,7: NVML has no GPU '7' \(indices 0..2\)"):
        resolve_gpus(None, 2, nvml, ["1", "7"])
    # --gpus still wins over NVML and SM70_GPUS
    assert resolve_gpus("2x8GiB", 2, nvml, ["7"]).source == "--gpus"


def _nvml_gpus():
    from sm70ctl.plan.gpus import probe_nvml

    return probe_nvml()


@pytest.mark.gpu
@pytest.mark.skipif(_nvml_gpus() is None, reason="needs NVML and a GPU")
def test_nvml_probe_feeds_the_plan():
    nv = _nvml_gpus()
    assert all(int(d["total"]) > (1 << 30) and d["name"] for d in nv)
    assert all(str(d["uuid"]).startswith("GPU-") for d in nv)
    assert resolve_gpus(None, 1, nv, [str(nv[-1]["uuid"])]).gpus[0].index == nv[-1]["index"]
    src = resolve_gpus(None, 1, nv)
    assert src.source == "nvml" and src.gpus[0].total_bytes == nv[0]["total"]
    p = compute_plan(parse_config(TINY), PlanInputs(**TINY_INPUTS), src.gpus[:1])
    assert p.gpus[0].budget == int(nv[0]["total"] * 0.96) and p.fits
