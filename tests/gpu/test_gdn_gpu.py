"""sm70 Gated DeltaNet decode-side kernels against their references, on a CUDA GPU.

    python -m pytest -q -m gpu tests/gpu/test_gdn_gpu.py

The recurrent decode (torch.ops.sm70.gdn_recurrent_decode) is checked against
reference_gdn.gdn_recurrent_reference in float64 on the model's per-GPU shapes (TP=2: 8 key
and 24 value heads; TP=1: 16 / 48), plain decode ([N] slots, 1 token) and MTP verification
([N, 4] slots, 1..4 tokens, num_accepted 1..4), float32 and int16 state, with padding
sequences (slot 0), a page stride wider than one state, as vLLM's hybrid pages have, and a
plain decode's slots as a column view of a wider table (vLLM's block_table[:, 0]).

Error model (float32 arithmetic, M = the largest L2 norm of a state row of that sequence
and head over its initial and stored states, plus max |v|; scale = 128^-0.5 = |qn|): per
token the row update errs by its fp32 roundings: the 19-deep sums h.k (16 serial FMAs and 3
shuffle adds, 2^-24 each relative to sum |h k| <= M since |kn| = 1), rsqrt and exp (a few
2^-24), so |delta h| <= 2^-19 M per token and row; the bound takes 4x that,
T 2^-17 M per element after T tokens. The output o = h qn adds its own 19-deep sum and the
fp16 rounding: |o - want| <= u |want| + (T 2^-17 + 2^-18) scale M. int16 rows add the code
rounding of both sides (each within half a step s = max |row| / 32767, their scales a
state error apart): |stored - want| <= 1.01 s + 2 T 2^-17 M. A bug in the recurrence (a
wrong head, a missing norm or gate, the wrong slot) moves values by O(M), 2^15 x these.
Run on the H200 (both arch paths): job `gdn_tests` of tests/gpu/round_call.py, last in
r5_call4 (tests/gpu/results/h200_refactor_check.json).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gpu_common import FP16_U, child_marker, poison, record, run_child_tests  # noqa: E402

from vllm_patch.ops import kernels  # noqa: E402
from vllm_patch.ops import reference_gdn as ref  # noqa: E402

D = 128
PAGE_PAD = 96  # extra elements per slot: the slot stride is wider than one state
HEADS = {"tp2": (8, 24), "tp1": (16, 48)}
SCALE = D**-0.5


def make_state(slots: int, hv: int, state_dtype: str, gen: torch.Generator):
    """A strided [slots, HV, 128, 128] state (and its row scales for int16)."""
    inner = hv * D * D
    vals = torch.randn(slots, inner, generator=gen, device="cuda") * 0.3
    raw = torch.empty(slots, inner + PAGE_PAD, device="cuda",
                      dtype=torch.float32 if state_dtype == "float32" else torch.int16)
    state = raw[:, :inner].view(slots, hv, D, D)
    if state_dtype == "float32":
        state.copy_(vals.view(slots, hv, D, D))
        return state, None
    codes, scale = ref.state_int16_quantize(vals.view(slots, hv, D, D))
    state.copy_(codes)
    return state, scale.contiguous()


def make_inputs(h: int, hv: int, tokens: int, gen: torch.Generator, dt_dtype=torch.float16):
    qkv = torch.randn(tokens, 2 * h * D + hv * D, generator=gen, device="cuda").half()
    ab = torch.randn(tokens, 2 * hv, generator=gen, device="cuda") * 2.0
    a = ab[:, :hv].half()  # strided views, as vLLM's split of in_proj_ba gives
    b = ab[:, hv:].half()
    a_log = (torch.rand(hv, generator=gen, device="cuda") * 4.5 - 3.0).float()
    dt_bias = (torch.randn(hv, generator=gen, device="cuda") * 0.5).to(dt_dtype)
    return qkv, a, b, a_log, dt_bias


def layout(mode: str, batch: int, gen: torch.Generator):
    """(lens, indices, num_accepted) for `mode`; sequence 2 is padding (slot 0), the
    last is empty. Slots are distinct and >= 1; slot 0 is vLLM's null block."""
    if mode == "decode":
        lens = [1] * batch
        lens[-1] = 0
        idx = torch.arange(1, batch + 1, dtype=torch.int32)
        idx[2] = 0
        return lens, idx, None
    lens = torch.randint(1, 5, (batch,), generator=gen, device="cuda").tolist()
    lens[0], lens[1], lens[-1] = 4, 1, 0
    idx = torch.arange(1, 4 * batch + 1, dtype=torch.int32).view(batch, 4)
    idx[2] = 0
    acc = torch.randint(1, 5, (batch,), generator=gen, device="cuda").to(torch.int32)
    acc[0], acc[1] = 4, 1
    return lens, idx, acc


def as_vllm_indices(idx: torch.Tensor) -> torch.Tensor:
    """idx on the GPU as vLLM hands it over: a plain decode's [N] slots are column 0 of the
    block table (block_table[:, 0], row stride 5 here); the other columns hold -7, so an op
    that read the column as contiguous would skip sequences and fail the comparison."""
    if idx.dim() != 1:
        return idx.cuda()
    table = torch.full((idx.numel(), 5), -7, dtype=torch.int32, device="cuda")
    table[:, 0] = idx.cuda()
    return table[:, 0]


def row_magnitude(state64: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """max over the given slots and rows of the rows' L2 norm, per head [HV]."""
    return state64[slots].norm(dim=-1).amax(dim=(0, 2))


def run_case(heads: str, mode: str, state_dtype: str, batch: int, seed: int,
             dt_dtype=torch.float16, a_shift: float = 0.0, b_shift: float = 0.0) -> None:
    h, hv = HEADS[heads]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lens, idx, acc = layout(mode, batch, gen)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(qsl[-1])
    slots = int(idx.max()) + 3  # two slots no sequence names: they must stay as they are
    state, scale = make_state(slots, hv, state_dtype, gen)
    qkv, a, b, a_log, dt_bias = make_inputs(h, hv, tokens, gen, dt_dtype)
    a += a_shift
    b += b_shift
    before = state.clone()
    scale_before = None if scale is None else scale.clone()
    ref_state = state.cpu().double() if scale is None else state.cpu()
    ref_scale = None if scale is None else scale.cpu()
    want = ref.gdn_recurrent_reference(
        qkv.cpu(), a.cpu(), b.cpu(), a_log.cpu(), dt_bias.cpu(), ref_state, qsl, idx,
        None if acc is None else acc.cpu(), h, SCALE, ref_scale)
    poison(tokens * hv * D * 2)
    out = kernels.gdn_recurrent_decode(
        qkv, a, b, a_log, dt_bias, state, qsl.cuda(), as_vllm_indices(idx),
        None if acc is None else acc, h, SCALE, state_scale=scale)
    torch.cuda.synchronize()
    assert out.shape == (tokens, hv, D) and out.dtype == torch.float16

    init64 = (before.cpu().double() if scale is None
              else ref.state_int16_dequantize(before.cpu(), scale_before.cpu()))
    got64 = (state.cpu().double() if scale is None
             else ref.state_int16_dequantize(state.cpu(), scale.cpu()))
    want64 = (ref_state if scale is None
              else ref.state_int16_dequantize(ref_state, ref_scale))
    cols = idx.view(batch, -1)
    touched: set[int] = set()
    starts = qsl.tolist()
    for n in range(batch):
        bos, eos = starts[n], starts[n + 1]
        if eos == bos:
            continue
        row = cols[n].tolist()
        col0 = 0 if acc is None else min(max(int(acc[n]) - 1, 0), len(row) - 1)
        if row[col0] <= 0:
            assert (out[bos:eos] == 0).all(), f"padding sequence {n} not zero"
            continue
        stored = [s for s in row[: eos - bos] if s > 0]
        touched |= set(stored)
        t_n = eos - bos
        vmax = qkv[bos:eos, 2 * h * D:].float().abs().view(t_n, hv, D).amax(dim=(0, 2)).cpu()
        m = torch.maximum(row_magnitude(init64, [row[col0]]),
                          row_magnitude(want64, stored)) + vmax.double()  # [HV]
        w = want[bos:eos]
        bound = FP16_U * w.abs() + ((t_n * 2.0**-17 + 2.0**-18) * SCALE * m).view(1, hv, 1)
        ratio = float(((out[bos:eos].cpu().double() - w).abs() / bound).max())
        record("gdn_out_error_over_bound", ratio)
        assert ratio <= 1.0, (f"sequence {n} output error {ratio:.3g}x its bound", heads, mode)
        for s in stored:
            sb = (t_n * 2.0**-17 * m).view(hv, 1, 1)
            if scale is not None:
                sb = 1.01 * ref_scale[s].double().unsqueeze(-1) + 2 * sb
            sr = float(((got64[s] - want64[s]).abs() / sb).max())
            record("gdn_state_error_over_bound", sr)
            assert sr <= 1.0, (f"slot {s} state error {sr:.3g}x its bound", heads, mode)
    untouched = [s for s in range(slots) if s not in touched]
    assert torch.equal(state[untouched], before[untouched]), "a slot no token names changed"
    if scale is not None:
        assert torch.equal(scale[untouched], scale_before[untouched])


@pytest.mark.parametrize("state_dtype", ["float32", "int16"])
@pytest.mark.parametrize("mode", ["decode", "mtp"])
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_gdn_recurrent_model_shapes(heads: str, mode: str, state_dtype: str) -> None:
    seed = 10 * sorted(HEADS).index(heads) + ("decode", "mtp").index(mode)
    run_case(heads, mode, state_dtype, batch=16, seed=seed)


@pytest.mark.parametrize("mode", ["decode", "mtp"])
def test_gdn_recurrent_float32_dt_bias_and_one_sequence(mode: str) -> None:
    run_case("tp2", mode, "float32", batch=4, seed=5, dt_dtype=torch.float32)


@pytest.mark.parametrize("gates", ["softplus-linear", "beta-off"])
def test_gdn_recurrent_gate_extremes(gates: str) -> None:
    """a + dt_bias above softplus's threshold of 20 (decay exp(-exp(A) x), tiny), or b so
    negative that beta ~ 0 (the state only decays)."""
    shift = {"softplus-linear": (24.0, 0.0), "beta-off": (0.0, -30.0)}[gates]
    run_case("tp2", "mtp", "float32", batch=6, seed=9, a_shift=shift[0], b_shift=shift[1])


# The argument checks run in a child pytest: a crash inside an op's error path (seen once on
# a torch image, docs/kernels.md) must not end the whole GPU run.
CHILD_ENV = "SM70_GDN_REJECT_CHILD"
child_only = child_marker(CHILD_ENV, "test_gdn_argument_checks_in_a_child")


def test_gdn_argument_checks_in_a_child() -> None:
    run_child_tests(__file__, CHILD_ENV, passed=2)


@child_only
def test_child_gdn_recurrent_rejects_bad_arguments() -> None:
    h, hv = HEADS["tp2"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    state, _ = make_state(4, hv, "float32", gen)
    qkv, a, b, a_log, dt_bias = make_inputs(h, hv, 2, gen)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    idx = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="num_k_heads"):
        kernels.gdn_recurrent_decode(qkv, a, b, a_log, dt_bias, state, qsl, idx, None, 7, SCALE)
    with pytest.raises(RuntimeError, match="qkv must be"):
        kernels.gdn_recurrent_decode(qkv[:, 1:], a, b, a_log, dt_bias, state, qsl, idx, None,
                                     h, SCALE)
    with pytest.raises(RuntimeError, match="int16 state needs state_scale"):
        kernels.gdn_recurrent_decode(qkv, a, b, a_log, dt_bias, state.to(torch.int16), qsl,
                                     idx, None, h, SCALE)
    with pytest.raises(RuntimeError, match="state_indices"):
        kernels.gdn_recurrent_decode(qkv, a, b, a_log, dt_bias, state, qsl, idx[:1], None, h,
                                     SCALE)


# ------------------------------------------------------------------ causal conv1d
# y = silu(s), s = bias + 4 fp32 FMAs: |delta s| <= 5 2^-24 S (S = |bias| + sum |w x|),
# silu' <= 1.1, silu's exp and division a few 2^-24 |y|, then the fp16 output: the bound
# is u |want| + 2^-20 S + 2^-24 (the fp16 subnormal step). The state rows are copies of
# fp16 inputs: equal bit for bit.
CONV_DIM = {"tp2": 5120, "tp1": 10240}
MTP_K = 3


def conv_operands(dim: int, tokens: int, slots: int, gen: torch.Generator):
    x_wide = torch.randn(tokens, dim + 64, generator=gen, device="cuda").half()
    x = x_wide[:, :dim]  # a row stride wider than D, as a view into the projection
    rows = 3 + MTP_K
    raw = torch.randn(slots, rows * dim + 128, generator=gen, device="cuda").half()
    state = raw[:, : rows * dim].view(slots, rows, dim)
    weight = (torch.randn(dim, 4, generator=gen, device="cuda") * 0.5).half()
    bias = (torch.randn(dim, generator=gen, device="cuda") * 0.1).half()
    return x, state, weight, bias


def conv_bound(x, state_before, weight, bias, want: torch.Tensor) -> torch.Tensor:
    """2^-20 S with S bounded by (|bias| + 4 max|w| max|input|) per channel (pure bound)."""
    top = max(float(x.abs().max()), float(state_before.abs().max()))
    s = bias.double().abs().cpu() + 4 * weight.double().abs().amax(dim=1).cpu() * top
    return FP16_U * want.abs() + 2.0**-20 * s + 2.0**-24


def check_conv(out, want, bound, state, ref_state, before, named: set[int], what) -> None:
    assert out.shape == want.shape and out.dtype == torch.float16
    ratio = float(((out.cpu().double() - want).abs() / bound).max())
    record("gdn_conv_error_over_bound", ratio)
    assert ratio <= 1.0, (f"conv error {ratio:.3g}x its bound", what)
    assert torch.equal(state.cpu(), ref_state), ("conv state differs", what)
    others = [s for s in range(state.shape[0]) if s not in named]
    assert torch.equal(state[others], before[others]), "a slot no sequence names changed"


@pytest.mark.parametrize("mode", ["decode", "mtp"])
@pytest.mark.parametrize("heads", sorted(CONV_DIM))
def test_gdn_conv1d_update(heads: str, mode: str) -> None:
    dim = CONV_DIM[heads]
    gen = torch.Generator(device="cuda").manual_seed(21 + ("decode", "mtp").index(mode))
    batch = 16
    lens, idx, acc = layout(mode, batch, gen)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = int(idx.max()) + 3
    x, state, weight, bias = conv_operands(dim, int(qsl[-1]), slots, gen)
    before = state.clone()
    ref_state = state.cpu()
    want = ref.conv1d_update_reference(x.cpu(), ref_state, weight.cpu(), bias.cpu(), qsl, idx,
                                       None if acc is None else acc.cpu())
    poison(x.numel() * 2)
    out = kernels.gdn_conv1d_update(x, state, weight, bias, qsl.cuda(), as_vllm_indices(idx),
                                    acc)
    torch.cuda.synchronize()
    named = set(idx.view(batch, -1)[:, 0].tolist())
    check_conv(out, want, conv_bound(x, before, weight, bias, want), state, ref_state, before,
               named, (heads, mode))


@pytest.mark.parametrize("lens", [[1, 2, 3, 5, 64, 65, 200, 3000], [6000]],
                         ids=["varlen", "one-long"])
def test_gdn_conv1d_prefill(lens: list[int]) -> None:
    """Chunks of 64 tokens: a window read across a chunk edge, sequences shorter than the
    window (the state keeps part of the initial one), with and without initial state."""
    dim = CONV_DIM["tp2"]
    gen = torch.Generator(device="cuda").manual_seed(31 + len(lens))
    lens = [*lens, 0, 7]  # an empty sequence, and a padding one (slot 0)
    batch = len(lens)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    idx = torch.arange(1, batch + 1, dtype=torch.int32) * 2
    idx[-1] = 0
    has_init = torch.tensor([i % 2 == 0 for i in range(batch)], dtype=torch.bool)
    x, state, weight, bias = conv_operands(dim, int(qsl[-1]), int(idx.max()) + 2, gen)
    before = state.clone()
    ref_state = state.cpu()
    want = ref.conv1d_prefill_reference(x.cpu(), ref_state, weight.cpu(), bias.cpu(), qsl, idx,
                                        has_init)
    poison(x.numel() * 2)
    out = kernels.gdn_conv1d_prefill(x, state, weight, bias, qsl.cuda(), idx.cuda(),
                                     has_init.cuda())
    torch.cuda.synchronize()
    check_conv(out, want, conv_bound(x, before, weight, bias, want), state, ref_state, before,
               set(idx.tolist()), lens)


def test_gdn_conv1d_without_bias_or_silu() -> None:
    dim = CONV_DIM["tp2"]
    gen = torch.Generator(device="cuda").manual_seed(41)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    x, state, weight, _ = conv_operands(dim, 2, 3, gen)
    before = state.clone()
    ref_state = state.cpu()
    want = ref.conv1d_update_reference(x.cpu(), ref_state, weight.cpu(), None, qsl, idx,
                                       silu=False)
    out = kernels.gdn_conv1d_update(x, state, weight, None, qsl.cuda(), idx.cuda(), silu=False)
    torch.cuda.synchronize()
    zero = torch.zeros(dim, dtype=torch.float16, device="cuda")
    check_conv(out, want, conv_bound(x, before, weight, zero, want), state, ref_state, before,
               {1, 2}, "no bias, no silu")


def test_gdn_ops_replay_in_a_cuda_graph() -> None:
    """vLLM captures GDN decode steps in full CUDA graphs: capture the conv update and the
    recurrent step once, refill the static inputs, replay, and check both against the
    references on the new inputs (a kernel reading a host value at capture would not)."""
    h, hv = HEADS["tp2"]
    dim = CONV_DIM["tp2"]
    gen = torch.Generator(device="cuda").manual_seed(51)
    batch = 6
    lens, idx, acc = layout("mtp", batch, gen)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens, slots = int(qsl[-1]), int(idx.max()) + 2
    x, conv_state, weight, bias = conv_operands(dim, tokens, slots, gen)
    state, _ = make_state(slots, hv, "float32", gen)
    _, a, b, a_log, dt_bias = make_inputs(h, hv, tokens, gen)
    qsl_d, idx_d = qsl.cuda(), idx.cuda()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        qkv = kernels.gdn_conv1d_update(x, conv_state, weight, bias, qsl_d, idx_d, acc)
        return qkv, kernels.gdn_recurrent_decode(qkv, a, b, a_log, dt_bias, state, qsl_d,
                                                 idx_d, acc, h, SCALE)

    conv0, state0 = conv_state.clone(), state.clone()
    step()  # loads the ops and runs once outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv_out, out = step()
    fresh = torch.Generator(device="cuda").manual_seed(52)
    x.copy_(torch.randn(x.shape, generator=fresh, device="cuda").half())
    a.copy_(torch.randn(a.shape, generator=fresh, device="cuda").half())
    conv_state.copy_(conv0)
    state.copy_(state0)
    graph.replay()
    torch.cuda.synchronize()

    ref_conv = conv0.cpu()
    want_qkv = ref.conv1d_update_reference(x.cpu(), ref_conv, weight.cpu(), bias.cpu(), qsl,
                                           idx, acc.cpu())
    check_conv(qkv_out, want_qkv, conv_bound(x, conv0, weight, bias, want_qkv), conv_state,
               ref_conv, conv0, set(idx[:, 0].tolist()), "graph replay")
    ref_state = state0.cpu().double()
    want = ref.gdn_recurrent_reference(qkv_out.cpu(), a.cpu(), b.cpu(), a_log.cpu(),
                                       dt_bias.cpu(), ref_state, qsl, idx, acc.cpu(), h, SCALE)
    m = (max(float(state0.norm(dim=-1).max()), float(ref_state.norm(dim=-1).max()))
         + float(qkv_out.abs().max()))
    bound = FP16_U * want.abs() + (4 * 2.0**-17 + 2.0**-18) * SCALE * m
    ratio = float(((out.cpu().double() - want).abs() / bound).max())
    record("gdn_out_error_over_bound", ratio)
    assert ratio <= 1.0, f"graph replay output error {ratio:.3g}x its bound"
    assert torch.allclose(state.cpu().double(), ref_state, rtol=0, atol=4 * 2.0**-17 * m)


@child_only
def test_child_gdn_conv1d_rejects_bad_arguments() -> None:
    dim = CONV_DIM["tp2"]
    gen = torch.Generator(device="cuda").manual_seed(61)
    x, state, weight, bias = conv_operands(dim, 2, 3, gen)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    idx = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.gdn_conv1d_update(x, state, weight[:, :3], bias, qsl, idx)
    with pytest.raises(RuntimeError, match="conv_state"):
        kernels.gdn_conv1d_update(x, state.transpose(1, 2), weight, bias, qsl, idx)
    with pytest.raises(RuntimeError, match="has_initial_state"):
        kernels.gdn_conv1d_prefill(x, state, weight, bias, qsl, idx,
                                   torch.ones(2, dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match="state_indices"):
        kernels.gdn_conv1d_update(x, state, weight, bias, qsl, idx[:1])
