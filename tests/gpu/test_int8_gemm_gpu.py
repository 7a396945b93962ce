"""sm70 int8 GEMM with the optional low-rank correction (kernels.int8_gemm) against the
float64 reference of the same quantised weights, on a CUDA GPU.

    python -m pytest -q -m gpu tests/gpu/test_int8_gemm_gpu.py

Tolerance rel_err < 3e-3: the kernel dequantises the weights to fp16 (a rounding of each
w = s (q - z)) before fp32-accumulating tensor-core products, plus the fp16 output.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gpu_common import poison, record, rel_err  # noqa: E402

from vllm_patch.ops import kernels  # noqa: E402
from vllm_patch.ops import reference as ref  # noqa: E402

LOWRANK_CASES = [
    # (m, n, k, rank, mask kind)
    (1, 5120, 3072, 0, "none"),
    (37, 5120, 3072, 64, "random"),
    (256, 7168, 5120, 256, "all"),
    (200, 1000, 1024, 16, "nobody"),
    (512, 17408, 5120, 128, "random"),
    (2048, 5120, 8704, 256, "half"),
]


def random_gptq(n: int, k: int, g: int, gen: torch.Generator):
    codes = torch.randint(0, 256, (k, n), dtype=torch.uint8, device="cuda", generator=gen)
    zeros = torch.randint(1, 256, (k // g, n), device="cuda", generator=gen)
    scales = (torch.rand(k // g, n, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
    return ref.pack_gptq_int8(codes, zeros, scales)


@pytest.mark.parametrize("m,n,k,rank,mask_kind", LOWRANK_CASES)
def test_int8_gemm_lowrank(m, n, k, rank, mask_kind):
    gen = torch.Generator(device="cuda").manual_seed(m + n + rank)
    qweight, qzeros, scales = random_gptq(n, k, 128, gen)
    qw, sz = ref.repack_gptq_int8(qweight, qzeros, scales, 128)
    x = torch.randn(m, k, device="cuda", generator=gen).half()
    bias = torch.randn(n, device="cuda", generator=gen).half()
    a = (torch.randn(k, rank, device="cuda", generator=gen) * 0.02).half() if rank else None
    b = (torch.randn(rank, n, device="cuda", generator=gen) * 0.05).half() if rank else None
    mask = {
        "none": None,
        "all": torch.ones(m, dtype=torch.bool, device="cuda"),
        "nobody": torch.zeros(m, dtype=torch.bool, device="cuda"),
        "random": torch.rand(m, device="cuda", generator=gen) < 0.3,
        "half": torch.arange(m, device="cuda") < m // 2,
    }[mask_kind]
    poison(m * n * 2)
    y = kernels.int8_gemm(
        x, qw, sz, 128, bias,
        a.t().contiguous() if a is not None else None,
        b.t().contiguous() if b is not None else None,
        mask,
    )
    w_t = ref.dequant_gptq_int8(qweight, qzeros, scales, 128).t()
    want = ref.lowrank_reference(x.float(), w_t, bias, a, b, mask)
    rel = rel_err(y, want)
    record("int8_gemm_rel_err", rel)
    assert rel < 3e-3
    if a is not None and mask is not None:
        # rows without the correction equal the plain GEMM; rows with it differ from it
        plain = ref.lowrank_reference(x.float(), w_t, bias, None, None, None)
        off = ~mask
        if off.any():
            assert rel_err(y[off], plain[off]) < 3e-3
        if mask.any():
            assert rel_err(plain[mask], want[mask]) > 10 * 3e-3  # the correction is visible


@pytest.mark.parametrize("n,k", [(5120, 3072), (1000, 1024), (17408, 5120)])
def test_gptq_dequant_equals_the_reference_bit_for_bit(n, k):
    # both compute scale * (q - zero) in fp32 and round once to fp16
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    qweight, qzeros, scales = random_gptq(n, k, 128, gen)
    qw, sz = ref.repack_gptq_int8(qweight, qzeros, scales, 128)
    out = torch.full((n, k), float("nan"), dtype=torch.float16, device="cuda")
    got = kernels.gptq_dequant(qw, sz, 128, out)
    assert got.data_ptr() == out.data_ptr()
    want = ref.dequant_repacked(qw, sz, 128).half()
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["native", "sm70"])
@pytest.mark.parametrize("m", [9, 16, 32, 33, 255, 300])
@pytest.mark.parametrize("n", [5120, 40000])
def test_sm70_gptq_rows_above_the_gemv_take_their_instantiations_path(m, n, arch, monkeypatch):
    sm70_gptq = pytest.importorskip("vllm_patch.quantization.sm70_gptq")  # needs vLLM
    # 40,000 x 1,024 x 2 B exceeds a 16 MiB slice: the sliced loop (and its bias slices) runs
    monkeypatch.setattr(sm70_gptq, "DEQUANT_SLICE_BYTES", 16 << 20)
    k = 1024
    gen = torch.Generator(device="cuda").manual_seed(m * n)
    qweight, qzeros, scales = random_gptq(n, k, 128, gen)
    qw, sz = ref.repack_gptq_int8(qweight, qzeros, scales, 128)
    x = torch.randn(m, k, device="cuda", generator=gen).half()
    bias = torch.randn(n, device="cuda", generator=gen).half()
    before = dict(sm70_gptq.CALLS)
    kernels.set_arch_path(arch)
    try:
        y = sm70_gptq._run(x, qw, sz, 128, 8, bias)
    finally:
        kernels.set_arch_path("native")
    volta = arch == "sm70" or torch.cuda.get_device_capability()[0] == 7
    if volta:
        path = "gemm" if m <= sm70_gptq.INT8_GEMM_MAX_ROWS else "dequant_gemm"
    else:
        path = "gemv_chunks" if m <= sm70_gptq.GEMV_CHUNKED_MAX_ROWS else "dequant_gemm"
    assert sm70_gptq.CALLS[path] == before[path] + 1
    w_t = ref.dequant_gptq_int8(qweight, qzeros, scales, 128).t()
    want = ref.lowrank_reference(x.float(), w_t, bias, None, None, None)
    rel = rel_err(y, want)
    record("sm70_gptq_dispatch_rel_err", rel)
    assert y.shape == (m, n) and rel < 3e-3
