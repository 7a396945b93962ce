"""The chunked-prefill references (vllm_patch.ops.reference_gdn) and the wrapper's checks.

gdn_prefill_reference (what torch.ops.sm70.gdn_chunk_prefill computes) is pinned to the
existing ground truth, gdn_recurrent_reference (itself checked against a naive loop in
test_gdn_reference.py): a prefill of L tokens from slot s equals the recurrent reference run
with L state columns, whose last column then holds the final state; without an initial state
it equals the recurrence from zeros. gdn_chunk_reference, the WY-form algebra the kernel
implements, must match both to float64 rounding for lengths around the chunk of 64.
kernels.gdn_chunk_problem must name the argument and rule for each bad input, before any op
is loaded (so it runs on a CPU). The torch code runs in a child (tests/serve_venv.py).
"""

from __future__ import annotations

import json

import pytest
from serve_venv import run_json

CHILD = r"""
import json, sys
import torch
from vllm_patch.ops import kernels
from vllm_patch.ops import reference_gdn as ref

req = json.load(sys.stdin)
torch.manual_seed(req["seed"])
H, HV, D = req["heads"]
lens = req["lens"]
init = req["init"]
qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
T = int(qsl[-1])
qkv = torch.randn(T, 2 * H * D + HV * D).half()
a = (torch.randn(T, HV) * 2).half()
b = (torch.randn(T, HV) * 2).half()
A_log = torch.rand(HV) * 4.5 - 3.0
dt = (torch.randn(HV) * 0.5).half()
n = len(lens)
res = {}
if req["mode"] == "agree":
    base = torch.randn(n + 2, HV, D, D, dtype=torch.float64) * 0.3
    idx = torch.arange(1, n + 1, dtype=torch.int32)
    hi = torch.tensor(init)
    s_pre = base.clone()
    s_chunk = base.clone()
    o_pre = ref.gdn_prefill_reference(qkv, a, b, A_log, dt, s_pre, qsl, idx, hi, H)
    o_chunk = ref.gdn_chunk_reference(qkv, a, b, A_log, dt, s_chunk, qsl, idx, hi, H,
                                      chunk=req["chunk"])
    res["chunk_out"] = float((o_pre - o_chunk).abs().max())
    res["chunk_state"] = float((s_pre - s_chunk).abs().max())
    res["out_max"] = float(o_pre.abs().max())
    # each sequence alone through the recurrent reference, one state column per token:
    # column 0 is the initial slot 1, token t stores to slot t + 1
    rec_out, rec_state = 0.0, 0.0
    for i, L in enumerate(lens):
        if L == 0:
            continue
        bos = int(qsl[i])
        st = torch.zeros(L + 2, HV, D, D, dtype=torch.float64)
        if init[i]:
            st[1] = base[i + 1]
        cols = torch.arange(1, L + 1, dtype=torch.int32).view(1, L)
        sl = slice(bos, bos + L)
        o = ref.gdn_recurrent_reference(qkv[sl], a[sl], b[sl], A_log, dt, st,
                                        torch.tensor([0, L], dtype=torch.int32), cols, None, H)
        rec_out = max(rec_out, float((o - o_pre[sl]).abs().max()))
        rec_state = max(rec_state, float((st[L] - s_pre[i + 1]).abs().max()))
    res["recurrent_out"] = rec_out
    res["recurrent_state"] = rec_state
    run = [i + 1 for i, L in enumerate(lens) if L > 0]
    untouched = [s for s in range(n + 2) if s not in run]
    res["untouched_equal"] = bool(torch.equal(s_pre[untouched], base[untouched]))
    res["touched_moved"] = bool(all(not torch.equal(s_pre[s], base[s]) for s in run))
elif req["mode"] == "emulate":
    from pathlib import Path
    sys.path.insert(0, str(Path(ref.__file__).resolve().parents[2] / "tests" / "gpu"))
    from gdn_chunk import tolerances as tol

    F64 = torch.float64

    def r16(x):
        return x.half().to(F64)

    def emulate(state, idx, hi, late):
        # the kernel's chunk step in float64 with its fp16 roundings (chunk_prefill.cuh);
        # late: the within-chunk decay scan leaves out each token's own gate
        group = HV // H
        q_all, k_all, v_all = ref.split_qkv(qkv, H, HV, D, D)
        g_all, beta_all = (x.float().to(F64) for x in ref.gdn_gating(a, b, A_log, dt))
        out = torch.zeros(T, HV, D, dtype=F64)
        for bos, eos, slot, init in ref._prefill_sequences(qsl, idx, hi):
            hs = state[slot].to(F64) if init else torch.zeros(HV, D, D, dtype=F64)
            hs = hs.transpose(1, 2)
            for c0 in range(bos, eos, 64):
                c1 = min(c0 + 64, eos)
                m = c1 - c0
                q = r16(ref.l2norm(q_all[c0:c1]) * tol.SCALE).repeat_interleave(group, 1)
                k = r16(ref.l2norm(k_all[c0:c1])).repeat_interleave(group, 1)
                q, k = q.transpose(0, 1), k.transpose(0, 1)
                v = v_all[c0:c1].to(F64).transpose(0, 1)
                g = g_all[c0:c1].transpose(0, 1)
                gc = g.cumsum(-1) - (g if late else 0)
                beta = beta_all[c0:c1].transpose(0, 1)
                ratio = torch.exp(gc.unsqueeze(-1) - gc.unsqueeze(-2))
                zero = torch.zeros(HV, m, m, dtype=F64)
                lower = torch.tril(torch.ones(m, m, dtype=torch.bool), -1)
                causal = torch.tril(torch.ones(m, m, dtype=torch.bool))
                kk = torch.where(lower, (k @ k.transpose(1, 2)) * ratio * beta.unsqueeze(-1),
                                 zero)
                t_inv = torch.linalg.inv(torch.eye(m, dtype=F64) + kk)
                w = r16(r16(t_inv * (beta * torch.exp(gc)).unsqueeze(-2)) @ k)
                u = r16(r16(t_inv * beta.unsqueeze(-2)) @ v)
                h16 = r16(hs)
                vn = r16(u - w @ h16)
                p = r16(torch.where(causal, (q @ k.transpose(1, 2)) * ratio, zero))
                o = torch.exp(gc).unsqueeze(-1) * (q @ h16) + p @ vn
                out[c0:c1] = r16(o.transpose(0, 1))
                vd = r16(torch.exp(gc[:, -1:] - gc).unsqueeze(-1) * vn)
                hs = torch.exp(gc[:, -1]).view(-1, 1, 1) * hs + k.transpose(1, 2) @ vd
            state[slot] = hs.transpose(1, 2).float()
        return out

    base = torch.randn(n + 1, HV, D, D) * 0.3
    idx = torch.arange(1, n + 1, dtype=torch.int32)
    hi = torch.tensor(init)
    want_state = base.to(F64)
    want = ref.gdn_prefill_reference(qkv, a, b, A_log, dt, want_state, qsl, idx, hi, H,
                                     tol.SCALE)
    v_abs = qkv[:, 2 * H * D:].float().abs().view(T, HV, D)
    for late in (False, True):
        st = base.clone()
        got = emulate(st, idx, hi, late)
        worst_out = worst_state = 0.0
        for i in range(n):
            sl = slice(int(qsl[i]), int(qsl[i + 1]))
            m = tol.magnitude(want_state[i + 1], base[i + 1].to(F64) if init[i] else None,
                              v_abs[sl])
            e = (got[sl] - want[sl]).abs() / tol.out_bound(want[sl], m)
            worst_out = max(worst_out, float(e.max()))
            es = (st[i + 1].to(F64) - want_state[i + 1]).abs() / tol.state_bound(m)
            worst_state = max(worst_state, float(es.max()))
        res["late" if late else "faithful"] = [worst_out, worst_state]
else:
    state = torch.zeros(n + 1, HV, D, D)
    idx = torch.arange(1, n + 1, dtype=torch.int32)
    hi = torch.ones(n, dtype=torch.bool)
    good = dict(qkv=qkv, a=a, b=b, state=state, query_start_loc=qsl, state_indices=idx,
                has_initial_state=hi, num_k_heads=H)
    res["good"] = kernels.gdn_chunk_problem(**good)
    bad = {
        "state_dtype": dict(state=state.double()),
        "state_shape": dict(state=state[:, :, :64]),
        "k_heads": dict(num_k_heads=5),
        "qkv_width": dict(qkv=qkv[:, 1:]),
        "qkv_dtype": dict(qkv=qkv.float()),
        "a_shape": dict(a=a[:-1]),
        "b_dtype": dict(b=b.float()),
        "qsl_dtype": dict(query_start_loc=qsl.long()),
        "indices_rows": dict(state_indices=idx[:-1]),
        "init_dtype": dict(has_initial_state=hi.int()),
    }
    res["bad"] = {k: kernels.gdn_chunk_problem(**{**good, **v}) for k, v in bad.items()}
    try:
        kernels.gdn_chunk_prefill(qkv, a, b, A_log, dt, state, qsl, idx[:-1], hi, H, 0.1)
    except ValueError as exc:
        res["raised"] = str(exc)
    try:
        kernels.gdn_chunk_prefill_two_pass(qkv, a, b, A_log, dt, state, qsl, idx, hi, 5, 0.1)
    except ValueError as exc:
        res["raised_two_pass"] = str(exc)
    ci = kernels.gdn_chunk_indices(torch.tensor([0, 3, 3, 133, 197, 198], dtype=torch.int32))
    res["chunk_indices"] = ci.tolist()
    res["chunk_indices_dtype"] = str(ci.dtype)
    res["no_chunks"] = list(kernels.gdn_chunk_indices(torch.tensor([0], dtype=torch.int32)).shape)
print(json.dumps(res))
"""


def run(mode: str, lens: list[int], init: list[bool], heads=(2, 6, 128), chunk: int = 64,
        seed: int = 0) -> dict:
    req = {"mode": mode, "lens": lens, "init": init, "heads": list(heads), "chunk": chunk,
           "seed": seed}
    return run_json(["-c", CHILD], req, timeout=600)


@pytest.mark.parametrize(
    ("lens", "init", "chunk", "heads"),
    [
        ([1, 63, 64, 65, 130], [True, False, True, True, False], 64, (2, 6, 16)),
        ([5, 0, 17, 40], [False, True, True, True], 16, (2, 6, 16)),  # an empty sequence
        ([70], [True], 64, (1, 3, 128)),  # the model's head size
    ],
)
def test_prefill_and_chunked_references_match_the_recurrence(lens, init, chunk, heads) -> None:
    r = run("agree", lens, init, heads=heads, chunk=chunk)
    assert r["out_max"] > 0.01, r  # a real signal, not zeros agreeing with zeros
    tol = 1e-12
    assert r["recurrent_out"] <= tol and r["recurrent_state"] <= tol, r
    assert r["chunk_out"] <= tol and r["chunk_state"] <= tol, r
    assert r["untouched_equal"] and r["touched_moved"], r


def test_kernel_roundings_fit_the_gpu_bounds() -> None:
    """The GPU test's bounds (tests/gpu/gdn_chunk/tolerances.py) hold the kernel's fp16
    roundings, emulated in float64, with at least 4x to spare, and a decay applied one token
    late (the GPU mutant) breaks them."""
    r = run("emulate", [1, 65, 130], [False, True, True], heads=(2, 6, 128), seed=2)
    out, state = r["faithful"]
    assert out <= 0.25 and state <= 0.25, r
    assert max(r["late"]) > 1.0, r


def test_wrapper_names_each_bad_argument() -> None:
    r = run("checks", [3, 4], [True, True])
    assert r["good"] is None, r
    want = {
        "state_dtype": "state must be float32",
        "state_shape": "state must be [slots, HV, 128, 128]",
        "k_heads": "num_k_heads must divide the state's 6 value heads, got 5",
        "qkv_width": "qkv must be [T, 1280]",
        "qkv_dtype": "qkv must be float16",
        "a_shape": "a must be [7, 6]",
        "b_dtype": "b must be float16",
        "qsl_dtype": "query_start_loc must be int32",
        "indices_rows": "state_indices must be [N] or [N, S] with N = 2",
        "init_dtype": "has_initial_state must be a [2] bool tensor",
    }
    for key, text in want.items():
        got = r["bad"][key]
        assert got is not None and got.startswith(text), (key, got)
        assert "\n" not in got, json.dumps(got)
    assert r["raised"].startswith("gdn_chunk_prefill: state_indices must be"), r
    assert r["raised_two_pass"].startswith("gdn_chunk_prefill_two_pass: num_k_heads"), r
    # sequences of 3, 0, 130, 64 and 1 tokens: chunks (sequence, chunk), empty ones counted
    assert r["chunk_indices"] == [[0, 0], [2, 0], [2, 1], [2, 2], [3, 0], [4, 0]], r
    assert r["chunk_indices_dtype"] == "torch.int32" and r["no_chunks"] == [0, 2], r
