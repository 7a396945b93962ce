"""bench/bench_attention_decode.py's pure parts: the cases, the bytes a call reads, the
rotating block tables, the row arithmetic, the verdict and the table (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_attention_decode as B


def test_the_cases_cover_every_length_batch_and_row_count() -> None:
    got = B.cases()
    assert len(got) == 12 and len(set(got)) == 12
    assert {c for c, _, _ in got} == {4096, 65536, 262144}
    assert {(b, q) for _, b, q in got} == {(1, 1), (1, 4), (16, 1), (16, 4)}
    assert [c for c, _, _ in got] == sorted(c for c, _, _ in got)
    assert {c for c, _, _ in B.cases(quick=True)} == {4096, 65536}


def test_a_call_reads_whole_blocks_of_260_byte_rows() -> None:
    assert B.blocks_per_seq(4096, 1584) == 3 and B.blocks_per_seq(1584, 1584) == 1
    # 3 blocks of 1584 tokens, 2 KV heads, K and V rows of 256 codes + a 4-byte scale
    assert B.case_bytes(4096, 1, 1584) == 3 * 1584 * 2 * 2 * 260
    assert B.case_bytes(4096, 16, 1584) == 16 * B.case_bytes(4096, 1, 1584)
    with pytest.raises(ValueError, match="must be >= 1"):
        B.blocks_per_seq(0, 16)


def test_each_copy_reads_blocks_no_other_copy_or_sequence_reads() -> None:
    seen: list[int] = []
    for c in range(3):
        t = B.block_tables(4, 5, c)
        assert len(t) == 4 and all(len(r) == 5 for r in t)
        seen += [b for r in t for b in r]
    assert sorted(seen) == list(range(3 * 4 * 5))


def test_triton_threshold_is_its_builders() -> None:
    assert B.triton_threshold(2) == 64 and B.triton_threshold(8) == 16


def test_a_row_from_two_times() -> None:
    r = B.row(4096, 1, 1, 2e-6, 5e-6, 10_000, 3, 1e-3)
    assert r["ours_us"] == pytest.approx(2.0) and r["triton_us"] == pytest.approx(5.0)
    assert r["triton_over_ours"] == pytest.approx(2.5)
    assert r["ours_gbps"] == pytest.approx(5.0) and r["triton_gbps"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="must be > 0"):
        B.row(4096, 1, 1, 0.0, 1e-6, 1, 1, 0.0)


def test_the_verdict_needs_every_case_faster() -> None:
    fast = B.row(4096, 1, 1, 1e-6, 2e-6, 1, 1, 0.0)
    slow = B.row(262144, 16, 4, 3e-6, 2e-6, 1, 1, 0.0)
    assert B.verdict([fast])["ours_faster_everywhere"] is True
    v = B.verdict([fast, slow])
    assert v["ours_faster_everywhere"] is False
    assert v["worst"] == {"context": 262144, "batch": 16, "q_rows": 4,
                          "triton_over_ours": pytest.approx(2 / 3)}
    assert B.verdict([])["ours_faster_everywhere"] is None


def test_the_table_has_a_line_per_row() -> None:
    rows = [B.row(4096, 1, 1, 1e-6, 2e-6, 1000, 1, 0.0), B.row(65536, 16, 4, 1e-5, 3e-5,
                                                                1000, 8, 1e-3)]
    lines = B.table(rows).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[2].count("|") == 10
    assert "| 65536 | 16 | 4 | 8 |" in lines[3] and "3.00" in lines[3]
