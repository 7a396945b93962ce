"""bench/decode_cases.py: the decode benches' shapes, byte counts, step sums and targets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import decode_cases as dc

BENCH = Path(__file__).resolve().parents[1] / "bench"


def shape(name: str) -> tuple[int, int]:
    return next((n, k) for nm, n, k in dc.GEMV_SHAPES if nm == name)


def test_gemv_bytes_count_codes_and_one_scale_zero_pair_per_group():
    n, k = shape("qkv_proj")
    assert (n, k) == (7168, 5120)
    assert dc.gemv_group_and_bytes("qkv_proj", n, k) == (128, n * k + n * (k // 128) * 4)
    n, k = shape("lm_head_int8")
    assert dc.gemv_group_and_bytes("lm_head_int8", n, k) == (k, n * k + n * 4)
    assert dc.gemv_moved_bytes("qkv_proj", 7168, 5120, 4) == 37847040 + 4 * 5120 * 2 + 4 * 7168 * 2


def test_kv_bytes_are_k_and_v_rows_plus_fp32_scales_per_kv_head():
    assert dc.kv_bytes(1) == 2 * 2 * (256 + 4)
    assert dc.kv_bytes(65536) == 68157440


def test_decode_step_streams_the_model_int8_weights_once():
    # 16 attention + 48 GDN layers, 64 MLPs and the lm_head: 13.2 GB per GPU at TP = 2
    assert dc.decode_step_weight_bytes() == pytest.approx(13.19e9, rel=1e-3)
    assert sum(dc.STEP_LAUNCHES[s] for s in ("qkv_proj", "gdn_in_proj_qkvz")) == 64
    assert "mtp_fc" not in dc.STEP_LAUNCHES


def gemv_row(name: str, m: int, us: float, **extra: float) -> dict:
    return {"shape": name, "m": m, "us": us, **extra}


def test_decode_step_us_sums_each_shape_times_its_launches_at_one_m():
    rows = [gemv_row(s, 1, 1.0 + i) for i, s in enumerate(dc.STEP_LAUNCHES)]
    rows += [gemv_row(s, 4, 100.0) for s in dc.STEP_LAUNCHES]
    want = sum((1.0 + i) * c for i, c in enumerate(dc.STEP_LAUNCHES.values()))
    assert dc.decode_step_us(rows, 1) == pytest.approx(want)
    assert dc.decode_step_us(rows, 4) == pytest.approx(100.0 * sum(dc.STEP_LAUNCHES.values()))
    assert dc.decode_step_us(rows[1:], 1) is None  # a shape of the step has no row
    assert dc.decode_step_us(rows, 2) is None


def test_decode_step_us_of_the_committed_run():
    result = json.loads((BENCH / "results" / "h200_decode_kernels.json").read_text())
    us = dc.decode_step_us(result["gemv"], 1)
    assert us is not None
    # the M = 1 rows add up to about 4 ms on the H200; a wrong launch count moves it by >= 2 %
    assert 3000 < us < 5000


def test_targets_take_the_worst_large_shape_and_default_long_context():
    gemv = [
        gemv_row("qkv_proj", 1, 1.0, frac_of_copy=0.75, speedup_vs_fp16_linear=1.9),
        gemv_row("gate_up_proj", 1, 1.0, frac_of_copy=0.90, speedup_vs_fp16_linear=1.8),
        gemv_row("o_proj", 1, 1.0, frac_of_copy=0.50, speedup_vs_fp16_linear=1.1),  # not large
        gemv_row("qkv_proj", 4, 1.0, frac_of_copy=0.6, speedup_vs_fp16_linear=1.5),
    ]
    decode = [
        {"context": 4096, "role": "default", "frac_of_copy": 0.05},  # below 64K
        {"context": 65536, "role": "default", "frac_of_copy": 0.56},
        {"context": 262144, "role": "default", "frac_of_copy": 0.77},
        {"context": 262144, "role": "tuning", "frac_of_copy": 0.30},  # not the default split
    ]
    got = dc.targets(gemv, decode)
    assert got == {
        "gemv_m1_large_min_frac_of_copy": 0.75,
        "gemv_m1_large_min_speedup_vs_fp16": 1.8,
        "gemv_m4_large_min_speedup_vs_fp16": 1.5,
        "decode_64k_up_min_frac_of_copy": 0.56,
    }
    assert dc.targets([], [])["decode_64k_up_min_frac_of_copy"] is None


def test_batch_label_and_rotating_copies():
    assert dc.batch_label([262144] + [4096] * 7) == "256K+7x4K"
    assert dc.batch_label([4096, 65536, 4096]) == "4K+64K+4K"
    assert dc.copies_for(1) == 64
    assert dc.copies_for(10**10) == 2
    assert dc.copies_for(64 * 2**20) == 8  # 512 MiB / 64 MiB


def test_render_prints_one_line_per_row_with_its_case_and_figures():
    common = {"gbps": 3000.0, "frac_of_copy": 0.75, "frac_of_same_bytes_stream": 0.9}
    result = {
        "device": "GPU X",
        "copy_gbps": 4000.0,
        "gemv": [
            {
                "shape": "qkv_proj",
                "m": 4,
                "arch_path": "sm70",
                "us": 14.25,
                "fp16_linear_us": 21.0,
                "speedup_vs_fp16_linear": 1.47,
                "v100_floor_us_projected": 42.3,
                **common,
            }
        ],
        "decode": [
            {
                "context": 262144,
                "batch_contexts": [262144] + [4096] * 7,
                "q_rows": 1,
                "splits": 33,
                "arch_path": "native",
                "us": 100.04,
                "v100_floor_us_projected": 336.8,
                **common,
            }
        ],
    }
    lines = dc.render(result).splitlines()
    assert len(lines) == 2 + 2 + 1  # header, columns, two rows, footnote
    assert lines[0].startswith("device: GPU X   copy: 4000 GB/s")
    gemv, attention = lines[2], lines[3]
    assert gemv.split()[:4] == ["gemv", "qkv_proj", "M=4", "sm70"]
    assert gemv.split()[4:] == ["14.2", "3000", "75%", "90%", "21.0", "1.47", "42.3"]
    assert attention.split()[:5] == ["attention", "ctx=256K+7x4K", "q=1", "s=33", "native"]
    assert attention.split()[5:] == ["100.0", "3000", "75%", "90%", "336.8"]
