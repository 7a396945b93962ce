"""Which rows of a batch are Clef's, which path a corrected layer takes, and each vLLM
layer's slices on one rank (vllm_patch.clef.rows; pure, no torch).

Known answers from vLLM's batch layout (request i's rows are query_start_loc[i] ..
query_start_loc[i + 1], padding after the last request) and from the real model's shapes at
TP=2 (docs/clef.md's table: qkv_proj 0-6144, 6144-6656, 6656-7168).
"""

from __future__ import annotations

import json

import pytest
from clef_fixture import REAL_CONFIG, TINY_CONFIG

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.layout import corrections, fused_slices
from vllm_patch.clef.model_dims import model_dims
from vllm_patch.clef.rows import (
    ADDED,
    FUSED,
    PLAIN,
    choose_path,
    clef_token_ranges,
    layer_plan,
    parse_prefix,
    row_mask_bytes,
)

REAL = model_dims(json.loads(REAL_CONFIG.read_text()))
TINY = model_dims(TINY_CONFIG)
P = "language_model.model.layers"


def test_clef_rows_follow_the_request_layout() -> None:
    # requests of 3, 1, 6 and 2 tokens; the 2nd and 3rd are Clef; 4 padded rows
    qsl = [0, 3, 4, 10, 12]
    ranges = clef_token_ranges(qsl, [False, True, True, False], 16)
    assert ranges == ((3, 10),)  # adjacent Clef requests merge
    assert row_mask_bytes(ranges, 16) == bytes([0] * 3 + [1] * 7 + [0] * 6)
    assert clef_token_ranges(qsl, [True, False, True, False], 12) == ((0, 3), (4, 10))
    assert clef_token_ranges(qsl, [False] * 4, 12) == ()
    # a request with no scheduled token this step gives no row
    assert clef_token_ranges([0, 2, 2, 5], [False, True, False], 5) == ()


@pytest.mark.parametrize(("qsl", "flags", "n", "rule"), [
    ([0, 3], [True, False], 3, r"needs requests \+ 1"),
    ([1, 3], [True], 3, "starts at 1, not 0"),
    ([0, 3, 2], [True, True], 3, "decreases at request 1"),
    ([0, 3, 9], [True, True], 8, "9 scheduled tokens exceed its 8 rows"),
])
def test_a_layout_that_is_not_vllms_is_refused(qsl: list[int], flags: list[bool], n: int,
                                               rule: str) -> None:
    with pytest.raises(ClefError, match=rule):
        clef_token_ranges(qsl, flags, n)


@pytest.mark.parametrize(("args", "want"), [
    ((False, 300, 8, True, False), PLAIN),   # a layer Clef does not correct
    ((True, 300, 8, False, False), PLAIN),   # eager, chat-only batch: nothing added
    ((True, 0, 8, True, False), PLAIN),      # no rows
    ((True, 9, 8, True, False), ADDED),      # default: the layer's own kernel, then added
    ((True, 8, 8, True, False), ADDED),
    ((True, 1, 8, False, True), ADDED),      # capture: the mask decides at replay
    ((True, 300, 8, False, True), ADDED),
])
def test_the_path_of_one_call(args: tuple[bool, int, int, bool, bool], want: str) -> None:
    assert choose_path(*args) == want


@pytest.mark.parametrize(("rows", "capturing", "want"), [
    (9, False, FUSED), (300, True, FUSED), (8, False, ADDED), (1, True, ADDED)])
def test_the_fused_mode_puts_the_correction_in_the_gemms_launch(rows: int, capturing: bool,
                                                                want: str) -> None:
    # above the GEMV's rows only; at GEMV sizes the GEMV stays the kernel
    assert choose_path(True, rows, 8, True, capturing, fused=True) == want
    assert choose_path(True, rows, 8, False, False, fused=True) == PLAIN


def test_fp16_layers_add_the_correction_after_their_own_gemm() -> None:
    assert choose_path(True, 300, 8, True, False, quantized=False) == ADDED
    assert choose_path(True, 300, 8, True, False, quantized=False, fused=True) == ADDED
    assert choose_path(True, 300, 8, False, False, quantized=False) == PLAIN


def test_prefixes() -> None:
    assert parse_prefix(f"{P}.40.mlp.gate_up_proj") == (40, "mlp.gate_up_proj")
    assert parse_prefix("model.layers.63.linear_attn.in_proj_ba") == (63, "linear_attn.in_proj_ba")
    assert parse_prefix("mtp.layers.0.mlp.gate_up_proj") is None
    assert parse_prefix("visual.blocks.0.mlp.linear_fc1") is None
    assert parse_prefix("lm_head") is None


def _bounds(prefix: str, tp: int, rank: int) -> list[tuple[int, int]]:
    return [(p.out_lo, p.out_hi) for p in layer_plan(REAL, prefix, tp, rank)]


def test_real_slices_at_tp2() -> None:
    assert _bounds(f"{P}.43.self_attn.qkv_proj", 2, 1) == [(0, 6144), (6144, 6656), (6656, 7168)]
    assert _bounds(f"{P}.40.mlp.gate_up_proj", 2, 0) == [(0, 8704), (8704, 17408)]
    assert _bounds(f"{P}.40.linear_attn.in_proj_qkvz", 2, 0) == [(0, 5120), (5120, 8192)]
    assert _bounds(f"{P}.40.linear_attn.in_proj_ba", 2, 1) == [(0, 24), (24, 48)]
    down = layer_plan(REAL, f"{P}.41.mlp.down_proj", 2, 1)
    assert [(p.a_cols, p.b_rows, p.out_lo, p.out_hi) for p in down] == [
        (((8704, 17408),), ((0, 5120),), 0, 5120)]
    qkvz = layer_plan(REAL, f"{P}.40.linear_attn.in_proj_qkvz", 2, 1)
    # rank 1 keeps the 2nd half of q (2048 rows), of k and of v (6144), then of z
    assert qkvz[0].b_rows == ((1024, 2048), (3072, 4096), (7168, 10240))
    assert qkvz[1].b_rows == ((3072, 6144),)


def test_layers_clef_does_not_correct() -> None:
    assert layer_plan(REAL, f"{P}.39.mlp.gate_up_proj", 2, 0) == ()
    assert layer_plan(REAL, "mtp.layers.0.mlp.gate_up_proj", 2, 0) == ()
    # layer 43 is full attention: it has no GDN projection to correct
    assert layer_plan(REAL, f"{P}.43.linear_attn.in_proj_qkvz", 2, 0) == ()


def test_an_output_size_the_slices_do_not_cover_is_refused() -> None:
    with pytest.raises(ClefError, match=r"layer .*40.mlp.gate_up_proj: 17000 output features "
                                        r"on this rank, .* cover 17408 at TP=2"):
        layer_plan(REAL, f"{P}.40.mlp.gate_up_proj", 2, 0, output_size=17000)


@pytest.mark.parametrize("tp", [1, 2])
def test_every_corrected_layer_is_covered_end_to_end(tp: int) -> None:
    for d in (REAL, TINY):
        for (layer, fused), group in fused_slices(corrections(d)).items():
            for rank in range(tp):
                plans = layer_plan(d, f"{P}.{layer}.{fused}", tp, rank)
                assert [p.correction for p in plans] == group
                edges = [e for p in plans for e in (p.out_lo, p.out_hi)]
                assert edges[0] == 0 and edges == sorted(edges)
                assert all(edges[i] == edges[i + 1] for i in range(1, len(edges) - 1, 2))
