"""bench/project_v100_op_mix.py's arithmetic against figures computed by hand and FACTS.md's
"a 250K prefill is about 24.6 PFLOP" (CPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "bench" / "project_v100_op_mix.py"
spec = importlib.util.spec_from_file_location("project_v100_op_mix", PATH)
assert spec is not None and spec.loader is not None
proj = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = proj  # dataclasses look their module up there
spec.loader.exec_module(proj)


def test_linear_weights_of_the_decoder():
    p = proj.linear_params(proj.reference_shape())
    assert p["mlp"] == 64 * 3 * 5120 * 17408
    # q (with its gate) 5120 x 12288, k and v 5120 x 1024 each, o 6144 x 5120
    assert p["full_attention"] == 16 * (5120 * 12288 + 2 * 5120 * 1024 + 6144 * 5120)
    # in_proj_qkv 10240, in_proj_z 6144, in_proj_ba 96 outputs, out_proj 6144 -> 5120
    assert p["gdn"] == 48 * (5120 * 10240 + 5120 * 6144 + 5120 * 96 + 6144 * 5120)
    assert p["lm_head"] == 5120 * 248320


def test_causal_pairs_and_a_250k_prefill_match_the_facts():
    s = proj.reference_shape()
    assert proj.attention_flops(s, 1, 0) == 16 * 4 * 256 * 24  # one query, itself
    assert proj.attention_flops(s, 2, 10) == 16 * 4 * 256 * 24 * (20 + 3)
    r = proj.project(s, 250_000)
    both_gpus = 2 * sum(r["prefill"][k]["flop"] for k in (
        "linear", "attention (Triton, FMA)", "gdn_chunk (Triton, FMA)"))
    assert both_gpus == pytest.approx(24.6e15, rel=0.01)


def test_decode_reads_the_int8_weights_once_per_gpu():
    r = proj.project(proj.reference_shape(), 32768)
    p = proj.linear_params(proj.reference_shape())
    assert r["decode_step_bytes"]["linear (int8 weights)"] == sum(p.values()) / 2
    # 48 layers x 24 value heads per GPU x 128 x 128 fp32, read and written
    assert r["decode_step_bytes"]["gdn_recurrent (fp32 state read + write)"] == (
        48 * 24 * 128 * 128 * 4 * 2)


def test_routing_our_gdn_chunk_replaces_only_the_gdn_term():
    r = proj.project(proj.reference_shape(), 250_000, gdn_chunk_rate=80e12)
    p, t = r["prefill"], r["prefill_total_s"]
    fla, ours = p["gdn_chunk (Triton, FMA)"]["seconds"], p["gdn_chunk (Volta TC)"]["seconds"]
    assert ours == pytest.approx(p["gdn_chunk (Volta TC)"]["flop"] / 80e12)
    assert t["with_our_gdn_chunk_too"] == pytest.approx(t["with_our_kernels"] - fla + ours)
