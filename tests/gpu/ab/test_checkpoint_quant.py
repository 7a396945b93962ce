"""The numbers under the A/B, on CPU torch: the int8 and fp16 checkpoints hold the same
weights, and the sliced load-time conversions equal the references byte for byte.
Skipped where torch is absent (the dev venv); runs wherever torch is (GPU machine, a CPU
torch venv)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_checkpoint import GROUP, lm_head_on_int8_grid, quantize_gptq  # noqa: E402

from vllm_patch.ops.reference import (  # noqa: E402
    dequant_gptq_int8,
    dequant_repacked,
    quantize_lm_head_int8,
    repack_gptq_int8,
)
from vllm_patch.quantization.repack import (  # noqa: E402
    quantize_lm_head_sliced,
    repack_gptq_sliced,
)


def _weights(n: int = 96, k: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    offset = (torch.rand(n, k // GROUP, 1, generator=g) - 0.5) * 0.02
    return w + offset.expand(n, k // GROUP, GROUP).reshape(n, k)


def test_int8_and_fp16_copies_hold_the_same_weights():
    w = _weights()
    qweight, qzeros, scales, g_idx, deq = quantize_gptq(w)
    assert qweight.dtype == torch.int32 and qweight.shape == (512 // 4, 96)
    assert qzeros.shape == (512 // GROUP, 96 // 4) and scales.shape == (512 // GROUP, 96)
    assert torch.equal(g_idx, torch.arange(512, dtype=torch.int32) // GROUP)
    # what a GPTQ reader (vLLM, ours) dequantizes is exactly the fp16 copy
    again = dequant_gptq_int8(qweight, qzeros, scales, GROUP, 1).t()
    assert torch.equal(again.half(), deq)
    # and it is w up to half a quantization step
    step = scales.float().t().repeat_interleave(GROUP, dim=1)
    assert ((deq.float() - w).abs() <= step * 0.5 + 1e-4).all()
    # asymmetric: the zeros vary (a symmetric-only reader would be wrong here)
    zeros = repack_gptq_int8(qweight, qzeros, scales, GROUP, 1)[1][..., 1]
    assert zeros.min() < 120 and zeros.max() > 136


def test_repack_gives_our_layout_of_the_same_weights():
    w = _weights(seed=1)
    qweight, qzeros, scales, _, deq = quantize_gptq(w)
    qw, sz = repack_gptq_int8(qweight, qzeros, scales, GROUP, 1)
    assert torch.allclose(dequant_repacked(qw, sz, GROUP), deq.float(), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("cols", [4, 32, 40, 4096])
def test_sliced_repack_equals_the_reference(cols):
    qweight, qzeros, scales, _, _ = quantize_gptq(_weights(n=104, seed=2))
    ref = repack_gptq_int8(qweight, qzeros, scales, GROUP, 1)
    got = repack_gptq_sliced(qweight, qzeros, scales, GROUP, 1, cols=cols)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_sliced_repack_refuses_a_slice_that_splits_packed_zeros():
    qweight, qzeros, scales, _, _ = quantize_gptq(_weights())
    with pytest.raises(ValueError, match="multiple of 4"):
        repack_gptq_sliced(qweight, qzeros, scales, GROUP, 1, cols=6)


@pytest.mark.parametrize("rows", [1, 7, 100, 16384])
def test_sliced_lm_head_equals_the_reference(rows):
    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(3)).half()
    ref = quantize_lm_head_int8(w)
    got = quantize_lm_head_sliced(w, rows=rows)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[2] == ref[2]


def test_lm_head_on_the_grid_survives_the_load_time_int8_copy():
    g = torch.Generator().manual_seed(4)
    w = lm_head_on_int8_grid(64, 512, g, torch.device("cpu"))
    qw, sz, group = quantize_lm_head_int8(w)
    back = dequant_repacked(qw, sz, group)
    # only each row's fp16 scale rounds: a relative error of a few 1e-4
    assert torch.allclose(back, w.float(), rtol=2e-3, atol=1e-6)
    assert (qw.int() - 128).abs().max() == 127
