"""sm70 GPTQ-int8 GEMV (kernels.gptq_gemv) against the float64 product of the same
quantised weights, on a CUDA GPU, through both architecture paths where they differ.

    python -m pytest -q -m gpu tests/gpu/test_gemv_gpu.py

Every output is checked against the error model of the kernel its shape runs
(gpu_common: M = 1 streamed, M = 2..8 tensor cores for N >= 1024 and K, G multiples of 128,
else the classic kernel); vectors of 17+ outputs also keep rel_err < 2e-3. The tensor-core
bound is an fp32-accumulation bound over the biased operands, so a zero point off by one
(an error of s |sum x| per output) or fp16 accumulation (an fp16 rounding of sums of
thousands) exceeds it on every shape, the int8 lm_head layout included; tests/gpu/mutants.py
proves that on mutated kernels.
"""

from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gpu_common import (  # noqa: E402
    arch_paths,
    assert_gemv_within_bound,
    gemv_case,
    gemv_path,
    poison,
    random_repacked,
)

from vllm_patch.ops import kernels  # noqa: E402
from vllm_patch.ops import reference as ref  # noqa: E402

TP = 2
HIDDEN = 5120
# (name, N per GPU, K per GPU) for Qwen3.8-27B at TP=2
SHAPES = [
    ("qkv_proj", 14336 // TP, HIDDEN),
    ("o_proj", HIDDEN, 6144 // TP),
    ("gdn_in_proj_qkvz", (10240 + 6144) // TP, HIDDEN),
    ("gdn_in_proj_ba", 96 // TP, HIDDEN),
    ("gdn_out_proj", HIDDEN, 6144 // TP),
    ("gate_up_proj", 2 * 17408 // TP, HIDDEN),
    ("down_proj", HIDDEN, 17408 // TP),
    ("mtp_fc", HIDDEN, 2 * HIDDEN),
]
LM_HEAD_ROWS = 248320 // TP


@pytest.fixture(params=arch_paths())
def arch(request: pytest.FixtureRequest):
    kernels.set_arch_path(request.param)
    yield request.param
    kernels.set_arch_path("native")


def random_gptq(n: int, k: int, g: int, gen: torch.Generator):
    codes = torch.randint(0, 256, (k, n), dtype=torch.uint8, device="cuda", generator=gen)
    zeros = torch.randint(1, 256, (k // g, n), device="cuda", generator=gen)
    scales = (torch.rand(k // g, n, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
    return ref.pack_gptq_int8(codes, zeros, scales)


def run(case, what=None) -> torch.Tensor:
    m, n = case.want.shape
    poison(m * n * 2)
    y = kernels.gptq_gemv(case.x, case.qw, case.sz, case.g, case.bias)
    assert_gemv_within_bound(y, case, what)
    return y


# ------------------------------------------------------------------ model shapes
@pytest.mark.parametrize("name,n,k", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_gemv_model_shapes(name, n, k, m, arch):
    """Each per-GPU shape from the GPTQ checkpoint form (the repack is checked too)."""
    if m == 1 and arch != "native":
        pytest.skip("M = 1 runs no tensor cores: one path")
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{name}/{m}".encode()))
    qweight, qzeros, scales = random_gptq(n, k, 128, gen)
    qw, sz = ref.repack_gptq_int8(qweight, qzeros, scales, 128)
    w = ref.dequant_gptq_int8(qweight, qzeros, scales, 128)  # [K, N]
    assert torch.equal(ref.dequant_repacked(qw, sz, 128), w.t())
    x = torch.randn(m, k, device="cuda", generator=gen).half()
    bias = torch.randn(n, device="cuda", generator=gen).half() if m % 2 == 0 else None
    run(gemv_case(x, qw, sz, 128, bias), (name, m))


# ------------------------------------------------------------------ lm_head (int8, G = K)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_gemv_lm_head_full_vocab_slice(m, arch):
    """The int8 lm_head layout (per-row symmetric, zero 128, G = K) on the full per-GPU
    vocabulary slice: the layout where the old tensor-core bound was loosest."""
    if m == 1 and arch != "native":
        pytest.skip("M = 1 runs no tensor cores: one path")
    gen = torch.Generator(device="cuda").manual_seed(7 + m)
    w = (torch.randn(LM_HEAD_ROWS, HIDDEN, device="cuda", generator=gen) * 0.02).half()
    qw, sz, g = ref.quantize_lm_head_int8(w)
    x = torch.randn(m, HIDDEN, device="cuda", generator=gen).half()
    case = gemv_case(x, qw, sz, g)
    assert case.path == ("stream" if m == 1 else "tensor_core")
    run(case, m)
    del w, qw, sz, case
    torch.cuda.empty_cache()


# ------------------------------------------------------------------ edges
@pytest.mark.parametrize("n", [1, 3, 17, 130])
def test_gemv_small_n_and_k_tails(n):
    """Odd N (partial row sets), one group, K tails (128, 384 and 1152 are not multiples of
    a warp's 512-code step; 2048 is, as a control), G = 16 where K % 128 != 0; M = 1
    streams, M = 2 and 5 take the classic kernel (N < 1024)."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    for k in (128, 384, 1152, 2048, 2064 - 16):
        g = 16 if k % 128 else 128
        qw, sz = random_repacked(n, k, g, gen)
        for m in (1, 2, 5):
            x = torch.randn(m, k, device="cuda", generator=gen).half()
            bias = torch.randn(n, device="cuda", generator=gen).half()
            run(gemv_case(x, qw, sz, g, bias), (k, m))


def test_gemv_tensor_core_edges(arch):
    """N just past the tensor-core minimum and not a multiple of the row tile (1025, 1031),
    one unit (K = 128), units not a multiple of the warps per tile (K = 384, 1152), groups of
    256 and G = K, every M = 2..8, with and without bias; 1024 rows with K % 128 != 0 go
    classic."""
    gen = torch.Generator(device="cuda").manual_seed(300)
    for n, k, g in [(1025, 128, 128), (1031, 384, 128), (1025, 1280, 256), (1031, 1152, 1152),
                    (4099, HIDDEN, HIDDEN), (1024, 1040, 16)]:
        qw, sz = random_repacked(n, k, g, gen)
        for m in range(2, 9):
            x = torch.randn(m, k, device="cuda", generator=gen).half()
            bias = torch.randn(n, device="cuda", generator=gen).half() if m % 3 else None
            case = gemv_case(x, qw, sz, g, bias)
            assert case.path == ("classic" if k % 128 else "tensor_core")
            run(case, (n, k, g, m))


def test_gemv_m1_k_split_tail_and_split_rows():
    """M = 1 grids: more than one wave with a remainder (gate_up-like: K-split blocks close
    the grid), few rows with a long K (the warps split K), and one row."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    for n, k in ((17408, HIDDEN), (17408 + 8, HIDDEN), (48, 8192), (1, 24576 + 512)):
        qw, sz = random_repacked(n, k, 128, gen)
        x = torch.randn(1, k, device="cuda", generator=gen).half()
        for bias in (None, torch.randn(n, device="cuda", generator=gen).half()):
            run(gemv_case(x, qw, sz, 128, bias), (n, k, bias is None))


def test_gemv_paths_agree_on_one_input():
    """The same weights through M = 1 and through M = 2..8 (whose rows 1.. are zero): the
    first row of every result is the same answer within the bounds, and the zero rows
    (plus bias) equal the bias exactly."""
    gen = torch.Generator(device="cuda").manual_seed(99)
    n, k = 7168, HIDDEN
    qw, sz = random_repacked(n, k, 128, gen)
    x1 = torch.randn(1, k, device="cuda", generator=gen).half()
    bias = torch.randn(n, device="cuda", generator=gen).half()
    one = run(gemv_case(x1, qw, sz, 128, bias))
    for m in (2, 4, 8):
        xm = torch.zeros(m, k, device="cuda").half()
        xm[0] = x1[0]
        case = gemv_case(xm, qw, sz, 128, bias)
        assert gemv_path(m, n, k, 128) == "tensor_core"
        y = run(case, m)
        assert torch.equal(y[1:], bias.expand(m - 1, n))
        both = case.bound()[0] + gemv_case(x1, qw, sz, 128, bias).bound()[0]
        assert bool(((y[0].double() - one[0].double()).abs() <= both).all()), m


def test_gemv_in_a_cuda_graph():
    """Captured M = 1 and M = 4 calls replay with new inputs (no host state baked in)."""
    gen = torch.Generator(device="cuda").manual_seed(4242)
    qw, sz = random_repacked(7168, HIDDEN, 128, gen)
    x1 = torch.zeros(1, HIDDEN, device="cuda").half()
    x4 = torch.zeros(4, HIDDEN, device="cuda").half()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.gptq_gemv(x1, qw, sz, 128)
        kernels.gptq_gemv(x4, qw, sz, 128)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1 = kernels.gptq_gemv(x1, qw, sz, 128)
        y4 = kernels.gptq_gemv(x4, qw, sz, 128)
    for _ in range(2):
        x1.copy_(torch.randn(1, HIDDEN, device="cuda", generator=gen).half())
        x4.copy_(torch.randn(4, HIDDEN, device="cuda", generator=gen).half())
        graph.replay()
        torch.cuda.synchronize()
        assert_gemv_within_bound(y1, gemv_case(x1, qw, sz, 128))
        assert_gemv_within_bound(y4, gemv_case(x4, qw, sz, 128))
