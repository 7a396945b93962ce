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


def test_split_lengths():
    assert bench_gdn_chunk.split_lengths(8192, 4) == [2048] * 4
    assert bench_gdn_chunk.split_lengths(10, 4) == [3, 3, 2, 2]
    assert bench_gdn_chunk.split_lengths(5, 1) == [5]
    with pytest.raises(ValueError, match="cannot split 3 tokens into 4"):
        bench_gdn_chunk.split_lengths(3, 4)


def test_markdown_rows():
    text = bench_gdn_chunk.markdown([
        {"tokens": 8192, "impl": "sm70_volta", "ms": 2.0, "tflops": 30.0,
         "frac_of_m8n8k4_peak": 0.25, "speedup_vs_fla": 1.5},
        {"tokens": 8192, "impl": "fla", "error": "ImportError('x')"},
    ])
    lines = text.strip().splitlines()
    assert len(lines) == 4
    assert "| 8192 | 1 | sm70_volta | 2.000 | 30.00 | 25.0 % | 1.50x |" in lines[2]
    assert "ImportError" in lines[3] and "| - |" in lines[3]


def test_bench_main_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_gdn_chunk.main(["--out", "x.json", "--k-heads", "5"])
    assert exc.value.code == 2
    assert "--v-heads 48 must be a multiple of --k-heads 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_gdn_chunk.main(["--out", "x.json", "--tokens", "8k"])
    with pytest.raises(SystemExit):
        bench_gdn_chunk.main(["--out", "x.json", "--tokens", "2", "--seqs", "4"])
    assert "cannot split 2 tokens into 4" in capsys.readouterr().err


def test_device_script_reads_the_bench_and_error_log(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    sys.path.insert(0, str(ROOT / "tests" / "gpu" / "gdn_chunk"))
    import device_gdn_chunk as dev
    import ops_job

    bench = {"peak_tflops": {"m8n8k4": 100.0}, "errors": [], "rows": [
        {"tokens": 8192, "seqs": 1, "impl": "sm70_volta", "ms": 2.0, "tflops": 5.0,
         "frac_of_m8n8k4_peak": 0.05, "speedup_vs_fla": 0.5},
        {"tokens": 8192, "seqs": 4, "impl": "sm70_volta", "error": "RuntimeError('x')"},
        {"tokens": 32768, "seqs": 4, "impl": "sm70_volta", "ms": 4.0},
    ]}
    fig = dev.bench_figures(bench)
    assert fig["by_tokens"]["8192x1"]["volta_frac_of_m8n8k4_peak"] == 0.05
    assert fig["by_tokens"]["8192x1"]["sm70_volta_speedup_vs_fla"] == 0.5
    assert "RuntimeError" in fig["by_tokens"]["8192x4"]["sm70_volta_error"]
    assert ops_job.volta_rows_ok(bench, [8192]) and not ops_job.volta_rows_ok(bench, [8192, 32768])
    log = tmp_path / "e.jsonl"
    log.write_text('{"metric": "a", "value": 0.5}\n{"metric": "a", "value": 0.25}\nnot json\n'
                   '{"metric": "b", "value": 2}\n')
    assert ops_job.error_maxima(log) == {"a": 0.5, "b": 2.0}
    assert ops_job.error_maxima(tmp_path / "missing.jsonl") == {}
