"""sm70 int8 KV cache write and paged decode attention against their references, on a CUDA
GPU, through both architecture paths where they differ.

    python -m pytest -q -m gpu tests/gpu/test_attention_gpu.py

Both ops run on two cache layouts with the same content: "packed" ([block, head, token, 256]
contiguous, 16-byte aligned rows) and "triton" (TRITON_ATTN's int8_per_token_head page as
vLLM allocates it for our backend: (block, K/V, token, head, 256 + 4) with each row's scale
in its 4 padding bytes, so rows are only 4-byte aligned and the kernels take strided views;
vllm_patch.attention.layout).

Paged decode is checked against the float32 attention over the same dequantised cache, by
relative error only (absolute bounds say nothing once a long context averages the outputs
down): rel_err < 1e-3 and the largest error below 2e-3 of the largest output. A correct
kernel's error is the fp16 rounding of P, of the split partials and of the output: a few
1e-4, where a bug that drops or adds a key costs O(1) in the cases below.
Random caches cannot show a causal mask off by one or a few tail tokens never read: over L
keys each carries about 1 / L of the weight. The tail-dominated cases make the newest keys
carry nearly all of it (keys aligned with the queries, scales rising towards the end), so
any such bug moves the output by O(1); each case first proves that on the reference itself.
"""

from __future__ import annotations

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
from vllm_patch.ops import reference as ref  # noqa: E402

HQ, HKV, D = 12, 2, 256
SM_SCALE = 1.0 / 16.0
REL_BOUND = 1e-3
MAX_BOUND = 2e-3  # largest |error| over the largest |output|


LAYOUTS = ["packed", "triton"]


@pytest.fixture(params=LAYOUTS)
def kv_layout(request: pytest.FixtureRequest) -> str:
    return request.param


def triton_views(num_blocks: int, hkv: int, block_size: int):
    """[k, v, k_scale, v_scale] views of a fresh TRITON_ATTN page (and the page)."""
    page = layout.new_page(num_blocks, block_size, hkv, "cuda")
    ks, vs = layout.scale_views(page)
    return list(layout.op_views(page, ks, vs)), page


def as_layout(cache: list, kv_layout: str) -> list:
    """The same cache content in the layout asked for (packed: as given)."""
    if kv_layout == "packed":
        return cache
    nb, hkv, bs, _ = cache[0].shape
    views, _page = triton_views(nb, hkv, bs)
    for dst, src in zip(views, cache[:4], strict=True):
        dst.copy_(src)
    assert not views[0].is_contiguous() and views[0].data_ptr() % 16 == 0
    assert views[0].stride(2) == hkv * (D + 4)  # 260-byte rows: 4-byte aligned only
    return views + list(cache[4:])


@pytest.fixture(params=arch_paths())
def arch(request: pytest.FixtureRequest):
    kernels.set_arch_path(request.param)
    yield request.param
    kernels.set_arch_path("native")


def assert_attention_close(out: torch.Tensor, want: torch.Tensor, what: object = None) -> None:
    assert out.shape == want.shape and out.dtype == torch.float16
    rel = rel_err(out, want)
    top = float(want.abs().max())
    worst = float((out.double() - want.double()).abs().max()) / max(top, 1e-30)
    record("attention_rel_err", rel)
    record("attention_max_err_over_max_out", worst)
    assert rel < REL_BOUND, (rel, what)
    assert worst < MAX_BOUND, (worst, what)


# ------------------------------------------------------------------ KV cache write
def make_cache(num_blocks: int, hkv: int, block_size: int):
    k_cache = torch.zeros(num_blocks, hkv, block_size, D, dtype=torch.int8, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(num_blocks, hkv, block_size, dtype=torch.float32, device="cuda")
    v_scale = torch.zeros_like(k_scale)
    return k_cache, v_cache, k_scale, v_scale


@pytest.mark.parametrize("block_size", [16, 64, 528])
def test_kv_int8_write(block_size, kv_layout):
    gen = torch.Generator(device="cuda").manual_seed(block_size)
    t, nb = 300, 64
    # key/value as views of a fused qkv buffer (token stride larger than H * D)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", generator=gen).half() * 3
    key = qkv[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D)
    value = qkv[:, (HQ + HKV) * D :].view(t, HKV, D)
    key[5].zero_()  # an all-zero row stores scale 0
    slots = torch.randperm(nb * block_size, device="cuda", generator=gen)[:t]
    slots[::17] = -1  # padding tokens are skipped
    # the triton views cover every byte of the page (256 codes and the 4-byte scale of
    # each row), so comparing whole views also proves no other byte was written
    got = (triton_views(nb, HKV, block_size)[0] if kv_layout == "triton"
           else make_cache(nb, HKV, block_size))
    want = make_cache(nb, HKV, block_size)
    kernels.kv_int8_write(key, value, *got, slots)
    ref.kv_int8_write_reference(key, value, *want, slots)
    for g, w in ((got[0], want[0]), (got[1], want[1])):
        diff = (g.int() - w.int()).abs()
        # codes equal except rounding ties: at most 1 code on at most 0.1 % of values
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) <= 1e-3
    for g, w in ((got[2], want[2]), (got[3], want[3])):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ paged decode
def fill_paged(ctxs, block_size, gen, extra_blocks=3, v_low=-127, kv_layout="packed"):
    """Random int8 cache with a shuffled block table per sequence; v_low = 0 gives V codes
    of one sign, so every output is O(1) however long the context."""
    need = [math.ceil(c / block_size) for c in ctxs]
    nb = sum(need) + extra_blocks
    shape = (nb, HKV, block_size, D)
    k_cache = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=gen)
    v_cache = torch.randint(v_low, 128, shape, dtype=torch.int8, device="cuda", generator=gen)
    k_scale = torch.rand(nb, HKV, block_size, device="cuda", generator=gen) * 0.02 + 1e-3
    v_scale = torch.rand(nb, HKV, block_size, device="cuda", generator=gen) * 0.02 + 1e-3
    perm = torch.randperm(nb, device="cuda", generator=gen).int()
    width = max(need) + 2
    tables = torch.full((len(ctxs), width), nb + 1000, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start : start + n]
        start += n
    seq_lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    return as_layout([k_cache, v_cache, k_scale, v_scale, tables, seq_lens], kv_layout)


def decode(q, cache, qn, splits):
    poison(q.numel() * 2)
    return kernels.paged_decode(q, *cache, qn, SM_SCALE, splits)


def want_of(q, cache, qn):
    return ref.paged_decode_reference(q, *cache, qn, SM_SCALE)


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


@pytest.mark.parametrize("ctxs,qn,block_size,splits", DECODE_CASES)
def test_paged_decode(ctxs, qn, block_size, splits, arch, kv_layout):
    gen = torch.Generator(device="cuda").manual_seed(len(ctxs) * 1000 + sum(ctxs) + qn)
    cache = fill_paged(ctxs, block_size, gen, kv_layout=kv_layout)
    q = torch.randn(len(ctxs) * qn, HQ, D, device="cuda", generator=gen).half()
    out = decode(q, cache, qn, splits)
    want = want_of(q, cache, qn)
    if 0 in ctxs:  # a sequence of no tokens gets zeros; the others the attention
        empty = torch.tensor([c == 0 for c in ctxs], device="cuda").repeat_interleave(qn)
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        out, want = out[~empty], want[~empty]
    assert_attention_close(out, want, (ctxs[:4], qn, splits))


def tail_dominated(cache, q, ctxs, qn, tail: int = 10):
    """Make the last `tail` keys of every sequence dominate its rows' softmax: queries of
    one sign, those keys all +127 with scales that fall by 3 % a token going back from the
    newest (logits about 33, 32, 31, ... against about 0 for the random keys)."""
    k_cache, _, k_scale, _, tables, _ = cache
    bs = k_cache.shape[2]
    q.abs_()
    for b, ctx in enumerate(ctxs):
        for j in range(min(tail, ctx)):
            t = ctx - 1 - j
            blk = int(tables[b, t // bs])
            k_cache[blk, :, t % bs] = 127
            k_scale[blk, :, t % bs] = 0.02 * (1 - 0.03 * j)
    return q


def shifted_reference(q, cache, qn, drop_newest: int):
    """The reference on the same cache with each sequence's newest keys removed (as a mask
    off by one, or tail tokens never read, would see it), query positions unchanged."""
    k_cache, v_cache, k_scale, v_scale, tables, seq = cache
    shorter = (seq - drop_newest).clamp_min(0)  # row i now sees up to L - drop - QN + i
    return ref.paged_decode_reference(q, k_cache, v_cache, k_scale, v_scale, tables, shorter,
                                      qn, SM_SCALE)


TAIL_CASES = [
    # (ctxs, q_per_seq, splits)
    ([37], 1, 1),
    ([37], 4, 1),
    ([1000], 2, 1),
    ([1000], 3, 7),
    ([40000], 1, 1),
    ([40000], 4, 64),
    ([4097, 600, 33], 4, 16),  # batched: the slots shared by length
    ([262144], 1, 1),
    ([262144], 4, 128),
]


@pytest.mark.parametrize("ctxs,qn,splits", TAIL_CASES)
def test_paged_decode_tail_dominated(ctxs, qn, splits, arch, kv_layout):
    """The newest keys carry the weight: a mask off by one, or the last tokens skipped,
    changes the output by O(1), which the bound cannot miss (checked on the reference)."""
    gen = torch.Generator(device="cuda").manual_seed(sum(ctxs) + 10 * qn + splits)
    cache = fill_paged(ctxs, 16, gen, kv_layout=kv_layout)
    q = torch.randn(len(ctxs) * qn, HQ, D, device="cuda", generator=gen).half()
    q = tail_dominated(cache, q, ctxs, qn)
    want = want_of(q, cache, qn)
    # the data can tell: one key fewer moves the reference by far more than the bound
    assert rel_err(shifted_reference(q, cache, qn, 1), want) > 50 * REL_BOUND
    out = decode(q, cache, qn, splits)
    assert_attention_close(out, want, (ctxs, qn, splits))


@pytest.mark.parametrize("qn", [1, 4])
def test_paged_decode_262k(qn, arch, kv_layout):
    """The full context, split as the serving rule sizes it, with V of one sign so the
    outputs stay O(1) (an all-zero output is an error of 1)."""
    gen = torch.Generator(device="cuda").manual_seed(262 + qn)
    ctx = 262144
    cache = fill_paged([ctx], 16, gen, v_low=0, kv_layout=kv_layout)
    q = torch.randn(qn, HQ, D, device="cuda", generator=gen).half()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = kernels.paged_decode_blocks_per_sm(qn)
    splits = ref.decode_num_splits(ctx, 1, HKV, sms, ctas_per_sm=blocks)
    out = decode(q, cache, qn, splits)
    want = want_of(q, cache, qn)
    assert float(want.abs().mean()) > 0.1  # O(1) outputs, as intended
    assert_attention_close(out, want, (qn, splits))


def test_paged_decode_blocks_per_sm(arch):
    """The occupancy the split rule sizes its grid by comes from the driver, per path."""
    for qn in (1, 2, 3, 4):
        n = kernels.paged_decode_blocks_per_sm(qn)
        assert 1 <= n <= 16, (qn, n)
        assert kernels.paged_decode_blocks_per_sm(qn, device=0) == n


def test_paged_decode_splits_agree(arch, kv_layout):
    """The same input through 1 split and through many gives the same answer."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    cache = fill_paged([3000, 1234], 16, gen, kv_layout=kv_layout)
    q = torch.randn(2 * 4, HQ, D, device="cuda", generator=gen).half()
    one = decode(q, cache, 4, 1)
    for splits in (2, 37, 300):
        assert rel_err(decode(q, cache, 4, splits), one.float()) < REL_BOUND, splits


@pytest.mark.parametrize("qn,splits", [(1, 1), (4, 1), (1, 5), (4, 9)])
def test_paged_decode_rising_scores(qn, splits, arch, kv_layout):
    """K scales that grow along the context raise each row's maximum by ~30-40 (log2 units)
    over the 3,000 tokens: with one split the kernel's lazy running maximum has to rescale O
    several times (random caches settle after the first tile and never exercise that path);
    with 5 and 9 splits the splits' maxima differ by that much and the reduce weighs them."""
    gen = torch.Generator(device="cuda").manual_seed(77 + qn + splits)
    ctx, bs = 3000, 16
    cache = fill_paged([ctx], bs, gen, kv_layout=kv_layout)
    n = math.ceil(ctx / bs)
    ramp = torch.linspace(0.01, 0.12, n * bs, device="cuda").view(n, 1, bs)
    cache[2][cache[4][0, :n].long()] = ramp
    q = torch.randn(qn, HQ, D, device="cuda", generator=gen).half()
    assert_attention_close(decode(q, cache, qn, splits), want_of(q, cache, qn), (qn, splits))


def test_decode_write_then_read_roundtrip(arch, kv_layout):
    """kv_int8_write feeds paged_decode: attention over written fp16 K/V ~ fp16 attention
    (the int8 quantisation of K and V dominates the error here, hence 2e-2)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    ctx, bs, qn = 777, 16, 4
    nb = math.ceil(ctx / bs) + 1
    k_cache, v_cache, k_scale, v_scale = (
        triton_views(nb, HKV, bs)[0] if kv_layout == "triton" else make_cache(nb, HKV, bs))
    key = torch.randn(ctx, HKV, D, device="cuda", generator=gen).half()
    value = torch.randn(ctx, HKV, D, device="cuda", generator=gen).half()
    kernels.kv_int8_write(key, value, k_cache, v_cache, k_scale, v_scale,
                          torch.arange(ctx, device="cuda"))
    tables = torch.arange(nb, dtype=torch.int32, device="cuda")[None]
    seq = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    q = torch.randn(qn, HQ, D, device="cuda", generator=gen).half()
    out = decode(q, [k_cache, v_cache, k_scale, v_scale, tables, seq], qn, 3)
    kk = key.float().repeat_interleave(HQ // HKV, 1)
    vv = value.float().repeat_interleave(HQ // HKV, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * SM_SCALE
    limit = ctx - qn + torch.arange(qn, device="cuda")
    mask = torch.arange(ctx, device="cuda")[None, :] > limit[:, None]
    p = torch.softmax(s.masked_fill(mask[None], -math.inf), -1)
    want = torch.einsum("hqk,khd->qhd", p, vv)
    assert rel_err(out, want) < 2e-2


def test_paged_decode_in_a_cuda_graph(arch, kv_layout):
    """A batched, split decode captured once replays with new queries and new lengths (its
    workspaces come from the graph's pool; no host-side state baked in)."""
    gen = torch.Generator(device="cuda").manual_seed(31)
    ctxs = [3000, 700, 41]
    cache = fill_paged(ctxs, 16, gen, kv_layout=kv_layout)
    q = torch.zeros(len(ctxs) * 2, HQ, D, device="cuda").half()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.paged_decode(q, *cache, 2, SM_SCALE, 16)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_decode(q, *cache, 2, SM_SCALE, 16)
    for lens in ([3000, 700, 41], [2999, 2, 41]):  # at least q_per_seq tokens each
        cache[5].copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen).half())
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, want_of(q, cache, 2), lens)
