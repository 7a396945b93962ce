"""sm70 chunked-prefill attention (torch.ops.sm70.fmha_prefill) against its float64
reference (vllm_patch.ops.reference_fmha), on a CUDA GPU, through both architecture paths.

    python -m pytest -q -m gpu tests/gpu/test_fmha_gpu.py

Error model. The reference attends over the same fp16 queries, the same fp16 chunk K/V and
the same int8 codes x fp32 scales, in float64. The kernel adds: the dequantised cache
K/V rounded to fp16 (relative 2^-12 on average per value, so a score moves by about
2^-12 sm_scale |q| |k| / sqrt(256) and a weight by that fraction), P rounded to fp16
before P V (relative <= 2^-11 per weight, so <= 2^-11 max |v| per output), fp32
accumulation, and the output's fp16 rounding (2^-11 |o|). With the operands below
(|q| ~ 2.5 per dim, sm_scale 1/16) that is a few 1e-4 of the output norm; the bounds
(REL_BOUND on the whole output, MAX_BOUND on the largest error over the largest output)
leave a few times that. A causal mask one key off, a wrong softmax scale, a missing
context or chunk tile moves outputs by O(0.1..1): the early rows of a chunk with no
context see 1..few keys, so each key carries O(1) of their weight.
"""

from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gpu_common import arch_paths, poison, record, rel_err  # noqa: E402

from vllm_patch.attention import layout  # noqa: E402
from vllm_patch.ops import kernels  # noqa: E402
from vllm_patch.ops import reference_fmha as ref  # noqa: E402

D = 256
SM_SCALE = 1.0 / 16.0
Q_AMP = 2.5  # sharper softmax than unit queries: the newest keys weigh more
REL_BOUND = 3e-3
MAX_BOUND = 1e-2
LAYOUTS = ("heads_outer", "page")


@pytest.fixture(params=arch_paths())
def arch(request: pytest.FixtureRequest):
    kernels.set_arch_path(request.param)
    yield request.param
    kernels.set_arch_path("native")


def make_chunk(q_lens, hq, hkv, gen):
    """q, k, v as views of one fused qkv buffer (token stride (Hq + 2 Hkv) 256, as vLLM's
    qkv projection leaves them) and query_start_loc."""
    t = sum(q_lens)
    qkv = torch.randn(t, (hq + 2 * hkv) * D, device="cuda", generator=gen).half()
    qkv[:, : hq * D] *= Q_AMP
    q = qkv[:, : hq * D].view(t, hq, D)
    k = qkv[:, hq * D : (hq + hkv) * D].view(t, hkv, D)
    v = qkv[:, (hq + hkv) * D :].view(t, hkv, D)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    return q, k, v, qsl


def make_cache(ctxs, hkv, block_size, layout, gen, extra_blocks=3):
    """A paged int8 cache holding each sequence's ctx random K/V tokens in shuffled blocks.

    heads_outer: k_cache, v_cache [nb, Hkv, bs, 256] and scales [nb, Hkv, bs] (today's
    decode layout). page: vLLM's hybrid page, one byte buffer per block holding K
    [bs, Hkv, 256], then V, then the K and V scales [bs, Hkv] fp32, then padding; the four
    tensors are views into it. Returns (k_cache, v_cache, k_scale, v_scale, cache_strides,
    scale_strides, block_table)."""
    need = [math.ceil(c / block_size) for c in ctxs]
    nb = sum(need) + extra_blocks
    kv_elems = block_size * hkv * D
    kf = torch.randn(nb, block_size, hkv, D, device="cuda", generator=gen)
    vf = torch.randn(nb, block_size, hkv, D, device="cuda", generator=gen)
    kq, ks = ref.quantize_per_token_head(kf)
    vq, vs = ref.quantize_per_token_head(vf)
    if layout == "heads_outer":
        k_cache = kq.permute(0, 2, 1, 3).contiguous()
        v_cache = vq.permute(0, 2, 1, 3).contiguous()
        k_scale = ks.permute(0, 2, 1).contiguous()
        v_scale = vs.permute(0, 2, 1).contiguous()
        cs = (hkv * block_size * D, D, block_size * D)
        ss = (hkv * block_size, 1, block_size)
    else:
        scale_bytes = block_size * hkv * 4
        page = (2 * kv_elems + 2 * scale_bytes + 48 + 15) // 16 * 16  # padded page
        buf = torch.zeros(nb, page, dtype=torch.int8, device="cuda")
        buf[:, :kv_elems] = kq.reshape(nb, -1)
        buf[:, kv_elems : 2 * kv_elems] = vq.reshape(nb, -1)
        fl = buf.view(torch.float32)  # [nb, page / 4]
        s0 = 2 * kv_elems // 4
        fl[:, s0 : s0 + block_size * hkv] = ks.reshape(nb, -1)
        fl[:, s0 + block_size * hkv : s0 + 2 * block_size * hkv] = vs.reshape(nb, -1)
        flat = buf.view(-1)
        k_cache = flat
        v_cache = flat[kv_elems:]
        fflat = fl.reshape(-1)
        k_scale = fflat[s0:]
        v_scale = fflat[s0 + block_size * hkv :]
        cs = (page, hkv * D, D)
        ss = (page // 4, hkv, 1)
    perm = torch.randperm(nb, device="cuda", generator=gen).int()
    width = max(*need, 1) + 2
    table = torch.zeros(len(ctxs), width, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start : start + n]
        start += n
    return k_cache, v_cache, k_scale, v_scale, cs, ss, table


def run_case(q_lens, ctxs, hq, hkv, block_size, layout, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, qsl = make_chunk(q_lens, hq, hkv, gen)
    k_cache, v_cache, k_scale, v_scale, cs, ss, table = make_cache(
        ctxs, hkv, block_size, layout, gen
    )
    ctx_t = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    args = (q, k, v, k_cache, v_cache, k_scale, v_scale, cs, ss, table, qsl, ctx_t, block_size)
    poison(q.shape[0] * hq * D * 2)
    out = kernels.fmha_prefill(*args, max(q_lens), SM_SCALE)
    torch.cuda.synchronize()
    want = ref.fmha_prefill_reference(*args, SM_SCALE)
    return out, want


def assert_close(out, want, what):
    assert out.shape == want.shape and out.dtype == torch.float16
    rel = rel_err(out, want)
    top = float(want.abs().max())
    worst = float((out.double() - want).abs().max()) / max(top, 1e-30)
    record("fmha_rel_err", rel)
    record("fmha_max_err_over_max_out", worst)
    assert rel < REL_BOUND, (rel, what)
    assert worst < MAX_BOUND, (worst, what)


CASES = [
    # (q_lens, ctxs, block_size): the batch of one prefill step
    ([600], [0], 16),  # a first chunk: no context
    ([1], [37], 16),  # one query, a context not block-aligned
    ([64], [64], 16),  # block-aligned context, a tile-aligned chunk
    ([129, 1, 300], [45, 1000, 0], 16),  # three varlen sequences
    ([77, 5, 600], [531, 2, 2113], 528),  # vLLM-sized blocks, many of them
    ([33, 250, 2], [16 * 40 + 3, 33, 4097], 64),
]
GQA = [(24, 4), (4, 2)]  # 6:1 (Qwen3.8-27B) and 2:1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hq,hkv", GQA, ids=["gqa6", "gqa2"])
@pytest.mark.parametrize("q_lens,ctxs,block_size", CASES)
def test_fmha_prefill_matches_reference(q_lens, ctxs, block_size, hq, hkv, layout, arch):
    seed = sum(q_lens) * 7 + sum(ctxs) + hq + block_size
    out, want = run_case(q_lens, ctxs, hq, hkv, block_size, layout, seed)
    assert_close(out, want, (q_lens, ctxs, block_size, hq, hkv, layout, arch))


@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 2), (9, 3)], ids=["mha", "gqa8", "gqa3"])
def test_fmha_prefill_other_groups(hq, hkv, arch):
    """Any Hq = G x Hkv: one query head per KV head, 8 (64 rows = 8 tokens), 3."""
    out, want = run_case([70, 3, 200], [100, 17, 0], hq, hkv, 16, "page", hq * 100 + hkv)
    assert_close(out, want, (hq, hkv, arch))


def test_fmha_prefill_reference_sees_the_newest_key():
    """The cases can catch a mask one key off: on the reference itself, dropping each
    query's newest key moves the early rows of a context-free chunk by O(0.1)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, qsl = make_chunk([40], 24, 4, gen)
    cache = make_cache([0], 4, 16, "heads_outer", gen)
    ctx = torch.zeros(1, dtype=torch.int32, device="cuda")
    args = (q, k, v, *cache, qsl, ctx, 16)
    want = ref.fmha_prefill_reference(*args, SM_SCALE)
    # the same attention with each query's own key masked (row 0 keeps its only key)
    qq = q.double().transpose(0, 1)
    kk = k.double().repeat_interleave(6, 1).transpose(0, 1)
    vv = v.double().repeat_interleave(6, 1).transpose(0, 1)
    s = torch.matmul(qq, kk.transpose(1, 2)) * SM_SCALE
    n = q.shape[0]
    idx = torch.arange(n, device="cuda")
    short = idx[None, :] >= idx[:, None]  # keys >= own position masked (one short)
    short[0, 0] = False  # row 0 keeps its only key
    s = s.masked_fill(short[None], float("-inf"))
    moved = torch.matmul(torch.softmax(s, -1), vv).transpose(0, 1)
    worst = float((moved - want).abs().max()) / float(want.abs().max())
    assert worst > 10 * MAX_BOUND, worst


@pytest.mark.parametrize("hq,hkv", GQA, ids=["gqa6", "gqa2"])
def test_fmha_prefill_long_context(hq, hkv, arch):
    """One 512-token chunk after 6000 context tokens in 528-token blocks (many tiles)."""
    out, want = run_case([512], [6000], hq, hkv, 528, "page", 11)
    assert_close(out, want, ("long", hq, hkv, arch))


def test_fmha_prefill_refuses_unaligned_cache_strides():
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, qsl = make_chunk([4], 24, 4, gen)
    kc, vc, ks, vs, cs, ss, table = make_cache([20], 4, 16, "heads_outer", gen)
    ctx = torch.tensor([20], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="cache_strides"):
        kernels.fmha_prefill(q, k, v, kc, vc, ks, vs, (cs[0], 6, cs[2]), ss, table, qsl, ctx,
                             16, 4, SM_SCALE)


def test_fmha_tc_peak_runs():
    """The benchmark's ceiling loops run and write every thread's sum (m16n8k16 on sm_80+)."""
    wides = [False] + ([True] if torch.cuda.get_device_capability(0)[0] >= 8 else [])
    for wide in wides:
        out = torch.full((4 * 256,), float("nan"), device="cuda")
        kernels.fmha_tc_peak(out, 16, wide=wide)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), wide


# ------------------------------------------------------------- TRITON_ATTN's page (260-byte rows)
# The backend's page (vllm_patch.attention.layout): (num_blocks, 2, block_size, Hkv, 256 + 4)
# int8, each row's fp32 scale in its last 4 bytes, the block stride the whole 2 x block_size x
# Hkv x 260-byte page (vLLM's hybrid allocator sizes the attention page and pads the GDN one
# to it). The rows start only 4-byte aligned, so the kernel reads the context with 4-byte
# loads there; "padded" adds 4 bytes between blocks (a block stride that is 4-byte aligned
# only), "row264" has 264-byte rows (the 8-byte loads). Each page is checked against the
# reference and, bit for bit, against the same codes in the packed 16-byte-aligned layout:
# the load width must not change a single output bit.
PAGE_LAYOUTS = {"triton": (260, 0), "padded": (260, 4), "row264": (264, 0)}


def make_triton_page(ctxs, hkv, block_size, gen, page_layout="triton", extra_blocks=3,
                     device="cuda"):
    """Random per-token-head int8 K/V for each sequence's ctx tokens, in shuffled blocks, in
    a TRITON_ATTN-style page and in the packed layout: (page, packed, block_table), each of
    page / packed a tuple (k_cache, v_cache, k_scale, v_scale, cache_strides, scale_strides)
    for fmha_prefill."""
    row, pad = PAGE_LAYOUTS[page_layout]
    need = [math.ceil(c / block_size) for c in ctxs]
    nb = sum(need) + extra_blocks
    kf = torch.randn(nb, block_size, hkv, D, device=device, generator=gen)
    vf = torch.randn(nb, block_size, hkv, D, device=device, generator=gen)
    kq, ks = ref.quantize_per_token_head(kf)
    vq, vs = ref.quantize_per_token_head(vf)
    if page_layout == "triton":  # exactly what the backend hands the op
        kv = layout.new_page(nb, block_size, hkv, device=device)
    else:
        blk = 2 * block_size * hkv * row + pad
        buf = torch.zeros(nb * blk, dtype=torch.int8, device=device)
        kv = torch.as_strided(buf, (nb, 2, block_size, hkv, row),
                              (blk, block_size * hkv * row, hkv * row, row, 1))
    for half, (codes, scales) in enumerate(((kq, ks), (vq, vs))):
        kv[:, half, :, :, :D] = codes
        kv[:, half, :, :, D : D + 4] = scales.contiguous().view(torch.int8).view(
            nb, block_size, hkv, 4)
    if page_layout == "triton":
        k_scale, v_scale = layout.scale_views(kv)  # TRITON_ATTN's own scale views
        kc, vc, cs, ss = layout.fmha_views(kv, k_scale, v_scale)
    else:
        # the scales as fp32 words of the same bytes: word D / 4 of each row
        words = torch.as_strided(kv, (kv.numel(),), (1,), 0).view(torch.float32)
        wst = [st // 4 for st in kv.stride()[:4]]
        k_scale = torch.as_strided(words, (nb, block_size, hkv), (wst[0], wst[2], wst[3]),
                                   D // 4)
        v_scale = torch.as_strided(words, (nb, block_size, hkv), (wst[0], wst[2], wst[3]),
                                   D // 4 + wst[1])
        kc, vc = kv[:, 0], kv[:, 1]
        cs = (kv.stride(0), kv.stride(2), kv.stride(3))
        ss = tuple(k_scale.stride())
    page = (kc, vc, k_scale, v_scale, cs, ss)
    packed = (kq.permute(0, 2, 1, 3).contiguous(), vq.permute(0, 2, 1, 3).contiguous(),
              ks.permute(0, 2, 1).contiguous(), vs.permute(0, 2, 1).contiguous(),
              (hkv * block_size * D, D, block_size * D), (hkv * block_size, 1, block_size))
    perm = torch.randperm(nb, device=device, generator=gen).int()
    table = torch.zeros(len(ctxs), max(*need, 1) + 2, dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start : start + n]
        start += n
    return page, packed, table


TRITON_CASES = [
    # (q_lens, ctxs, block_size): contexts ending mid-block, tile-aligned and not
    ([1], [37], 16),
    ([129, 1, 300], [45, 1000, 0], 16),
    ([77, 5, 600], [531, 2, 2113], 528),  # the tiny checkpoint's hybrid block
    ([256], [1584 + 700], 1584),  # the 27B's hybrid block
    ([64, 33], [4096 - 64, 17], 528),  # the last chunk of a 4K prompt beside a short one
]
TRITON_GQA = [(24, 4), (12, 2)]  # 6:1 at TP=1 and TP=2 (Hkv 4 and 2 per GPU)


def run_page_case(q_lens, ctxs, hq, hkv, block_size, page_layout, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, qsl = make_chunk(q_lens, hq, hkv, gen)
    page, packed, table = make_triton_page(ctxs, hkv, block_size, gen, page_layout)
    ctx_t = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    outs = []
    for cache in (page, packed):
        poison(q.shape[0] * hq * D * 2)
        outs.append(kernels.fmha_prefill(q, k, v, *cache, table, qsl, ctx_t, block_size,
                                         max(q_lens), SM_SCALE))
    torch.cuda.synchronize()
    want = ref.fmha_prefill_reference(q, k, v, *page, table, qsl, ctx_t, block_size, SM_SCALE)
    return outs[0], outs[1], want


@pytest.mark.parametrize("hq,hkv", TRITON_GQA, ids=["gqa6_tp1", "gqa6_tp2"])
@pytest.mark.parametrize("q_lens,ctxs,block_size", TRITON_CASES)
def test_fmha_prefill_on_triton_attn_page(q_lens, ctxs, block_size, hq, hkv, arch):
    seed = sum(q_lens) * 5 + sum(ctxs) + hkv + block_size
    out, out_packed, want = run_page_case(q_lens, ctxs, hq, hkv, block_size, "triton", seed)
    assert_close(out, want, ("triton", q_lens, ctxs, block_size, hq, hkv, arch))
    assert torch.equal(out, out_packed), "the 4-byte loads changed the result"


@pytest.mark.parametrize("page_layout", ["padded", "row264"])
@pytest.mark.parametrize("q_lens,ctxs,block_size", [TRITON_CASES[1], TRITON_CASES[2]])
def test_fmha_prefill_on_other_row_alignments(q_lens, ctxs, block_size, page_layout, arch):
    out, out_packed, want = run_page_case(q_lens, ctxs, 24, 4, block_size, page_layout,
                                          sum(ctxs) + 3)
    assert_close(out, want, (page_layout, q_lens, ctxs, block_size, arch))
    assert torch.equal(out, out_packed), f"the {page_layout} loads changed the result"


def test_fmha_prefill_refuses_two_byte_aligned_rows():
    """Strides the narrowest (4-byte) load cannot address are refused with the rule."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v, qsl = make_chunk([4], 24, 4, gen)
    page, _packed, table = make_triton_page([20], 4, 16, gen)
    kc, vc, ks, vs, cs, ss = page
    ctx = torch.tensor([20], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="multiples of 4 bytes"):
        kernels.fmha_prefill(q, k, v, kc, vc, ks, vs, (cs[0], cs[1], 258), ss, table, qsl,
                             ctx, 16, 4, SM_SCALE)
    with pytest.raises(RuntimeError, match="4-byte aligned"):
        two_off = torch.as_strided(kc, kc.shape, kc.stride(), kc.storage_offset() + 2)
        kernels.fmha_prefill(q, k, v, two_off, vc, ks, vs, cs, ss, table, qsl, ctx, 16, 4,
                             SM_SCALE)
