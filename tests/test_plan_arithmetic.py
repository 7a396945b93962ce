"""Per-item arithmetic of `sm70ctl plan`, pinned against values worked out by hand here.

Each expected value is written as the arithmetic a person does on paper from the model's
shapes (hidden 5120, MLP 17408, 24 query / 4 KV heads of 256, GDN 16 key / 48 value heads of
128, conv kernel 4, vocabulary 248,320) at TP=2; none of the plan's helpers is used to
compute an expectation.
"""

from __future__ import annotations

import pytest

from sm70ctl.plan.model_config import builtin_config_path, load_config
from sm70ctl.plan.plan import Gpu, PlanInputs, compute_plan
from sm70ctl.plan.pools import gdn_page, kv_bytes_per_token_layer

V100 = 34_089_730_048
KIB = 1024


@pytest.fixture(scope="module")
def model():
    return load_config(builtin_config_path())


def _plan(model, gpus=None, **kw):
    gpus = gpus or [Gpu(0, "a", V100), Gpu(1, "b", V100)]
    return compute_plan(model, PlanInputs(**{"path": "target", **kw}), gpus)


def _item(plan, key, gpu=0):
    return next(i.bytes for i in plan.gpus[gpu].items if i.key == key)


def test_kv_int8_per_token_head_is_16_kib_plus_fp32_scales():
    # 2 KV heads per GPU (4 / TP 2), K and V, 256 int8 values + one fp32 scale each
    assert kv_bytes_per_token_layer(2, 256, "int8_per_token_head") == 2 * 2 * (256 + 4)
    # 16 attention layers: 16 KiB of values per token per GPU (FACTS), 256 B of scales
    assert 16 * KIB == 16 * 2 * 2 * 256
    assert 16 * kv_bytes_per_token_layer(2, 256, "int8_per_token_head") == 16 * KIB + 256
    # fp16 cache for comparison: twice the values, no scales
    assert kv_bytes_per_token_layer(2, 256, "auto") == 2 * 2 * 256 * 2


def test_gdn_page_1596_kib_fp32_and_840_kib_int16_with_row_scales():
    # recurrent state: 48 value heads / 2 = 24 heads x 128 x 128
    # conv state: (2 x 2048 + 6144) / 2 = 5120 channels x (kernel 4 - 1 + 3 MTP tokens) x fp16
    conv = 5120 * (4 - 1 + 3) * 2
    assert conv == 60 * KIB
    fp32 = gdn_page(24, 128, 128, 5120, 4, 3, "float32")
    int16 = gdn_page(24, 128, 128, 5120, 4, 3, "int16")
    assert fp32.recurrent == 24 * 128 * 128 * 4 == 1536 * KIB
    # int16 codes plus a float32 scale per value row (the plugin's int16 pool): FACTS' 828 KiB
    # is the reference's page without row scales; ours has 12 KiB of them
    assert int16.recurrent == 24 * 128 * 128 * 2 + 24 * 128 * 4 == 780 * KIB
    assert fp32.total == 1596 * KIB
    assert int16.total == 840 * KIB
    # without speculative decoding the conv state is the 30 KiB
    assert gdn_page(24, 128, 128, 5120, 4, 0, "int16").conv == 5120 * 3 * 2 == 30 * KIB


def test_weights_per_class_by_hand(model):
    p = _plan(model, int8_lm_head=False)
    # embedding: 248,320 / 2 rows x 5120 x fp16
    assert _item(p, "weights.embed") == 124_160 * 5120 * 2 == 1_271_398_400
    assert _item(p, "weights.lm_head") == 1_271_398_400
    # q (with gate) 24 x 256 x 2 / 2 = 6144, k and v 2 x 256 = 512 each; fp16; 16 layers
    assert _item(p, "weights.attn.qkv") == 16 * (6144 + 512 + 512) * 5120 * 2
    # o_proj int8, row-parallel: 3072 inputs (24 groups of 128) x 5120 outputs, in the
    # plugin's layout: qw uint8 [n, k] + sz fp16 [n, k/128, 2] (scale, zero)
    o = 3072 * 5120 + 24 * 5120 * 4
    assert _item(p, "weights.attn.o_proj") == 16 * o
    # MLP: gate and up column-parallel 5120 -> 8704 (40 groups), down row-parallel 8704
    # (68 groups) -> 5120; int8 in layers 1-63, fp16 in layer 0 (quant config exception)
    gate = 5120 * 8704 + 40 * 8704 * 4
    down = 8704 * 5120 + 68 * 5120 * 4
    assert _item(p, "weights.mlp") == 63 * (2 * gate + down) + 3 * 5120 * 8704 * 2
    assert _item(p, "weights.mlp") == 8_953_282_560
    # GDN in_proj: qkv 10240/2 = 5120 and z 6144/2 = 3072 outputs, int8, 47 layers; fp16 layer 0
    qkv = 5120 * 5120 + 40 * 5120 * 4
    z = 5120 * 3072 + 40 * 3072 * 4
    assert _item(p, "weights.gdn.in_proj") == 47 * (qkv + z) + (5120 + 3072) * 5120 * 2
    # in_proj_b and in_proj_a stay fp16 everywhere: 2 x 24 outputs x 5120, 48 layers
    assert _item(p, "weights.gdn.in_proj_ba") == 48 * 2 * 24 * 5120 * 2


def test_int8_lm_head_saves_about_620_mb(model):
    fp16 = _item(_plan(model, int8_lm_head=False), "weights.lm_head")
    int8 = _item(_plan(model, int8_lm_head=True), "weights.lm_head")
    # uint8 codes + one fp16 (scale, zero) per row (the plugin quantises each row whole)
    assert int8 == 124_160 * 5120 + 124_160 * 4 == 636_195_840
    assert fp16 - int8 == 635_202_560  # 635 MB (FACTS: "about 620 MB")


def test_reference_pool_holds_262144_tokens(model):
    p = _plan(model)
    g = p.gpus[0]
    # state slots: 16 seqs x multiplier 8; 48 GDN layers x 840 KiB each
    state = 16 * 8 * 48 * 840 * KIB
    assert _item(p, "pool.state") == state == 5_284_823_040
    kv_region = 10_630_627_328 - state
    assert _item(p, "pool.kv") == kv_region
    # 16 attention layers + the MTP layer, 1040 B each; blocks of 16 tokens
    block = 16 * 17 * 1040
    assert g.layout.kv_blocks == kv_region // block == 18_897
    assert p.longest_sequence == 18_897 * 16 == 302_352
    assert p.fits and p.longest_sequence >= 262_144
    assert g.budget == int(V100 * 0.96) == 32_726_140_846
    # concurrency at 32K: 2048 blocks each, limited by KV (9), not by state slots (16)
    c = p.concurrency(32_768)
    assert c["by_kv"] == 18_897 // 2048 == 9 and c["sequences"] == 9 and c["by_state"] == 16


def test_overflow_names_kv_pool_and_shortfall(model):
    p = _plan(model, max_model_len=1_048_576)
    assert not p.fits
    ov = p.overflow
    assert ov.item == "KV cache pool"
    need = (1_048_576 // 16) * 16 * 17 * 1040
    assert ov.by_bytes == need - (10_630_627_328 - 5_284_823_040) == 13_193_019_392
    assert "1,048,576" in ov.message and "13,193,019,392" in ov.message


def test_clef_correction_by_hand(model):
    p = _plan(model, clef=True)
    # r x (rows + cols) per linear on one GPU, fp16, rank 256
    attn = (6144 + 5120) + 2 * (512 + 5120) + (5120 + 3072) + 3 * (8704 + 5120)
    gdn = (5120 + 5120) + (3072 + 5120) + 2 * (24 + 5120) + (5120 + 3072) + 3 * (8704 + 5120)
    # layers 40-63: 6 full-attention (43, 47, ..., 63) and 18 GDN layers: 186 linears
    assert 6 * 7 + 18 * 8 == 186
    detail = next(i.detail for i in p.gpus[0].items if i.key == "clef.correction")
    assert detail["tensor_bytes"] == 256 * 2 * (6 * attn + 18 * gdn) == 944_160_768
    # every shard is a multiple of 256 B at r = 256; the one allocation rounds to 2 MiB
    assert _item(p, "clef.correction") == 451 * (2 << 20) == 945_815_552
    assert _item(p, "clef.head") == 128_000_000 * 2
    assert detail["linears"] == 186


def test_logit_workspaces_by_hand(model):
    p = _plan(model)
    # prompt-logprob chunk: fp16 vocab shard, then full-vocab fp32 logits + log-softmax copy
    assert _item(p, "logits.prompt") == 256 * 124_160 * 2 + 256 * 248_320 * 4 * 2
    # sampler: 16 seqs x (1 + 3 draft) rows; logits, probs and logprobs in fp32
    assert _item(p, "logits.sampler") == 64 * 124_160 * 2 + 64 * 248_320 * 4 * 3
    no_lp = _plan(model, max_logprobs=0)
    assert not any(i.key == "logits.prompt" for i in no_lp.gpus[0].items)
    # MLP activations for a 2048-token chunk: gate|up (2 x 8704) and the product (8704)
    detail = next(i.detail for i in p.gpus[0].items if i.key == "act.layer")
    assert detail["mlp_bytes"] == 2048 * 3 * 8704 * 2
    # decode split-K: 64 splits x 64 rows x 12 heads x (256 fp16 + 2 fp32)
    assert _item(p, "decode.splitk") == 64 * 64 * 12 * (256 * 2 + 2 * 4)


def test_activations_follow_the_batched_token_budget(model):
    # One step can carry SM70_MAX_NUM_BATCHED_TOKENS tokens from several requests, however
    # small the per-prompt chunk: 4096 tokens of gate|up + product, by hand.
    p = _plan(model, max_num_batched_tokens=4096)
    detail = next(i.detail for i in p.gpus[0].items if i.key == "act.layer")
    assert detail["mlp_bytes"] == 4096 * 3 * 8704 * 2
    assert _item(p, "act.residual") > _item(_plan(model), "act.residual")


def test_gpu_budget_overflow_names_first_item(model):
    small = [Gpu(0, "a", 16 << 30), Gpu(1, "b", 16 << 30)]
    p = _plan(model, gpus=small)
    ov = p.overflow
    budget = int((16 << 30) * 0.96)
    running = 0
    for it in p.gpus[0].items:
        running += it.bytes
        if running > budget:
            break
    assert ov.item == it.label and ov.by_bytes == running - budget


def test_pipeline_parallel_splits_layers(model):
    gpus = [Gpu(0, "a", V100), Gpu(1, "b", V100)]
    p = compute_plan(model, PlanInputs(tensor_parallel_size=1, pipeline_parallel_size=2,
                                       path="target"), gpus)
    keys0 = {i.key for i in p.gpus[0].items}
    keys1 = {i.key for i in p.gpus[1].items}
    assert "weights.embed" in keys0 and "weights.embed" not in keys1
    assert "weights.lm_head" in keys1 and "weights.lm_head" not in keys0
    assert "weights.vision" in keys0 and "weights.mtp" in keys1
    # 32 layers each: 8 attention layers (+ MTP on the last stage), 4 KV heads x 260 B x 2
    assert p.gpus[0].layout.kv_bytes_per_token == 8 * 2 * 4 * 260
    assert p.gpus[1].layout.kv_bytes_per_token == 9 * 2 * 4 * 260
    # MLP of 31 int8 layers (TP 1: 40 groups in, 17408 out) + fp16 layer 0 on stage 0
    gate = 5120 * 17408 + 40 * 17408 * 4
    down = 17408 * 5120 + 136 * 5120 * 4
    assert _item(p, "weights.mlp", 0) == 31 * (2 * gate + down) + 3 * 5120 * 17408 * 2
    assert _item(p, "weights.mlp", 1) == 32 * (2 * gate + down)


def test_unified_pool_grows_attention_block(model):
    p = _plan(model, split_pools=False)
    lay = p.gpus[0].layout
    # smallest multiple of 16 tokens whose 1040 B/token page holds an 860,160 B GDN page
    # (int16 codes, their row scales and the conv state)
    assert lay.block_size == 832 and 816 * 1040 < 860_160 <= 832 * 1040
    assert lay.page_bytes == 832 * 1040
    # groups of 17 layers: 1 attention group, ceil(48 / 17) = 3 GDN groups
    pages = 10_630_627_328 // (832 * 1040 * 17)
    assert lay.kv_blocks == pages - 16 * 8 * 3
    assert p.longest_sequence == (pages - 384) * 832
