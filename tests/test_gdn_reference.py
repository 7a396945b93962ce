"""The Gated DeltaNet references (vllm_patch.ops.reference_gdn) against a naive loop.

The loop here is written from the recurrence and vLLM's layouts, scalar by scalar in plain
Python floats, not from the reference: per token of sequence n and value head hv (key head
hv // (HV / H)), g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), q and k scaled
to unit L2 norm (eps 1e-6 under the root), q times `scale`; h <- exp(g) h, u = beta (v - h k),
h <- h + u k^T, o = h q. State slots: initial from column num_accepted - 1, token t stores to
column t, slots <= 0 skip. The causal conv: out_t = silu(bias + sum_j w_j x_{t-3+j}) over
the window the state holds, and the state rows vLLM's kernels leave.
Inputs are exact in fp16 / fp32 so both sides start from the same numbers. The reference
runs in a child with torch: this interpreter if it has torch, else the serving environment
CI builds (.serve-venv); without either the test skips, except under CI=true (fails).
"""

from __future__ import annotations

import math
import random
import struct
from pathlib import Path

import pytest
from serve_venv import run_json

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "gdn_reference_probe.py"
H, HV, DK, DV = 2, 6, 8, 8  # GQA 1:3 as the model, small heads
QKV = 2 * H * DK + HV * DV
SLOTS = 12


def run_reference(op: str, args: dict, **kwargs) -> dict:
    req = {"op": op, "args": args, "kwargs": kwargs}
    return run_json([str(PROBE)], req, timeout=300)


def spec(dtype: str, data) -> dict:
    return {"dtype": dtype, "data": data}


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def half_exact(rng: random.Random, scale: int = 1024) -> float:
    return rng.randint(-2 * scale, 2 * scale) / scale  # |x| <= 2, step 2^-10: exact in fp16


def close(a: float, b: float, tol: float = 1e-9) -> bool:
    return abs(a - b) <= tol * (1 + abs(b))


# ---------------------------------------------------------------- the naive recurrence
def naive_gates(a: float, b: float, a_log: float, dt_bias: float) -> tuple[float, float]:
    x = a + dt_bias
    softplus = math.log(1 + math.exp(x)) if x <= 20 else x
    return -math.exp(a_log) * softplus, 1 / (1 + math.exp(-b))


def unit(vec: list[float]) -> list[float]:
    r = 1 / math.sqrt(sum(x * x for x in vec) + 1e-6)
    return [x * r for x in vec]


def naive_recurrent(inp: dict, int16: bool) -> tuple[list, dict[int, list]]:
    """(out [T][HV][DV], {slot: state [HV][DV][DK] after}) of the recurrence."""
    qkv, a, b = inp["qkv"], inp["a"], inp["b"]
    state = {s: [[row[:] for row in head] for head in inp["state"][s]] for s in range(SLOTS)}
    out = [[[0.0] * DV for _ in range(HV)] for _ in qkv]
    for n, idx in enumerate(inp["indices"]):
        idx = idx if isinstance(idx, list) else [idx]  # [N] indices: one column
        bos, eos = inp["qsl"][n], inp["qsl"][n + 1]
        if eos <= bos:
            continue
        acc = inp["accepted"]
        col0 = 0 if acc is None else min(max(acc[n] - 1, 0), len(idx) - 1)
        if idx[col0] <= 0:
            continue
        h = [[row[:] for row in head] for head in state[idx[col0]]]
        for i, t in enumerate(range(bos, eos)):
            for hv in range(HV):
                kh = hv // (HV // H)
                q = unit(qkv[t][kh * DK:(kh + 1) * DK])
                q = [x * inp["scale"] for x in q]
                k = unit(qkv[t][(H + kh) * DK:(H + kh + 1) * DK])
                v = qkv[t][2 * H * DK + hv * DV: 2 * H * DK + (hv + 1) * DV]
                g, beta = naive_gates(a[t][hv], b[t][hv], inp["A_log"][hv], inp["dt_bias"][hv])
                for r in range(DV):
                    row = [x * math.exp(g) for x in h[hv][r]]
                    u = beta * (v[r] - sum(row[c] * k[c] for c in range(DK)))
                    h[hv][r] = [row[c] + u * k[c] for c in range(DK)]
                    out[t][hv][r] = sum(h[hv][r][c] * q[c] for c in range(DK))
            if i < len(idx) and idx[i] > 0:
                state[idx[i]] = [[naive_int16_row(row) if int16 else row[:] for row in head]
                                 for head in h]
    return out, state


def naive_int16_row(row: list[float]) -> list[float]:
    """The row as stored in int16 and read back: codes round(f32(h) * f32(32767 / amax))."""
    amax = max(abs(f32(x)) for x in row)
    if amax == 0:
        return [0.0] * len(row)
    inv = f32(32767 / amax)
    scale = f32(amax / 32767)
    return [max(-32767, min(32767, round(f32(f32(x) * inv)))) * scale for x in row]


def recurrent_inputs(seed: int, lens: list[int], indices: list,
                     accepted: list[int] | None) -> dict:
    rng = random.Random(seed)
    t = sum(lens)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    qkv = [[half_exact(rng) for _ in range(QKV)] for _ in range(t)]
    qkv[0][:DK] = [0.0] * DK  # an all-zero q: the eps keeps it finite
    state = [[[[rng.randint(-2**16 + 2, 2**16 - 2) / 2**16 for _ in range(DK)] for _ in range(DV)]
              for _ in range(HV)] for _ in range(SLOTS)]
    return {
        "qkv": qkv, "qsl": qsl, "indices": indices, "accepted": accepted, "state": state,
        "a": [[half_exact(rng) * 4 for _ in range(HV)] for _ in range(t)],
        "b": [[half_exact(rng) * 2 for _ in range(HV)] for _ in range(t)],
        "A_log": [rng.uniform(-2, 1) for _ in range(HV)],
        "dt_bias": [rng.randint(-512, 512) / 256 for _ in range(HV)],
        "scale": DK**-0.5,
    }


def probe_recurrent(inp: dict, int16: bool) -> dict:
    args = {
        "qkv": spec("float16", inp["qkv"]),
        "a": spec("float16", inp["a"]),
        "b": spec("float16", inp["b"]),
        "A_log": spec("float32", inp["A_log"]),
        "dt_bias": spec("float16", inp["dt_bias"]),
        "query_start_loc": spec("int32", inp["qsl"]),
        "state_indices": spec("int32", inp["indices"]),
        "num_accepted": None if inp["accepted"] is None else spec("int32", inp["accepted"]),
    }
    if int16:
        # codes of the same rows: state = codes * 2^-16 exactly (scale 2^-16 per row)
        args["state"] = spec("int16", [[[[round(x * 2**16) // 2 for x in row] for row in head]
                                        for head in slot] for slot in inp["state"]])
        args["state_scale"] = spec("float32", [[[2.0**-15] * DV for _ in range(HV)]
                                               for _ in range(SLOTS)])
    else:
        args["state"] = spec("float64", inp["state"])
    return run_reference("recurrent", args, num_k_heads=H, scale=inp["scale"])


def as_int16_state(inp: dict) -> dict:
    """The same case with the state the int16 probe stores (codes // 2 at scale 2^-15)."""
    out = dict(inp)
    out["state"] = [[[[(round(x * 2**16) // 2) * 2.0**-15 for x in row] for row in head]
                     for head in slot] for slot in inp["state"]]
    return out


def float_args(inp: dict) -> dict:
    """The fp16 inputs as the probe's tensors hold them (A_log in float32)."""
    out = dict(inp)
    out["A_log"] = [f32(x) for x in inp["A_log"]]
    return out


CASES = {
    # MTP k=3: per-position slots; accepted 1..4 picks the initial column; a padding
    # sequence (slot 0) and an empty one; one slot of a row left null (not stored)
    "spec": ([1, 4, 3, 2, 0], [[3, 4, 5, 6], [7, 8, 9, 10], [11, 2, 1, 0], [0, 0, 0, 0],
                               [0, 0, 0, 0]], [1, 3, 2, 2, 1]),
    # plain decode: [N] indices, one token each
    "decode": ([1, 1, 1], [5, 0, 9], None),
}


@pytest.mark.parametrize("int16", [False, True], ids=["fp32-state", "int16-state"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_recurrent_reference_matches_the_naive_loop(case: str, int16: bool) -> None:
    lens, indices, accepted = CASES[case]
    inp = float_args(recurrent_inputs(7, lens, indices, accepted))
    if int16:
        inp = as_int16_state(inp)
    got = probe_recurrent(inp, int16)
    want_out, want_state = naive_recurrent(inp, int16)
    assert got["dtype"] == "torch.float64"
    for t, (gt, wt) in enumerate(zip(got["out"], want_out, strict=True)):
        for hv in range(HV):
            assert all(close(x, y) for x, y in zip(gt[hv], wt[hv], strict=True)), (t, hv)
    after = got["after"]["state"]
    if int16:
        scales = got["after"]["state_scale"]
        after = [[[[c * scales[s][hv][r] for c in after[s][hv][r]] for r in range(DV)]
                  for hv in range(HV)] for s in range(SLOTS)]
    for s in range(SLOTS):
        for hv in range(HV):
            for r in range(DV):
                for x, y in zip(after[s][hv][r], want_state[s][hv][r], strict=True):
                    # int16: the code may differ by one where f32 rounding meets a half
                    tol = 1.01 * 2.0**-15 * max(1.0, abs(y)) if int16 else 1e-9
                    assert abs(x - y) <= tol * (1 if int16 else 1 + abs(y)), (s, hv, r)


def test_recurrent_reference_skips_padding_and_stores_per_position() -> None:
    """The slot bookkeeping on its own: which slots change, and the padding rows' zeros."""
    lens, indices, accepted = CASES["spec"]
    inp = float_args(recurrent_inputs(3, lens, indices, accepted))
    got = probe_recurrent(inp, False)
    before, after = inp["state"], got["after"]["state"]
    changed = {s for s in range(SLOTS) if after[s] != before[s]}
    # seq 0 (1 token) stores column 0 only; seq 1 all four; seq 2 three tokens, its
    # third column is slot 1; the padding sequence and slot 0 never change
    assert changed == {3, 7, 8, 9, 10, 11, 2, 1}
    pad_rows = range(sum(lens[:3]), sum(lens[:4]))
    assert all(v == 0.0 for t in pad_rows for head in got["out"][t] for v in head)


# ---------------------------------------------------------------- the naive conv
D, W = 8, 4


def silu(x: float) -> float:
    return x / (1 + math.exp(-x))


def naive_conv(seq: list[list[float]], w: list[list[float]], bias: list[float] | None,
               steps: int) -> list[list[float]]:
    return [[silu((0.0 if bias is None else bias[d])
                  + sum(w[d][j] * seq[t + j][d] for j in range(W))) for d in range(D)]
            for t in range(steps)]


def conv_inputs(seed: int, lens: list[int], rows: int) -> dict:
    rng = random.Random(seed)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return {
        "x": [[half_exact(rng) for _ in range(D)] for _ in range(qsl[-1])],
        "state": [[[half_exact(rng) for _ in range(D)] for _ in range(rows)]
                  for _ in range(SLOTS)],
        "w": [[half_exact(rng) / 2 for _ in range(W)] for _ in range(D)],
        "bias": [half_exact(rng) / 4 for _ in range(D)],
        "qsl": qsl,
    }


def conv_args(inp: dict, indices, **extra) -> dict:
    return {
        "x": spec("float16", inp["x"]),
        "conv_state": spec("float16", inp["state"]),
        "weight": spec("float16", inp["w"]),
        "bias": spec("float16", inp["bias"]),
        "query_start_loc": spec("int32", inp["qsl"]),
        "state_indices": spec("int32", indices),
        **extra,
    }


def check_conv(got: dict, want_out: list, want_state: list) -> None:
    for t, (gt, wt) in enumerate(zip(got["out"], want_out, strict=True)):
        assert all(close(x, y) for x, y in zip(gt, wt, strict=True)), t
    assert got["after"]["conv_state"] == want_state


@pytest.mark.parametrize("spec_decode", [False, True], ids=["decode", "mtp"])
def test_conv_update_reference_matches_the_naive_loop(spec_decode: bool) -> None:
    k = 3
    rows = W - 1 + k
    lens = [1, 4, 2, 0, 3] if spec_decode else [1, 1, 1, 1]
    indices = [[4, 9, 9, 9], [6, 1, 1, 1], [0, 0, 0, 0], [2, 2, 2, 2], [8, 3, 3, 3]]
    indices = indices[: len(lens)]
    accepted = [2, 4, 1, 1, 3] if spec_decode else None
    inp = conv_inputs(11, lens, rows)
    extra = {"num_accepted": None if accepted is None else spec("int32", accepted)}
    got = run_reference("conv_update", conv_args(inp, indices, **extra), silu=True)
    state = [[r[:] for r in slot] for slot in inp["state"]]
    out = [[0.0] * D for _ in inp["x"]]
    for n, idx in enumerate(indices):
        bos, eos = inp["qsl"][n], inp["qsl"][n + 1]
        slot = idx[0]
        if eos <= bos or slot <= 0:
            continue
        off = min(accepted[n] - 1, rows - (W - 1)) if spec_decode else 0
        seq = state[slot][off:off + W - 1] + inp["x"][bos:eos]
        out[bos:eos] = naive_conv(seq, inp["w"], inp["bias"], eos - bos)
        keep = seq[1:] if spec_decode else seq[-(W - 1):]
        for r, vals in enumerate(keep[:rows]):
            state[slot][r] = vals[:]
    check_conv(got, out, state)


def test_conv_prefill_reference_matches_the_naive_loop() -> None:
    lens = [5, 2, 1, 7, 0, 3]
    indices = [3, 5, 7, 9, 11, 0]
    has_init = [True, True, False, False, True, True]
    inp = conv_inputs(13, lens, W - 1 + 3)
    extra = {"has_initial_state": spec("bool", has_init)}
    got = run_reference("conv_prefill", conv_args(inp, indices, **extra), silu=True)
    state = [[r[:] for r in slot] for slot in inp["state"]]
    out = [[0.0] * D for _ in inp["x"]]
    for n, slot in enumerate(indices):
        bos, eos = inp["qsl"][n], inp["qsl"][n + 1]
        if eos <= bos or slot <= 0:
            continue
        window = state[slot][: W - 1] if has_init[n] else [[0.0] * D] * (W - 1)
        seq = [r[:] for r in window] + inp["x"][bos:eos]
        out[bos:eos] = naive_conv(seq, inp["w"], inp["bias"], eos - bos)
        for r, vals in enumerate(seq[-(W - 1):]):
            state[slot][r] = vals[:]
    check_conv(got, out, state)


def test_int16_state_error_stays_within_the_sum_of_its_roundings() -> None:
    """docs/kernels.md's error model of the int16 state: the update is non-expansive in each
    row's L2 norm, so after n stores a row errs by at most sum_i sqrt(dk) s_i / 2 (s_i that
    store's row scale). 400 tokens with decays near 1 (A_log low), where errors would pile
    up if the update amplified them."""
    rng = random.Random(17)
    steps = 400
    inp = recurrent_inputs(17, [steps], [1], None)
    args = {
        "qkv": spec("float16", inp["qkv"]),
        "a": spec("float16", inp["a"]),
        "b": spec("float16", inp["b"]),
        "A_log": spec("float32", [rng.uniform(-6, -3) for _ in range(HV)]),
        "dt_bias": spec("float16", inp["dt_bias"]),
        "state": spec("float64", inp["state"][:1]),
    }
    got = run_reference("drift", args, num_k_heads=H)
    assert max(got["ratios"]) <= 1.0, max(got["ratios"])
    assert min(got["errors"]) > 0  # the int16 rows do round: the check is not vacuous
