"""bench/profile_vllm_ops.py's pure parts (CPU): kernel names to op classes, the split."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[3] / "bench" / "profile_vllm_ops.py"
spec = importlib.util.spec_from_file_location("profile_vllm_ops", PATH)
assert spec is not None and spec.loader is not None
prof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prof)


@pytest.mark.parametrize(("kernel", "cls"), [
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn_chunk"),
    ("recompute_w_u_fwd_kernel", "gdn_chunk"),
    ("solve_tril_64x64_kernel", "gdn_chunk"),
    ("fused_recurrent_gated_delta_rule_fwd_kernel", "gdn_recurrent"),
    ("void sm70::gdn_recurrent_kernel<sm70::arch::Sm70>(sm70::GdnRecurrentParams)",
     "gdn_recurrent"),
    ("_causal_conv1d_update_kernel", "conv1d"),
    ("kernel_unified_attention_2d", "attention"),
    ("reshape_and_cache_kernel_flash", "attention"),
    ("void sm70::kv_int8_write_kernel(...)", "attention"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "linear"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64", "linear"),
    ("void sm70::gptq_gemv_kernel<8, 4>(...)", "linear"),
    ("void sm70::lowrank_gemm_kernel(sm70::LowrankGemmParams)", "linear"),
    ("void vllm::fused_add_rms_norm_kernel<c10::Half, 8>", "norm_gating"),
    ("void vllm::act_and_mul_kernel<c10::Half, &vllm::silu_kernel>", "norm_gating"),
    ("fused_gdn_gating_kernel", "norm_gating"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4>", "sampling"),
    ("void at::native::sbtopk::gatherTopK<float>", "sampling"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
     "other"),
])
def test_kernel_names_map_to_their_op_class(kernel, cls):
    assert prof.classify(kernel) == cls


def test_split_sums_classes_and_keeps_the_largest_kernels():
    times = {"nvjet_a": 60.0, "nvjet_b": 20.0, "kernel_unified_attention_2d": 15.0,
             "memcpy_thing": 5.0}
    s = prof.split(times, top=1)
    assert s["total_us"] == 100.0
    assert s["us"]["linear"] == 80.0 and s["share"]["linear"] == 0.8
    assert s["us"]["attention"] == 15.0 and s["us"]["other"] == 5.0
    assert s["top"]["linear"] == [["nvjet_a", 60.0]]
    assert set(s["us"]) == set(prof.CLASSES)


def test_difference_is_per_step_and_clips_noise():
    d = prof.difference({"a": 50.0, "b": 10.0}, {"a": 10.0, "b": 12.0, "c": 1.0}, steps=4)
    assert d == {"a": 10.0, "b": 0.0, "c": 0.0}
