"""The tensor-parallel rule of Clef's correction, on the CPU with exact integer matrices.

- Known answers, worked out by hand from vLLM's layouts: in_proj_qkvz splits q, k and v
  each on its own; one KV head at TP=2 is copied to both ranks; row-parallel layers split
  A's columns and keep B whole.
- Properties: column-parallel shards of B cover every output row once (no KV replication)
  and A stays whole; for a row-parallel layer the ranks' partial products sum to the
  unsharded correction, which is what the existing all-reduce computes.
"""

from __future__ import annotations

import json
import random

import pytest
from clef_fixture import REAL_CONFIG, TINY_CONFIG

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.layout import COLUMN, ROW, Correction, corrections
from vllm_patch.clef.model_dims import model_dims
from vllm_patch.clef.sharding import shard, shard_bytes

TINY = {c.stem: c for c in corrections(model_dims(TINY_CONFIG))}
REAL = {c.stem: c for c in corrections(model_dims(json.loads(REAL_CONFIG.read_text())))}


def test_in_proj_qkv_is_split_per_part() -> None:
    # tiny GDN: 2 key heads of 8 (q 16 rows, k 16 rows), 4 value heads of 8 (v 32 rows)
    c = TINY["layers.40.linear_attn.in_proj_qkv"]
    assert c.out_features == 64 and c.parallel == COLUMN
    assert shard(c, 2, 0).b_rows == ((0, 8), (16, 24), (32, 48))
    assert shard(c, 2, 1).b_rows == ((8, 16), (24, 32), (48, 64))
    assert shard(c, 2, 1).a_cols == ((0, 32),)
    assert shard(c, 1, 0).b_rows == ((0, 64),)


def test_one_kv_head_is_copied_to_both_ranks() -> None:
    c = TINY["layers.43.self_attn.k_proj"]
    assert shard(c, 2, 0).b_rows == shard(c, 2, 1).b_rows == ((0, 16),)
    # the real model's 4 KV heads split 2 + 2
    r = REAL["layers.43.self_attn.k_proj"]
    assert shard(r, 2, 1).b_rows == ((512, 1024),)


def test_gated_query_splits_by_whole_heads() -> None:
    # 24 heads, each 256 query rows then 256 gate rows: rank 1 keeps heads 12-23
    r = REAL["layers.43.self_attn.q_proj"]
    assert shard(r, 2, 1).b_rows == ((12 * 512, 24 * 512),)


def test_row_parallel_splits_a_and_keeps_b() -> None:
    r = REAL["layers.40.mlp.down_proj"]
    assert r.parallel == ROW
    assert shard(r, 2, 1).a_cols == ((8704, 17408),)
    assert shard(r, 2, 1).b_rows == ((0, 5120),)
    o = REAL["layers.43.self_attn.o_proj"]
    assert shard(o, 2, 0).a_cols == ((0, 3072),)


def test_real_tp2_bytes_per_layer_kind() -> None:
    # rank 256, fp16: r x (K + N_shard) for column layers, r x (K_shard + N) for row layers
    assert shard_bytes(REAL["layers.40.linear_attn.in_proj_qkv"], 256, 2) == 256 * (5120 + 5120) * 2
    assert shard_bytes(REAL["layers.40.linear_attn.in_proj_b"], 256, 2) == 256 * (5120 + 24) * 2
    assert shard_bytes(REAL["layers.40.linear_attn.out_proj"], 256, 2) == 256 * (3072 + 5120) * 2


@pytest.mark.parametrize("stem", sorted(TINY))
@pytest.mark.parametrize("tp", [1, 2])
def test_column_shards_cover_each_row_once(stem: str, tp: int) -> None:
    c = TINY[stem]
    rows: list[int] = []
    for r in range(tp):
        s = shard(c, tp, r)
        if c.parallel == COLUMN:
            assert s.a_cols == ((0, c.in_features),)
            rows += [i for lo, hi in s.b_rows for i in range(lo, hi)]
        else:
            assert s.b_rows == ((0, c.out_features),)
            rows += [i for lo, hi in s.a_cols for i in range(lo, hi)]
    full = c.out_features if c.parallel == COLUMN else c.in_features
    if stem.endswith(("k_proj", "v_proj")) and tp == 2:  # the one KV head, copied
        assert sorted(rows) == sorted(list(range(full)) * 2)
    else:
        assert sorted(rows) == list(range(full))


def _matmul(x: list[list[int]], y: list[list[int]]) -> list[list[int]]:
    return [[sum(a * b for a, b in zip(row, col, strict=True)) for col in zip(*y, strict=True)]
            for row in x]


def _t(m: list[list[int]]) -> list[list[int]]:
    return [list(r) for r in zip(*m, strict=True)]


def _cols(m: list[list[int]], ranges) -> list[list[int]]:
    return [[row[i] for lo, hi in ranges for i in range(lo, hi)] for row in m]


def _rows(m: list[list[int]], ranges) -> list[list[int]]:
    return [m[i] for lo, hi in ranges for i in range(lo, hi)]


def _correction(c: Correction, rank: int, rng: random.Random):
    a = [[rng.randint(-3, 3) for _ in range(c.in_features)] for _ in range(rank)]
    b = [[rng.randint(-3, 3) for _ in range(rank)] for _ in range(c.out_features)]
    x = [[rng.randint(-3, 3) for _ in range(c.in_features)] for _ in range(3)]
    return x, a, b


@pytest.mark.parametrize("stem", ["layers.40.mlp.down_proj", "layers.43.self_attn.o_proj",
                                  "layers.41.linear_attn.out_proj"])
def test_row_parallel_partial_products_sum_to_the_correction(stem: str) -> None:
    c, rank = TINY[stem], 4
    x, a, b = _correction(c, rank, random.Random(stem))
    want = _matmul(_matmul(x, _t(a)), _t(b))  # y = (x A^T) B^T
    total = [[0] * c.out_features for _ in x]
    for r in range(2):
        s = shard(c, 2, r)
        part = _matmul(_matmul(_cols(x, s.a_cols), _t(_cols(a, s.a_cols))),
                       _t(_rows(b, s.b_rows)))
        total = [[p + q for p, q in zip(u, v, strict=True)] for u, v in zip(total, part,
                                                                              strict=True)]
    assert total == want


@pytest.mark.parametrize("stem", ["layers.40.linear_attn.in_proj_qkv",
                                  "layers.43.self_attn.q_proj", "layers.44.mlp.gate_proj"])
def test_column_parallel_rank_computes_its_output_rows(stem: str) -> None:
    c, rank = TINY[stem], 4
    x, a, b = _correction(c, rank, random.Random(stem))
    want = _matmul(_matmul(x, _t(a)), _t(b))
    for r in range(2):
        s = shard(c, 2, r)
        got = _matmul(_matmul(x, _t(_cols(a, s.a_cols))), _t(_rows(b, s.b_rows)))
        assert got == _cols(want, s.b_rows)


def test_bad_rank_and_indivisible_heads() -> None:
    with pytest.raises(ClefError, match="rank 2 of 2 is not a rank"):
        shard(TINY["layers.40.mlp.up_proj"], 2, 2)
    with pytest.raises(ClefError, match=r"in_proj_qkv \(output features\): 2 heads cannot be "
                                        r"split over TP=4"):
        shard(TINY["layers.40.linear_attn.in_proj_qkv"], 4, 0)


def test_slice_offsets_in_the_fused_output() -> None:
    from vllm_patch.clef.layout import fused_slices
    from vllm_patch.clef.sharding import slice_offsets

    tiny = fused_slices(list(TINY.values()))
    assert slice_offsets(tiny[(40, "linear_attn.in_proj_qkvz")], 2) == [(0, 32), (32, 48)]
    assert slice_offsets(tiny[(43, "self_attn.qkv_proj")], 2) == [(0, 32), (32, 48), (48, 64)]
    real = fused_slices(list(REAL.values()))
    # vLLM's qkv_proj per rank at TP=2: 12 gated heads (6144 rows), 2 + 2 KV heads of 256
    assert slice_offsets(real[(43, "self_attn.qkv_proj")], 2) == [(0, 6144), (6144, 6656),
                                                                   (6656, 7168)]
    assert slice_offsets(real[(40, "mlp.gate_up_proj")], 1) == [(0, 17408), (17408, 34816)]
    assert slice_offsets(real[(40, "linear_attn.in_proj_ba")], 2) == [(0, 24), (24, 48)]
