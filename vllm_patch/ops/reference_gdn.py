"""Plain-PyTorch references of the Gated DeltaNet decode-side ops (csrc/gdn/, issue 23).

Written from the math, in float64, looping over sequences and tokens so each step reads
like the recurrence. They define what torch.ops.sm70.gdn_* must compute; the GPU tests
compare the kernels against them, and tests/test_gdn_reference.py checks them on the CPU
against a naive pure-Python loop.

Layouts (those of vLLM 0.22.1's Qwen3.5 GDN layer after its projections, per GPU):
  qkv    [T, 2 H dk + HV dv]: q heads, then k heads, then v heads (not interleaved); value
         head hv reads key head hv // (HV / H) (GQA 1:3 for Qwen3.8-27B).
  a, b   [T, HV]; A_log [HV] float32; dt_bias [HV].
  state  [slots, HV, dv, dk] (row v of head hv holds h[v, :]); slot <= 0 is the null
         block: a sequence whose initial slot is <= 0 is skipped (zero output, no state).
  state_indices [N] or [N, S]: token t of sequence n stores its state to column t
         (t < S) when that slot is > 0; the initial state comes from column
         num_accepted[n] - 1 (clamped to 0..S-1), or column 0 without num_accepted.
  conv_state [slots, W - 1 + k, D] in vLLM's SD layout (D innermost), weight [D, W].

Gating, as vLLM's fused recurrent computes it: g = -exp(A_log) * softplus(a + dt_bias)
(softplus(x) = x above 20), beta = sigmoid(b); q and k are L2-normalised per head with
x / sqrt(sum x^2 + 1e-6), q then scaled by `scale` (dk^-0.5 by default). Per token:
  h <- exp(g) h;  u = beta (v - h k);  h <- h + u k^T;  o = h q.

int16 state (item 3): each row h[v, :] of a head is stored as int16 codes c with one
float32 scale s per row, h ~= s c, s = max_k |h[v, k]| / 32767, c = round(h / s); an
all-zero row stores s = 0. The row error is at most s / 2 per element (1 / 65534 of the
row's largest element); state_scale is [slots, HV, dv] float32 beside the state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6
INT16_MAX = 32767
F64 = torch.float64


# ---------------------------------------------------------------- gating and norms
def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) in float64, both shaped like a [..., HV]."""
    x = a.to(F64) + dt_bias.to(F64)
    softplus = torch.where(x <= SOFTPLUS_THRESHOLD, torch.log1p(torch.exp(x)), x)
    g = -torch.exp(A_log.to(F64)) * softplus
    return g, torch.sigmoid(b.to(F64))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the last dimension, float64."""
    x = x.to(F64)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def split_qkv(
    qkv: torch.Tensor, num_k_heads: int, num_v_heads: int, dk: int, dv: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, dk], k [T, H, dk], v [T, HV, dv] views of the packed conv output."""
    t = qkv.shape[0]
    qd = num_k_heads * dk
    if qkv.shape[1] != 2 * qd + num_v_heads * dv:
        raise ValueError(
            f"qkv has {qkv.shape[1]} columns, want 2 * {num_k_heads} * {dk} + "
            f"{num_v_heads} * {dv}"
        )
    q = qkv[:, :qd].reshape(t, num_k_heads, dk)
    k = qkv[:, qd : 2 * qd].reshape(t, num_k_heads, dk)
    v = qkv[:, 2 * qd :].reshape(t, num_v_heads, dv)
    return q, k, v


class _Heads(NamedTuple):
    """What every recurrence reads of its inputs: value heads per key head, the query scale,
    q / k [T, H, dk] and v [T, HV, dv] views, and the gates g, beta [T, HV] (float64)."""

    group: int
    scale: float
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def _heads(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
           dt_bias: torch.Tensor, state: torch.Tensor, num_k_heads: int,
           scale: float | None) -> _Heads:
    """The inputs split by head and gated, for a state [slots, HV, dv, dk]; scale defaults to
    dk^-0.5."""
    num_v_heads, dv, dk = state.shape[1:]
    q, k, v = split_qkv(qkv, num_k_heads, num_v_heads, dk, dv)
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    return _Heads(num_v_heads // num_k_heads, dk**-0.5 if scale is None else scale,
                  q, k, v, g, beta)


# ---------------------------------------------------------------- int16 state rows
def state_int16_quantize(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int16 of h [..., dk]: (codes int16, scale float32 [...])."""
    f = h.to(torch.float32)
    amax = f.abs().amax(dim=-1)
    inv = torch.where(amax > 0, INT16_MAX / amax, torch.zeros_like(amax))
    codes = torch.round(f * inv.unsqueeze(-1)).clamp(-INT16_MAX, INT16_MAX).to(torch.int16)
    return codes, amax / INT16_MAX


def state_int16_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.to(F64) * scale.to(F64).unsqueeze(-1)


def _index_columns(state_indices: torch.Tensor) -> torch.Tensor:
    return state_indices.reshape(state_indices.shape[0], -1)


def _delta_step(h: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule on h [HV, dv, dk] (float64): decay, the delta
    update with normalised key kn, then the output for normalised, scaled query qn."""
    h = h * torch.exp(g).view(-1, 1, 1)
    u = beta.view(-1, 1) * (v.to(F64) - torch.einsum("hvk,hk->hv", h, kn))
    h = h + u.unsqueeze(-1) * kn.unsqueeze(1)
    return h, torch.einsum("hvk,hk->hv", h, qn)


# ---------------------------------------------------------------- recurrent decode
def gdn_recurrent_reference(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor | None,
    num_k_heads: int,
    scale: float | None = None,
    state_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, HV, dv] float64; the states of the stored tokens are written into `state`
    in place (int16 codes and `state_scale` when state is int16). Rows of out outside
    every sequence stay zero."""
    num_v_heads, dv = state.shape[1:3]
    if state.dtype == torch.int16 and state_scale is None:
        raise ValueError("an int16 state needs its state_scale [slots, HV, dv]")
    group, scale, q_all, k_all, v_all, g_all, beta_all = _heads(
        qkv, a, b, A_log, dt_bias, state, num_k_heads, scale)
    idx = _index_columns(state_indices).tolist()
    cols = len(idx[0]) if idx else 1
    starts = query_start_loc.tolist()
    out = torch.zeros(qkv.shape[0], num_v_heads, dv, dtype=F64)
    for n, row in enumerate(idx):
        bos, eos = starts[n], starts[n + 1]
        if eos <= bos:
            continue
        col0 = 0 if num_accepted is None else min(max(int(num_accepted[n]) - 1, 0), cols - 1)
        if row[col0] <= 0:
            continue  # a padding sequence: zero output, no state touched
        if state.dtype == torch.int16:
            h = state_int16_dequantize(state[row[col0]], state_scale[row[col0]])
        else:
            h = state[row[col0]].to(F64)  # [HV, dv, dk]
        for i, t in enumerate(range(bos, eos)):
            qn = l2norm(q_all[t]).repeat_interleave(group, dim=0) * scale  # [HV, dk]
            kn = l2norm(k_all[t]).repeat_interleave(group, dim=0)
            h, out[t] = _delta_step(h, qn, kn, v_all[t], g_all[t], beta_all[t])
            if i < cols and row[i] > 0:
                if state.dtype == torch.int16:
                    codes, s = state_int16_quantize(h)
                    state[row[i]] = codes
                    state_scale[row[i]] = s
                else:
                    state[row[i]] = h.to(state.dtype)
    return out


# ---------------------------------------------------------------- causal conv1d
def _conv_outputs(
    seq: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool
) -> torch.Tensor:
    """Causal depthwise conv over seq [W - 1 + L, D] (window first): [L, D] float64."""
    width = weight.shape[1]
    w = weight.to(F64)
    steps = seq.shape[0] - (width - 1)
    y = sum(seq[j : j + steps] * w[:, j] for j in range(width))
    if bias is not None:
        y = y + bias.to(F64)
    return y * torch.sigmoid(y) if silu else y


def conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """Decode-side conv (1..1+k tokens per sequence) over x [T, D]: out [T, D] float64.

    Sequence n uses conv_state[slot] (slot = state_indices column 0; <= 0 skips it) and
    reads its W - 1 previous inputs from rows off .. off + W - 2, off = num_accepted[n] - 1
    (0 without num_accepted). The state then holds, from row 0: without num_accepted the
    last W - 1 inputs; with it, every input from row off + 1 on (W - 2 + L rows, as far as
    the state has rows), so the next step's off = accepted - 1 finds its window."""
    width = weight.shape[1]
    rows = conv_state.shape[1]
    idx = _index_columns(state_indices)[:, 0].tolist()
    starts = query_start_loc.tolist()
    out = torch.zeros(x.shape, dtype=F64)
    for n, slot in enumerate(idx):
        bos, eos = starts[n], starts[n + 1]
        if eos <= bos or slot <= 0:
            continue
        off = 0
        if num_accepted is not None:
            off = min(max(int(num_accepted[n]) - 1, 0), rows - (width - 1))
        seq = torch.cat([conv_state[slot, off : off + width - 1].to(F64), x[bos:eos].to(F64)])
        out[bos:eos] = _conv_outputs(seq, weight, bias, silu)
        keep = seq[1:] if num_accepted is not None else seq[-(width - 1) :]
        keep = keep[:rows]
        conv_state[slot, : keep.shape[0]] = keep.to(conv_state.dtype)
    return out


def conv1d_prefill_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    silu: bool = True,
) -> torch.Tensor:
    """Prefill conv over varlen sequences of x [T, D]: out [T, D] float64. Sequence n
    starts from rows 0 .. W - 2 of conv_state[state_indices[n]] when has_initial_state[n]
    (else from zeros) and leaves the last W - 1 inputs there; slot <= 0 skips it."""
    width = weight.shape[1]
    idx = _index_columns(state_indices)[:, 0].tolist()
    starts = query_start_loc.tolist()
    out = torch.zeros(x.shape, dtype=F64)
    for n, slot in enumerate(idx):
        bos, eos = starts[n], starts[n + 1]
        if eos <= bos or slot <= 0:
            continue
        init = has_initial_state is not None and bool(has_initial_state[n])
        window = (conv_state[slot, : width - 1].to(F64) if init
                  else torch.zeros(width - 1, x.shape[1], dtype=F64))
        seq = torch.cat([window, x[bos:eos].to(F64)])
        out[bos:eos] = _conv_outputs(seq, weight, bias, silu)
        conv_state[slot, : width - 1] = seq[-(width - 1) :].to(conv_state.dtype)
    return out


# ---------------------------------------------------------------- chunked prefill
def _prefill_sequences(
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
) -> list[tuple[int, int, int, bool]]:
    """(bos, eos, slot, starts_from_state) of each sequence the prefill runs: an empty
    sequence or one whose slot is <= 0 (vLLM's null block) is left out."""
    idx = _index_columns(state_indices)[:, 0].tolist()
    starts = query_start_loc.tolist()
    runs = []
    for n, slot in enumerate(idx):
        bos, eos = starts[n], starts[n + 1]
        if eos > bos and slot > 0:
            init = has_initial_state is not None and bool(has_initial_state[n])
            runs.append((bos, eos, slot, init))
    return runs


def _prefill_runs(
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """_prefill_sequences with each run's initial state h [HV, dv, dk] in float64: its slot's
    state when it starts from it, else zeros. Read as each run comes up, after the earlier
    runs have written theirs."""
    for bos, eos, slot, init in _prefill_sequences(query_start_loc, state_indices,
                                                   has_initial_state):
        yield bos, eos, slot, (state[slot].to(F64) if init
                               else torch.zeros_like(state[slot], dtype=F64))


def gdn_prefill_reference(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    num_k_heads: int,
    scale: float | None = None,
) -> torch.Tensor:
    """What the chunked prefill op computes, token by token (the ground truth): out
    [T, HV, dv] float64 on qkv's device. Sequence n starts from state[state_indices[n]]
    when has_initial_state[n] (zeros otherwise, or without has_initial_state), runs the
    recurrence over its tokens and leaves its final state in that slot (float32 state).
    state_indices is [N] or [N, S] (column 0 is used); sequences with slot <= 0 or no tokens
    are skipped (zero output, no state)."""
    group, scale, q_all, k_all, v_all, g_all, beta_all = _heads(
        qkv, a, b, A_log, dt_bias, state, num_k_heads, scale)
    out = torch.zeros(qkv.shape[0], *state.shape[1:3], dtype=F64, device=qkv.device)
    for bos, eos, slot, h in _prefill_runs(state, query_start_loc, state_indices,
                                           has_initial_state):
        qn_all = l2norm(q_all[bos:eos]).repeat_interleave(group, dim=1) * scale
        kn_all = l2norm(k_all[bos:eos]).repeat_interleave(group, dim=1)
        for i, t in enumerate(range(bos, eos)):
            h, out[t] = _delta_step(h, qn_all[i], kn_all[i], v_all[t], g_all[t], beta_all[t])
        state[slot] = h.to(state.dtype)
    return out


def gdn_chunk_reference(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    num_k_heads: int,
    scale: float | None = None,
    chunk: int = 64,
) -> torch.Tensor:
    """gdn_prefill_reference computed the way csrc/gdn/chunk_prefill.cuh does, chunk by
    chunk in the WY form (float64), so a CPU test pins the algebra the kernel relies on.

    Per chunk of L tokens with G_i = sum_{j <= i} g_j (within the chunk) and state H [dk, dv]
    (= h^T): A = strictly-lower (diag(beta) K K^T * exp(G_i - G_j)), T = (I + A)^-1,
    W = T diag(beta exp(G)) K, U = T diag(beta) V; then V' = U - W H,
    O = diag(exp(G)) Q H + (Q K^T * exp(G_i - G_j), j <= i) V',
    H <- exp(G_last) H + K^T diag(exp(G_last - G_j)) V'."""
    group, scale, q_all, k_all, v_all, g_all, beta_all = _heads(
        qkv, a, b, A_log, dt_bias, state, num_k_heads, scale)
    out = torch.zeros(qkv.shape[0], *state.shape[1:3], dtype=F64, device=qkv.device)
    for bos, eos, slot, h in _prefill_runs(state, query_start_loc, state_indices,
                                           has_initial_state):
        hs = h.transpose(1, 2)  # [HV, dk, dv]
        for c0 in range(bos, eos, chunk):
            c1 = min(c0 + chunk, eos)
            n = c1 - c0
            q = (l2norm(q_all[c0:c1]) * scale).repeat_interleave(group, dim=1).transpose(0, 1)
            k = l2norm(k_all[c0:c1]).repeat_interleave(group, dim=1).transpose(0, 1)
            v = v_all[c0:c1].to(F64).transpose(0, 1)  # [HV, n, dv]
            gc = g_all[c0:c1].transpose(0, 1).cumsum(-1)  # [HV, n]
            beta = beta_all[c0:c1].transpose(0, 1)
            ratio = torch.exp(gc.unsqueeze(-1) - gc.unsqueeze(-2))  # [HV, i, j]
            lower = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device), -1)
            causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
            kk = (k @ k.transpose(1, 2)) * ratio * beta.unsqueeze(-1)
            eye = torch.eye(n, dtype=F64, device=q.device)
            t_inv = torch.linalg.inv(eye + torch.where(lower, kk, torch.zeros_like(kk)))
            w = t_inv @ (k * (beta * torch.exp(gc)).unsqueeze(-1))
            u = t_inv @ (v * beta.unsqueeze(-1))
            v_new = u - w @ hs
            qk = torch.where(causal, (q @ k.transpose(1, 2)) * ratio, torch.zeros_like(kk))
            o = torch.exp(gc).unsqueeze(-1) * (q @ hs) + qk @ v_new
            out[c0:c1] = o.transpose(0, 1)
            tail = torch.exp(gc[:, -1:] - gc).unsqueeze(-1)  # [HV, n, 1]
            hs = torch.exp(gc[:, -1]).view(-1, 1, 1) * hs + k.transpose(1, 2) @ (tail * v_new)
        state[slot] = hs.transpose(1, 2).to(state.dtype)
    return out
