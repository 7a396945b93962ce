"""sm70 Gated DeltaNet chunked prefill (torch.ops.sm70.gdn_chunk_prefill) on a CUDA GPU.

    python -m pytest -q -m gpu tests/gpu/test_gdn_chunk_gpu.py

Both ops, gdn_chunk_prefill (one pass) and gdn_chunk_prefill_two_pass, against
reference_gdn.gdn_prefill_reference (the token-by-token recurrence, float64, run on
the GPU) for single sequences of 1, 63, 64, 65, 200 and 1000 tokens with and without an
initial state at the model's TP=1 shapes (16 key / 48 value heads), a varlen batch at both
TP shapes (an empty sequence, a padding sequence on slot 0, indices as a column view of a
wider table, a slot stride wider than one state), and gate extremes; every case on both
architecture paths (gpu_common.arch_paths: the m16n8k16 tag and the Volta m8n8k4 code).

Tolerances. The kernel rounds to fp16 every tensor-core operand: q and k after their
norms, T diag(beta exp(G)) and T diag(beta), W and U, the state copy H, the masked Q K^T,
V' = U - W H and its decayed copy (fp32 accumulation, fp32 T, gates and state). Each is a
relative 2^-11 rounding of a term whose size is set by the state rows and values: with
M = the head's largest state row norm (initial and final) plus its largest |v|, |o| <=
scale M per element and |h| <= M, and the delta rule's per-token map (I - beta k k^T with
|k| = 1, 0 <= beta <= 1, times exp(g) <= 1) does not amplify errors carried in the state,
so the error stays a small multiple of 2^-11 of those sizes at any length. A float64
emulation of exactly these roundings on the CPU (this file's cases, run with the op
replaced by the emulation) gave at most 1.6e-4 scale M on the outputs and 1.3e-4 M on the
state; the bounds (gdn_chunk/tolerances.py) take 2e-3 of each (about 13x), plus fp16's
own rounding of the output, 2^-11 |want|, and its subnormal step for outputs that decayed
to nothing; tests/test_gdn_chunk_reference.py reruns that emulation on a small case. The
bound follows M rather than |o|: a single token's output is (q.k) beta v, whose relative
error grows as q and k become orthogonal, while its absolute error stays within 2^-11
scale M. A decay applied one token late, a lost gate, a wrong key head or slot moves
values by O(1) of |o| ~ scale M / 10, far outside the bound.
First run on an H200: tests/gpu/results/h200_gdn_chunk.json.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gdn_chunk.tolerances import SCALE, magnitude, out_bound, state_bound  # noqa: E402
from gpu_common import arch_paths, child_marker, poison, record, run_child_tests  # noqa: E402

from vllm_patch.ops import kernels  # noqa: E402
from vllm_patch.ops import reference_gdn as ref  # noqa: E402

D = 128
PAGE_PAD = 96  # extra floats per slot: the slot stride is wider than one state
HEADS = {"tp2": (8, 24), "tp1": (16, 48)}
OPS = ("one_pass", "two_pass")  # gdn_chunk_prefill and gdn_chunk_prefill_two_pass


@pytest.fixture(params=arch_paths())
def arch(request: pytest.FixtureRequest):
    kernels.set_arch_path(request.param)
    yield request.param
    kernels.set_arch_path("native")


def make_state(slots: int, hv: int, gen: torch.Generator) -> torch.Tensor:
    inner = hv * D * D
    raw = torch.empty(slots, inner + PAGE_PAD, device="cuda", dtype=torch.float32)
    raw.copy_(torch.randn(slots, inner + PAGE_PAD, generator=gen, device="cuda") * 0.3)
    return raw[:, :inner].view(slots, hv, D, D)


def make_inputs(h: int, hv: int, tokens: int, gen: torch.Generator, a_shift: float,
                b_shift: float):
    width = 2 * h * D + hv * D
    wide = torch.randn(tokens, width + 64, generator=gen, device="cuda").half()
    qkv = wide[:, :width]  # a token stride wider than the row, as a view into a buffer
    ab = torch.randn(tokens, 2 * hv, generator=gen, device="cuda") * 2.0
    ab = torch.cat([ab[:, :hv] + a_shift, ab[:, hv:] + b_shift], dim=1).half()
    a, b = ab[:, :hv], ab[:, hv:]  # strided views, as vLLM's split of in_proj_ba gives
    a_log = (torch.rand(hv, generator=gen, device="cuda") * 4.5 - 3.0).float()
    dt_bias = (torch.randn(hv, generator=gen, device="cuda") * 0.5).half()
    return qkv, a, b, a_log, dt_bias


def column_view(idx: torch.Tensor) -> torch.Tensor:
    """idx [N] as vLLM hands it over: column 0 of a wider table (row stride 3); the other
    columns hold -7, so an op that read the column as contiguous would fail the case."""
    table = torch.full((idx.numel(), 3), -7, dtype=torch.int32, device="cuda")
    table[:, 0] = idx.cuda()
    return table[:, 0]


def run_case(heads: str, lens: list[int], init: list[bool], seed: int, pad: int | None = None,
             a_shift: float = 0.0, b_shift: float = 0.0, op: str = "one_pass") -> None:
    """Sequence `pad` (if given) sits on slot 0 (vLLM's null block): zero output, no state."""
    h, hv = HEADS[heads]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = len(lens)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(qsl[-1])
    idx = torch.arange(1, n + 1, dtype=torch.int32).flip(0)  # slots not in sequence order
    if pad is not None:
        idx[pad] = 0
    slots = n + 3  # two slots no sequence names: they must stay as they are
    state = make_state(slots, hv, gen)
    qkv, a, b, a_log, dt_bias = make_inputs(h, hv, tokens, gen, a_shift, b_shift)
    has_init = torch.tensor(init, dtype=torch.bool, device="cuda")
    before = state.clone()
    ref_state = state.double()
    want = ref.gdn_prefill_reference(qkv, a, b, a_log, dt_bias, ref_state, qsl, idx,
                                     has_init.cpu(), h, SCALE)
    poison(tokens * hv * D * 2)
    args = (qkv, a, b, a_log, dt_bias, state, qsl.cuda(), column_view(idx), has_init, h, SCALE)
    if op == "one_pass":
        out = kernels.gdn_chunk_prefill(*args)
    else:
        out = kernels.gdn_chunk_prefill_two_pass(
            *args, chunk_indices=kernels.gdn_chunk_indices(qsl.cuda()))
    torch.cuda.synchronize()
    assert out.shape == (tokens, hv, D) and out.dtype == torch.float16
    assert torch.isfinite(out).all(), "non-finite output"
    starts = qsl.tolist()
    touched: set[int] = set()
    v_all = qkv[:, 2 * h * D:].float().abs().view(tokens, hv, D)
    for i in range(n):
        bos, eos = starts[i], starts[i + 1]
        if eos == bos:
            continue
        if i == pad:
            assert (out[bos:eos] == 0).all(), f"padding sequence {i} not zero"
            continue
        slot = int(idx[i])
        touched.add(slot)
        ws = ref_state[slot]
        m = magnitude(ws, before[slot].double() if init[i] else None, v_all[bos:eos])
        w = want[bos:eos]
        ratio = float(((out[bos:eos].double() - w).abs() / out_bound(w, m)).max())
        record("gdn_chunk_out_error_over_bound", ratio)
        assert ratio <= 1.0, (f"sequence {i} ({eos - bos} tokens) output error {ratio:.3g}x "
                              "its bound", heads, lens)
        sr = float(((state[slot].double() - ws).abs() / state_bound(m)).max())
        record("gdn_chunk_state_error_over_bound", sr)
        assert sr <= 1.0, (f"slot {slot} state error {sr:.3g}x its bound", heads, lens)
    untouched = [s for s in range(slots) if s not in touched]
    assert torch.equal(state[untouched], before[untouched]), "a slot no sequence runs changed"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("init", [True, False])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 200, 1000])
def test_gdn_chunk_lengths(length: int, init: bool, op: str, arch: str) -> None:
    run_case("tp1", [length], [init], seed=length + (7 if init else 0), op=op)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_gdn_chunk_varlen_batch(heads: str, op: str, arch: str) -> None:
    lens = [5, 64, 0, 130, 1, 77, 3]
    init = [True, False, True, True, False, True, True]
    run_case(heads, lens, init, seed=3 + sorted(HEADS).index(heads), pad=6, op=op)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("gates", ["strong-decay", "beta-off"])
def test_gdn_chunk_gate_extremes(gates: str, op: str, arch: str) -> None:
    """a + dt_bias above softplus's threshold of 20 (exp(g) underflows within a few tokens),
    or b so negative that beta ~ 0 (the initial state only decays)."""
    shift = {"strong-decay": (24.0, 0.0), "beta-off": (0.0, -30.0)}[gates]
    run_case("tp2", [200, 70], [True, True], seed=11, a_shift=shift[0], b_shift=shift[1],
             op=op)


# The argument checks run in a child pytest (as in test_gdn_gpu.py): a crash inside an op's
# error path must not end the whole GPU run.
CHILD_ENV = "SM70_GDN_CHUNK_REJECT_CHILD"
child_only = child_marker(CHILD_ENV, "test_gdn_chunk_argument_checks_in_a_child")


def test_gdn_chunk_argument_checks_in_a_child() -> None:
    run_child_tests(__file__, CHILD_ENV, passed=1)


@child_only
def test_child_gdn_chunk_rejects_bad_arguments() -> None:
    h, hv = HEADS["tp2"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    state = make_state(4, hv, gen)
    qkv, a, b, a_log, dt_bias = make_inputs(h, hv, 2, gen, 0.0, 0.0)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    idx = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    odd = torch.empty(2, qkv.shape[1] + 1, dtype=torch.float16, device="cuda")[:, :qkv.shape[1]]
    odd.copy_(qkv)
    with pytest.raises(RuntimeError, match="token stride that is a multiple of 4"):
        kernels.gdn_chunk_prefill(odd, a, b, a_log, dt_bias, state, qsl, idx, None, h, SCALE)
    with pytest.raises(RuntimeError, match="contiguous within a slot"):
        kernels.gdn_chunk_prefill(qkv, a, b, a_log, dt_bias, state.transpose(2, 3), qsl, idx,
                                  None, h, SCALE)
    with pytest.raises(RuntimeError, match="A_log and dt_bias"):
        kernels.gdn_chunk_prefill(qkv, a, b, a_log[:3], dt_bias, state, qsl, idx, None, h,
                                  SCALE)
    with pytest.raises(ValueError, match="num_k_heads must divide"):
        kernels.gdn_chunk_prefill(qkv, a, b, a_log, dt_bias, state, qsl, idx, None, 7, SCALE)
    with pytest.raises(RuntimeError, match="chunk_indices must be"):
        kernels.gdn_chunk_prefill_two_pass(qkv, a, b, a_log, dt_bias, state, qsl, idx, None, h,
                                           SCALE, chunk_indices=idx)
