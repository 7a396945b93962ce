"""torch.ops.sm70.* against their plain-PyTorch references, on a CUDA GPU.

Run on the device machine (H200: TORCH_CUDA_ARCH_LIST=9.0; V100: 7.0):
    python -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py
Skips cleanly where torch or a GPU is missing. Tolerances (relative L2 error against a
float32/float64 reference computed from the same quantised data):
  GEMV/GEMM  2e-3  (fp16 output rounding; fp16 dequantised weights in the GEMM: 3e-3);
             per output: the packed-half M = 1 default within u |y| + 2u sum |x w|, the
             tensor-core kernels within u |y| + 2^-14 sum |x| s (|q - z| + 1280)
  attention  5e-3  (fp16 P and output rounding)  and max abs error 2e-2
  KV write   codes equal except rounding ties (<= 1 code on <= 0.1 % of values)
"""

from __future__ import annotations

import math
import zlib

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

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


@pytest.fixture(scope="module", autouse=True)
def _extension():
    from vllm_patch.ops.loader import load_ops

    load_ops()


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out = out.to(torch.float64)
    want = want.to(torch.float64)
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - want).norm() / want.norm().clamp_min(1e-30))


FP16_U = 2.0**-11  # unit roundoff of fp16


def assert_gemv_forward_error(y, x, w, bias, want) -> None:
    """Every output within the forward error bound of fp16-rounded partial sums:
    |y - want| <= u |want| (the fp16 output) + 2 u sum_k |x_k w_kn| (the accumulation).

    The M = 1 default accumulates 4-term partials in half2 before fp32 (docs/kernels.md):
    its error scales with sum |x w|, not with |y|, so an output that nearly cancels has a
    large relative error however good the kernel; this bound is the condition-free check
    (the fp32 kernels meet it with room to spare; measured worst constant 0.28, not 2, in a
    CPU emulation of the half2 arithmetic). Vectors of 17+ outputs also keep the relative
    L2 check.
    """
    mag = (x.double().abs() @ w.double().abs().t()) + (0 if bias is None else bias.double().abs())
    err = (y.double() - want.double()).abs()
    bound = FP16_U * want.double().abs() + 2 * FP16_U * mag
    assert torch.isfinite(y.double()).all(), "non-finite output"
    worst = float((err - bound).max())
    assert worst <= 0, f"forward error exceeds the bound by {worst:.3g}"
    if want.shape[-1] >= 17:
        assert rel_err(y, want) < 2e-3


def poison(nbytes: int) -> None:
    """Leave NaNs in the allocator's cache so an output the op forgets to write fails."""
    t = torch.full((nbytes // 2 + 64,), float("nan"), dtype=torch.float16, device="cuda")
    del t


def random_gptq(n: int, k: int, g: int = 128, gen: torch.Generator | None = None):
    dev = "cuda"
    codes = torch.randint(0, 256, (k, n), dtype=torch.uint8, device=dev, generator=gen)
    zeros = torch.randint(1, 256, (k // g, n), device=dev, generator=gen)
    scales = (torch.rand(k // g, n, device=dev, generator=gen) * 2e-3 + 1e-4).half()
    return ref.pack_gptq_int8(codes, zeros, scales)


# ------------------------------------------------------------------ GEMV
@pytest.mark.parametrize("name,n,k", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_gptq_gemv_model_shapes(name, n, k, m):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{name}/{m}".encode()))
    qweight, qzeros, scales = random_gptq(n, k, gen=gen)
    qw, sz = ref.repack_gptq_int8(qweight, qzeros, scales, 128)
    w = ref.dequant_gptq_int8(qweight, qzeros, scales, 128)  # [K, N] from the checkpoint form
    x = torch.randn(m, k, device="cuda", generator=gen).half()
    bias = torch.randn(n, device="cuda", generator=gen).half() if m % 2 == 0 else None
    poison(m * n * 2)
    y = torch.ops.sm70.gptq_gemv(x, qw, sz, 128, bias)
    want = x.float() @ w + (bias.float() if bias is not None else 0.0)
    assert y.shape == (m, n) and y.dtype == torch.float16
    assert rel_err(y, want) < 2e-3


@pytest.mark.parametrize("m", [1, 3, 5, 6, 7, 8])
def test_gptq_gemv_lm_head_per_row(m):
    gen = torch.Generator(device="cuda").manual_seed(7 + m)
    n = LM_HEAD_ROWS if m in (1, 8) else 4099  # full vocab slice at M=1 and 8
    w = (torch.randn(n, HIDDEN, device="cuda", generator=gen) * 0.02).half()
    qw, sz, g = ref.quantize_lm_head_int8(w)
    x = torch.randn(m, HIDDEN, device="cuda", generator=gen).half()
    poison(m * n * 2)
    y = torch.ops.sm70.gptq_gemv(x, qw, sz, g, None)
    want = x.float() @ ref.dequant_repacked(qw, sz, g).t()
    assert rel_err(y, want) < 2e-3


@pytest.mark.parametrize("n", [1, 3, 17, 130])
def test_gptq_gemv_edges(n):
    """Odd N (partial blocks), one group, K tails (128, 384 and 1152 are not multiples of a
    warp's 512-code step; 2048 is, as a control).

    GPTQ packing needs N % 4 == 0, so odd N uses the repacked layout directly.
    """
    gen = torch.Generator(device="cuda").manual_seed(n)
    for k in (128, 384, 1152, 2064 - 16):
        g = 16 if k % 128 else 128
        qw = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
        sz = torch.empty(n, k // g, 2, device="cuda", dtype=torch.float16)
        sz[..., 0] = (torch.rand(n, k // g, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
        sz[..., 1] = torch.randint(1, 256, (n, k // g), device="cuda", generator=gen).half()
        for m in (1, 2, 5):
            x = torch.randn(m, k, device="cuda", generator=gen).half()
            bias = torch.randn(n, device="cuda", generator=gen).half()
            y = torch.ops.sm70.gptq_gemv(x, qw, sz, g, bias)
            w = ref.dequant_repacked(qw, sz, g)
            want = ref.gemv_reference(x, w, bias)
            assert_gemv_forward_error(y, x, w, bias, want)


@pytest.mark.parametrize("kernel", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13])
@pytest.mark.parametrize("ksplit", [0, 1, 4])
def test_gptq_gemv_every_kernel_and_split(kernel, ksplit):
    """M = 1 through each kernel (classic, streamed U = 1 / 2, stream-K S = 2 / 3, which
    ignore ksplit, streamed with x in shared memory R = 4 / 8, packed-half U = 1 / 2 and
    U = 1 with K-split blocks closing its grid, 12, and the same with 2 rows per warp, 13) and
    K-split mode forced,
    on a model shape, the int8 lm_head layout (G = K), odd N with K tails and a K too long
    for x in shared memory (kernels 6 and 7 fall back to the U = 1 kernel there)."""
    gen = torch.Generator(device="cuda").manual_seed(100 * kernel + ksplit)
    cases = [
        (7168, 5120, 128),
        (4099, HIDDEN, HIDDEN),
        (130, 2064 - 16, 16),
        (3, 384, 128),
        (17, 1152, 128),
        (5120, 8704, 128),
        (9, 24576 + 512, 128),
        (17408, 5120, 128),  # gate_up: kernels 12 and 13 end their grids with K-split blocks
    ]
    for n, k, g in cases:
        qw = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
        sz = torch.empty(n, k // g, 2, device="cuda", dtype=torch.float16)
        sz[..., 0] = (torch.rand(n, k // g, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
        sz[..., 1] = torch.randint(1, 256, (n, k // g), device="cuda", generator=gen).half()
        x = torch.randn(1, k, device="cuda", generator=gen).half()
        for bias in (None, torch.randn(n, device="cuda", generator=gen).half()):
            poison(n * 2)
            y = torch.ops.sm70.gptq_gemv(x, qw, sz, g, bias, ksplit, kernel)
            want = ref.gemv_reference(x, ref.dequant_repacked(qw, sz, g), bias)
            assert rel_err(y, want) < 2e-3, (n, k, g, bias is None)


def test_gptq_gemv_streamed_kernel_takes_one_row():
    x = torch.randn(2, 256, device="cuda").half()
    qw = torch.zeros(8, 256, dtype=torch.uint8, device="cuda")
    sz = torch.ones(8, 2, 2, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="M = 1 only"):
        torch.ops.sm70.gptq_gemv(x, qw, sz, 128, None, 0, 2)


@pytest.mark.parametrize(
    "case,message",
    [
        ("rows", "1 to 8 rows"),
        ("group", "group_size"),
        ("sk-rows", "M = 1 only"),
        ("kernel", "kernel must be"),
        ("tc-k", "multiples of 128"),
    ],
)
def test_gptq_gemv_rejects_bad_input(case, message):
    """Bad shapes and kernel choices raise a clear RuntimeError: 9 rows, a group size that
    does not divide K, stream-K (kernel 4) with M = 2, an unknown kernel id, the tensor-core
    kernel with K % 128 != 0 (in a child: a crash must not end the run)."""
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).with_name("reject_probe.py")
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", str(probe), case],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert message in proc.stdout, proc.stdout


# ------------------------------------------------------------------ GEMV, stream-K (M = 1)
STREAM_K = [4, 5]  # R = 4 rows with S = 2 / 3 pipeline stages


def random_repacked(n: int, k: int, g: int, gen: torch.Generator):
    """Random codes and (scale, zero) in the GEMV layout directly (any N, any K % g == 0)."""
    qw = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
    sz = torch.empty(n, k // g, 2, device="cuda", dtype=torch.float16)
    sz[..., 0] = (torch.rand(n, k // g, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
    sz[..., 1] = torch.randint(1, 256, (n, k // g), device="cuda", generator=gen).half()
    return qw, sz


def check_gemv(x, qw, sz, g, bias, kernel, what=None):
    poison(qw.shape[0] * 2)
    y = torch.ops.sm70.gptq_gemv(x, qw, sz, g, bias, 0, kernel)
    assert y.shape == (x.shape[0], qw.shape[0]) and y.dtype == torch.float16
    want = ref.gemv_reference(x, ref.dequant_repacked(qw, sz, g), bias)
    assert rel_err(y, want) < 2e-3, what
    return y


@pytest.mark.parametrize("name,n,k", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("kernel", STREAM_K)
def test_gptq_gemv_stream_k_model_shapes(name, n, k, kernel):
    """Every per-GPU shape, from the GPTQ checkpoint form (so the repack is checked too)."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"sk/{name}/{kernel}".encode()))
    qweight, qzeros, scales = random_gptq(n, k, gen=gen)
    qw, sz = ref.repack_gptq_int8(qweight, qzeros, scales, 128)
    w = ref.dequant_gptq_int8(qweight, qzeros, scales, 128)
    x = torch.randn(1, k, device="cuda", generator=gen).half()
    for bias in (None, torch.randn(n, device="cuda", generator=gen).half()):
        poison(n * 2)
        y = torch.ops.sm70.gptq_gemv(x, qw, sz, 128, bias, 0, kernel)
        want = x.float() @ w + (bias.float() if bias is not None else 0.0)
        assert rel_err(y, want) < 2e-3, bias is None


@pytest.mark.parametrize("kernel", STREAM_K)
def test_gptq_gemv_stream_k_lm_head(kernel):
    """The int8 lm_head layout (G = K: one (scale, zero) per row) on a cut vocabulary."""
    gen = torch.Generator(device="cuda").manual_seed(41 + kernel)
    for n in (4099, 20000):
        w = (torch.randn(n, HIDDEN, device="cuda", generator=gen) * 0.02).half()
        qw, sz, g = ref.quantize_lm_head_int8(w)
        x = torch.randn(1, HIDDEN, device="cuda", generator=gen).half()
        check_gemv(x, qw, sz, g, None, kernel, n)


@pytest.mark.parametrize("kernel", STREAM_K)
@pytest.mark.parametrize("n", [1, 3, 17, 130])
def test_gptq_gemv_stream_k_edges(n, kernel):
    """Odd N (a partial last row set) and K tails: lanes past the last chunk add zeros."""
    gen = torch.Generator(device="cuda").manual_seed(1000 * kernel + n)
    for k in (128, 384, 1040, 1152, 2032):
        g = 16 if k % 128 else 128
        qw, sz = random_repacked(n, k, g, gen)
        x = torch.randn(1, k, device="cuda", generator=gen).half()
        for bias in (None, torch.randn(n, device="cuda", generator=gen).half()):
            check_gemv(x, qw, sz, g, bias, kernel, (k, bias is None))


@pytest.mark.parametrize("kernel", STREAM_K)
def test_gptq_gemv_stream_k_split_row_sets(kernel):
    """N = 8, K = 8192: 2 row sets x 16 steps over 32 warps (every row set joined from 16
    partials); N = 3, K = 128: 1 unit for 4 warps (3 idle); 513 x 4096 in between."""
    gen = torch.Generator(device="cuda").manual_seed(77 + kernel)
    for n, k, g in ((8, 8192, 128), (3, 128, 128), (513, 4096, 64), (64, 16384, 128)):
        qw, sz = random_repacked(n, k, g, gen)
        x = torch.randn(1, k, device="cuda", generator=gen).half()
        bias = torch.randn(n, device="cuda", generator=gen).half()
        check_gemv(x, qw, sz, g, bias, kernel, (n, k))


def test_gptq_gemv_stream_k_workspace_self_cleans():
    """Back-to-back calls share one workspace per stream: a partial sum or step count left
    behind by one call would corrupt the next (same N, different N, both kernels)."""
    gen = torch.Generator(device="cuda").manual_seed(5150)
    shapes = ((8, 8192), (5120, 3072), (130, 1152))
    ops = [(*random_repacked(n, k, 128, gen), n, k) for n, k in shapes]
    seq = [0, 0, 0, 1, 0, 2, 1, 0, 2, 2, 1, 1]
    for i, j in enumerate(seq):
        qw, sz, n, k = ops[j]
        x = torch.randn(1, k, device="cuda", generator=gen).half()
        bias = torch.randn(n, device="cuda", generator=gen).half() if i % 2 else None
        check_gemv(x, qw, sz, 128, bias, STREAM_K[i % 2], (i, n, k))
    # a burst with no host sync in between: results checked only at the end
    xs = [torch.randn(1, 8192, device="cuda", generator=gen).half() for _ in range(8)]
    qw, sz, n, k = ops[0]
    ys = [torch.ops.sm70.gptq_gemv(x, qw, sz, 128, None, 0, 4) for x in xs]
    w_t = ref.dequant_repacked(qw, sz, 128)
    for x, y in zip(xs, ys, strict=True):
        assert rel_err(y, ref.gemv_reference(x, w_t)) < 2e-3


@pytest.mark.parametrize("kernel", STREAM_K)
def test_gptq_gemv_stream_k_cuda_graph(kernel):
    """Two calls captured in a CUDA graph after one warm call on the capturing stream,
    replayed twice with new x: the captured workspace is reused and stays clean."""
    gen = torch.Generator(device="cuda").manual_seed(900 + kernel)
    qa, sa = random_repacked(7168, 5120, 128, gen)
    qb, sb = random_repacked(8, 8192, 128, gen)
    bias = torch.randn(8, device="cuda", generator=gen).half()
    xa = torch.zeros(1, 5120, device="cuda").half()
    xb = torch.zeros(1, 8192, device="cuda").half()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.sm70.gptq_gemv(xa, qa, sa, 128, None, 0, kernel)  # sizes the workspace
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ya = torch.ops.sm70.gptq_gemv(xa, qa, sa, 128, None, 0, kernel)
        yb = torch.ops.sm70.gptq_gemv(xb, qb, sb, 128, bias, 0, kernel)
    wa, wb = ref.dequant_repacked(qa, sa, 128), ref.dequant_repacked(qb, sb, 128)
    for _ in range(2):
        xa.copy_(torch.randn(1, 5120, device="cuda", generator=gen).half())
        xb.copy_(torch.randn(1, 8192, device="cuda", generator=gen).half())
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(ya, ref.gemv_reference(xa, wa)) < 2e-3
        assert rel_err(yb, ref.gemv_reference(xb, wb, bias)) < 2e-3


def test_gptq_gemv_stream_k_graph_without_warm_up():
    """torch's usual pattern: warm up on a side stream, capture on another (torch's own
    capture stream), where no workspace exists yet. Two graphs captured that way on one
    stream, replayed in reverse order and interleaved with eager calls on that stream."""
    gen = torch.Generator(device="cuda").manual_seed(4242)
    qw, sz = random_repacked(640, 8192, 128, gen)  # 160 row sets x 16 steps: split sets
    w_t = ref.dequant_repacked(qw, sz, 128)
    xs = [torch.zeros(1, 8192, device="cuda").half() for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.sm70.gptq_gemv(xs[0], qw, sz, 128, None, 0, 4)
    torch.cuda.current_stream().wait_stream(side)
    capture = torch.cuda.Stream()
    graphs, ys = [], []
    for i in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            ys.append(torch.ops.sm70.gptq_gemv(xs[i], qw, sz, 128, None, 0, 4 + i))
        graphs.append(graph)
    for rnd in range(2):
        for i in (1, 0):
            xs[i].copy_(torch.randn(1, 8192, device="cuda", generator=gen).half())
            graphs[i].replay()
            torch.cuda.synchronize()
            assert rel_err(ys[i], ref.gemv_reference(xs[i], w_t)) < 2e-3, (rnd, i)
        capture.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture):  # eager on the capturing stream afterwards
            x = torch.randn(1, 8192, device="cuda", generator=gen).half()
            y = torch.ops.sm70.gptq_gemv(x, qw, sz, 128, None, 0, 5)
        torch.cuda.synchronize()
        assert rel_err(y, ref.gemv_reference(x, w_t)) < 2e-3, rnd


# ------------------------------------------------------------------ GEMV, tensor cores (M = 1..8)
TENSOR_CORE = [10, 11]  # the device's mma (m16n8k16 on sm_80+), Volta's m8n8k4 (emulated there)


def assert_gemv_tc_error(y, x, qw, sz, g, bias, want) -> None:
    """The tensor-core kernels multiply exactly and sum in fp32 over 128-k units, with the
    biased codes 1024 + q and the constant -(1024 + z) as operands: every output within the
    fp16 output rounding plus 2^-14 sum_k |x_k| s_k (|q - z| + 1280), an fp32 accumulation
    bound with headroom that scales with the biased operands. 16x tighter than the
    packed-half kernel's bound (2^-10 sum |x w|) on these weights."""
    k = qw.shape[1]
    gi = torch.arange(k, device=qw.device) // g
    s = sz[..., 0].double()[:, gi]
    z = sz[..., 1].double()[:, gi]
    big = s * ((qw.double() - z).abs() + 1280.0)
    mag = x.double().abs() @ big.t()
    err = (y.double() - want.double()).abs()
    bound = FP16_U * want.double().abs() + 2.0**-14 * mag
    assert torch.isfinite(y.double()).all(), "non-finite output"
    worst = float((err - bound).max())
    assert worst <= 0, f"error exceeds the bound by {worst:.3g}"


@pytest.mark.parametrize("name,n,k", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("kernel", TENSOR_CORE)
def test_gptq_gemv_tensor_cores_model_shapes(name, n, k, kernel):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"tc/{name}/{kernel}".encode()))
    qw, sz = random_repacked(n, k, 128, gen)
    for m in (1, 2, 3, 4, 8):
        x = torch.randn(m, k, device="cuda", generator=gen).half()
        bias = torch.randn(n, device="cuda", generator=gen).half() if m % 2 == 0 else None
        poison(m * n * 2)
        y = torch.ops.sm70.gptq_gemv(x, qw, sz, 128, bias, 0, kernel)
        assert y.shape == (m, n) and y.dtype == torch.float16
        want = ref.gemv_reference(x, ref.dequant_repacked(qw, sz, 128), bias)
        assert_gemv_tc_error(y, x, qw, sz, 128, bias, want)
        assert rel_err(y, want) < 2e-3, m


@pytest.mark.parametrize("kernel", TENSOR_CORE)
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gptq_gemv_tensor_cores_lm_head(kernel, m):
    """The int8 lm_head layout (G = K = 5120, zero 128), the full per-GPU vocabulary slice."""
    gen = torch.Generator(device="cuda").manual_seed(500 + 10 * kernel + m)
    w = (torch.randn(LM_HEAD_ROWS, HIDDEN, device="cuda", generator=gen) * 0.02).half()
    qw, sz, g = ref.quantize_lm_head_int8(w)
    x = torch.randn(m, HIDDEN, device="cuda", generator=gen).half()
    poison(m * LM_HEAD_ROWS * 2)
    y = torch.ops.sm70.gptq_gemv(x, qw, sz, g, None, 0, kernel)
    want = ref.gemv_reference(x, ref.dequant_repacked(qw, sz, g))
    assert_gemv_tc_error(y, x, qw, sz, g, None, want)


@pytest.mark.parametrize("kernel", TENSOR_CORE)
@pytest.mark.parametrize("ksplit", [0, 1, 2, 4, 8])
def test_gptq_gemv_tensor_cores_edges(kernel, ksplit):
    """N not a multiple of the row tile (1, 7, 9, 17, 130), one unit (K = 128), units not a
    multiple of the split (K = 384, 640, 1152), groups of 256 and G = K, M = 1..8, with and
    without bias, every K split (1, 2, 4 or 8 warps per row tile)."""
    gen = torch.Generator(device="cuda").manual_seed(300 + 10 * kernel + ksplit)
    for n, k, g in [
        (1, 128, 128),
        (7, 384, 128),
        (9, 1280, 256),
        (17, 1152, 1152),
        (130, 640, 128),
        (16, 256, 256),
        (4099, HIDDEN, HIDDEN),
    ]:
        qw, sz = random_repacked(n, k, g, gen)
        w = ref.dequant_repacked(qw, sz, g)
        for m in range(1, 9):
            x = torch.randn(m, k, device="cuda", generator=gen).half()
            bias = torch.randn(n, device="cuda", generator=gen).half() if m % 3 else None
            poison(m * n * 2)
            y = torch.ops.sm70.gptq_gemv(x, qw, sz, g, bias, ksplit, kernel)
            assert y.shape == (m, n)
            want = ref.gemv_reference(x, w, bias)
            assert_gemv_tc_error(y, x, qw, sz, g, bias, want)


# ------------------------------------------------------------------ KV cache write
def make_cache(num_blocks: int, hkv: int, block_size: int):
    k_cache = torch.zeros(num_blocks, hkv, block_size, 256, dtype=torch.int8, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, hkv, block_size, dtype=torch.float32, device="cuda")
    v_scale = torch.zeros_like(k_scale)
    return k_cache, v_cache, k_scale, v_scale


@pytest.mark.parametrize("block_size", [16, 64, 528])
def test_kv_int8_write(block_size):
    gen = torch.Generator(device="cuda").manual_seed(block_size)
    t, hkv, nb = 300, 2, 64
    # key/value as views of a fused qkv buffer (token stride larger than H * D)
    qkv = torch.randn(t, (12 + 2 + 2) * 256, device="cuda", generator=gen).half() * 3
    key = qkv[:, 12 * 256 : 14 * 256].view(t, hkv, 256)
    value = qkv[:, 14 * 256 :].view(t, hkv, 256)
    key[5].zero_()  # an all-zero row stores scale 0
    slots = torch.randperm(nb * block_size, device="cuda", generator=gen)[:t]
    slots[::17] = -1  # padding tokens are skipped
    got = make_cache(nb, hkv, block_size)
    want = make_cache(nb, hkv, block_size)
    torch.ops.sm70.kv_int8_write(key, value, *got, slots)
    ref.kv_int8_write_reference(key, value, *want, slots)
    for g, w in ((got[0], want[0]), (got[1], want[1])):
        diff = (g.int() - w.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 1e-3
    for g, w in ((got[2], want[2]), (got[3], want[3])):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ paged decode
def fill_paged(ctxs, block_size, hkv=2, gen=None, extra_blocks=3):
    """Random int8 cache with a shuffled block table per sequence."""
    need = [math.ceil(c / block_size) for c in ctxs]
    nb = sum(need) + extra_blocks
    k_cache = torch.randint(
        -127, 128, (nb, hkv, block_size, 256), dtype=torch.int8, device="cuda", generator=gen
    )
    v_cache = torch.randint(
        -127, 128, (nb, hkv, block_size, 256), dtype=torch.int8, device="cuda", generator=gen
    )
    k_scale = torch.rand(nb, hkv, block_size, device="cuda", generator=gen) * 0.02 + 1e-3
    v_scale = torch.rand(nb, hkv, block_size, device="cuda", generator=gen) * 0.02 + 1e-3
    perm = torch.randperm(nb, device="cuda", generator=gen).int()
    width = max(need) + 2
    tables = torch.full((len(ctxs), width), nb + 1000, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start : start + n]
        start += n
    seq_lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, k_scale, v_scale, tables, seq_lens


# 150 sequences of 1..400 tokens and one of 6000 in the middle
MANY_CTXS = (
    [(i * 97) % 400 + 1 for i in range(77)] + [6000] + [(i * 53) % 400 + 1 for i in range(72)]
)

DECODE_CASES = [
    # (ctxs, q_per_seq, block_size, splits)
    ([1], 1, 16, 1),
    ([4], 4, 16, 1),
    ([16], 1, 16, 1),
    ([17], 2, 16, 1),
    ([32, 33, 31], 3, 16, 1),
    ([48, 49], 4, 16, 5),
    ([1000, 7, 4096], 4, 16, 7),
    ([4097], 1, 64, 16),
    ([2112, 2113], 2, 528, 3),
    ([65], 4, 16, 64),  # more splits than tiles: empty splits must combine cleanly
    ([700, 2], 2, 16, 2),  # the fewest splits the reduce combines
    ([5000, 300], 1, 16, 300),  # split count not a multiple of the reduce's 16 groups
    # batches share their slots by length: the long sequence takes most chunks, the
    # per-sequence rounding overflows the first chunk size (the fallback), 6 x 64 slots;
    # an empty entry (0 tokens, as a padded batch has) gets zeros
    ([20000, 5, 0, 37, 300, 2], 2, 16, 64),
    ([0, 40], 1, 16, 1),
    ([40000, 3, 900], 1, 16, 1024),  # chunks capped at 1024 per sequence (W = 3072)
    (MANY_CTXS, 1, 16, 2),  # two rounds of the schedule's 128-wide scan, 2 slots each
    ([40000], 4, 16, 1024),  # the most splits; the last ~400 are empty
]


def mma_paths() -> list[int]:
    """1: Volta m8n8k4 (emulated but correct on sm_80+); 2: m16n8k16 where the GPU has it."""
    if not torch.cuda.is_available():
        return [1]
    return [1, 2] if torch.cuda.get_device_capability(0)[0] >= 8 else [1]


@pytest.mark.parametrize("mma", mma_paths())
@pytest.mark.parametrize("ctxs,qn,block_size,splits", DECODE_CASES)
def test_paged_decode(ctxs, qn, block_size, splits, mma):
    gen = torch.Generator(device="cuda").manual_seed(len(ctxs) * 1000 + sum(ctxs) + qn)
    cache = fill_paged(ctxs, block_size, gen=gen)
    q = torch.randn(len(ctxs) * qn, 12, 256, device="cuda", generator=gen).half()
    scale = 1.0 / 16.0
    poison(q.numel() * 2)
    out = torch.ops.sm70.paged_decode(q, *cache, qn, scale, splits, mma)
    want = ref.paged_decode_reference(q, *cache, qn, scale)
    assert out.shape == q.shape
    assert rel_err(out, want) < 5e-3
    assert float((out.float() - want).abs().max()) < 2e-2


@pytest.mark.parametrize("qn", [1, 2, 3, 4])
def test_paged_decode_blocks_per_sm(qn):
    """The occupancy the split rule sizes its grid by comes from the driver, for each path."""
    for mma in mma_paths():
        n = torch.ops.sm70.paged_decode_blocks_per_sm(qn, mma)
        assert 1 <= n <= 16


def test_paged_decode_splits_agree():
    """The same input through 1 split and through many gives the same answer."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    cache = fill_paged([3000, 1234], 16, gen=gen)
    q = torch.randn(2 * 4, 12, 256, device="cuda", generator=gen).half()
    one = torch.ops.sm70.paged_decode(q, *cache, 4, 0.0625, 1, 1)
    for mma in mma_paths():
        many = torch.ops.sm70.paged_decode(q, *cache, 4, 0.0625, 37, mma)
        assert rel_err(many, one.float()) < 2e-3


@pytest.mark.parametrize("mma", mma_paths())
@pytest.mark.parametrize("qn,splits", [(1, 1), (4, 1), (1, 5), (4, 9)])
def test_paged_decode_rising_scores(qn, splits, mma):
    """K scales that grow along the context raise each row's maximum by ~30-40 (log2 units)
    over the 3,000 tokens: with one split the kernel's lazy running maximum has to rescale O
    several times (random caches settle after the first tile and never exercise that path);
    with 5 and 9 splits the splits' maxima differ by that much and the reduce weighs them."""
    gen = torch.Generator(device="cuda").manual_seed(77 + qn + splits)
    ctx, bs = 3000, 16
    k_cache, v_cache, k_scale, v_scale, tables, seq = fill_paged([ctx], bs, gen=gen)
    n = math.ceil(ctx / bs)
    ramp = torch.linspace(0.01, 0.12, n * bs, device="cuda").view(n, 1, bs)
    k_scale[tables[0, :n].long()] = ramp
    cache = (k_cache, v_cache, k_scale, v_scale, tables, seq)
    q = torch.randn(qn, 12, 256, device="cuda", generator=gen).half()
    out = torch.ops.sm70.paged_decode(q, *cache, qn, 0.0625, splits, mma)
    want = ref.paged_decode_reference(q, *cache, qn, 0.0625)
    assert rel_err(out, want) < 5e-3
    assert float((out.float() - want).abs().max()) < 2e-2


@pytest.mark.parametrize("mma", mma_paths())
@pytest.mark.parametrize("qn", [1, 4])
def test_paged_decode_262k(qn, mma):
    gen = torch.Generator(device="cuda").manual_seed(262 + qn)
    ctx = 262144
    cache = fill_paged([ctx], 16, gen=gen)
    q = torch.randn(qn, 12, 256, device="cuda", generator=gen).half()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = ref.decode_num_splits(ctx, 1, 2, sms)
    out = torch.ops.sm70.paged_decode(q, *cache, qn, 0.0625, splits, mma)
    want = ref.paged_decode_reference(q, *cache, qn, 0.0625)
    assert rel_err(out, want) < 5e-3


def test_decode_write_then_read_roundtrip():
    """kv_int8_write feeds paged_decode: attention over written fp16 K/V ~ fp16 attention."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    ctx, bs, qn = 777, 16, 4
    nb = math.ceil(ctx / bs) + 1
    k_cache, v_cache, k_scale, v_scale = make_cache(nb, 2, bs)
    key = torch.randn(ctx, 2, 256, device="cuda", generator=gen).half()
    value = torch.randn(ctx, 2, 256, device="cuda", generator=gen).half()
    torch.ops.sm70.kv_int8_write(
        key, value, k_cache, v_cache, k_scale, v_scale, torch.arange(ctx, device="cuda")
    )
    tables = torch.arange(nb, dtype=torch.int32, device="cuda")[None]
    seq = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    q = torch.randn(qn, 12, 256, device="cuda", generator=gen).half()
    out = torch.ops.sm70.paged_decode(
        q, k_cache, v_cache, k_scale, v_scale, tables, seq, qn, 0.0625, 3
    )
    # fp16 attention on the unquantised K/V (int8 error dominates the tolerance)
    kk = key.float().repeat_interleave(6, 1)
    vv = value.float().repeat_interleave(6, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * 0.0625
    limit = ctx - qn + torch.arange(qn, device="cuda")
    mask = torch.arange(ctx, device="cuda")[None, :] > limit[:, None]
    p = torch.softmax(s.masked_fill(mask[None], -math.inf), -1)
    want = torch.einsum("hqk,khd->qhd", p, vv)
    assert rel_err(out, want) < 2e-2


# ------------------------------------------------------------------ low-rank GEMM
LOWRANK_CASES = [
    # (m, n, k, rank, mask kind)
    (1, 5120, 3072, 0, "none"),
    (37, 5120, 3072, 64, "random"),
    (256, 7168, 5120, 256, "all"),
    (200, 1000, 1024, 16, "nobody"),
    (512, 17408, 5120, 128, "random"),
    (2048, 5120, 8704, 256, "half"),
]


@pytest.mark.parametrize("m,n,k,rank,mask_kind", LOWRANK_CASES)
def test_int8_gemm_lowrank(m, n, k, rank, mask_kind):
    gen = torch.Generator(device="cuda").manual_seed(m + n + rank)
    qweight, qzeros, scales = random_gptq(n, k, gen=gen)
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
    y = torch.ops.sm70.int8_gemm_lowrank(
        x,
        qw,
        sz,
        128,
        bias,
        a.t().contiguous() if a is not None else None,
        b.t().contiguous() if b is not None else None,
        mask,
    )
    w_t = ref.dequant_gptq_int8(qweight, qzeros, scales, 128).t()
    want = ref.lowrank_reference(x.float(), w_t, bias, a, b, mask).float()
    assert rel_err(y, want) < 3e-3
    if a is not None and mask is not None:
        # rows without the correction equal the plain GEMM
        plain = ref.lowrank_reference(x.float(), w_t, bias, None, None, None).float()
        off = ~mask
        if off.any():
            assert rel_err(y[off], plain[off]) < 3e-3
