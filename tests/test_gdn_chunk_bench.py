"""The pure pieces of bench/bench_gdn_chunk.py: the FLOP count, the table, argument rules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_gdn_chunk  # noqa: E402


def test_chunk_flops_counts_each_product_per_chunk_and_head():
    # one full chunk, one head: K K^T, Q K^T, T K (64 x 64 x 128), T V, P V' (64 x 64 x 128),
    # W H, Q H, K^T V' (64 x 128 x 128), 2 FLOPs each, plus the 64^3 / 3 solve
    one = 2 * 64 * 64 * 128 * 5 + 2 * 64 * 128 * 128 * 3 + 64**3 // 3
    assert bench_gdn_chunk.chunk_flops([64], 1) == one
    assert bench_gdn_chunk.chunk_flops([128], 48) == 2 * 48 * one
    # a partial chunk counts its own length, not 64
    tail = 2 * 10 * 10 * 128 * 5 + 2 * 10 * 128 * 128 * 3 + 10**3 // 3
    assert bench_gdn_chunk.chunk_flops([74], 1) == one + tail
    assert bench_gdn_chunk.chunk_flops([64, 10], 2) == 2 * (one + tail)
    assert bench_gdn_chunk.chunk_flops([0], 48) == 0


def test_markdown_rows():
    text = bench_gdn_chunk.markdown([
        {"tokens": 8192, "impl": "sm70_volta", "ms": 2.0, "tflops": 30.0,
         "frac_of_m8n8k4_peak": 0.25, "speedup_vs_fla": 1.5},
        {"tokens": 8192, "impl": "fla", "error": "ImportError('x')"},
    ])
    lines = text.strip().splitlines()
    assert len(lines) == 4
    assert "| 8192 | sm70_volta | 2.000 | 30.00 | 25.0 % | 1.50x |" in lines[2]
    assert "ImportError" in lines[3] and "| - |" in lines[3]


def test_bench_main_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_gdn_chunk.main(["--out", "x.json", "--k-heads", "5"])
    assert exc.value.code == 2
    assert "--v-heads 48 must be a multiple of --k-heads 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_gdn_chunk.main(["--out", "x.json", "--tokens", "8k"])
