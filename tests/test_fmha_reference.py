"""The chunked-prefill attention reference (vllm_patch.ops.reference_fmha) against a naive
loop written here from the op's contract, scalar by scalar in Python floats.

The cache is a page layout (K, V, then their scales inside one buffer per block, padded),
filled here by (block, token, head) so the loop reads values directly while the reference
goes through the strides. The reference runs in a child with torch (tests/serve_venv.py).
"""

from __future__ import annotations

import math
import random
import struct

from serve_venv import run_json

D = 256
HQ, HKV = 4, 2  # GQA 2:1
BS = 4  # block size
CTXS = [5, 0]  # sequence 0: context across two blocks, not block-aligned; sequence 1: none
QLENS = [3, 2]
NB = 4
SM_SCALE = 1 / 16

CHILD = r"""
import json, sys, torch
from vllm_patch.ops import reference_fmha as ref
req = json.load(sys.stdin)
t = lambda x, dt: torch.tensor(x, dtype=dt)
buf = t(req["page_bytes"], torch.int8)
q, k, v = (t(req[n], torch.float16) for n in ("q", "k", "v"))
kc, vc = buf[req["k_off"]:], buf[req["v_off"]:]
fl = buf.view(torch.float32)
ks, vs = fl[req["ks_off"]:], fl[req["vs_off"]:]
out = ref.fmha_prefill_reference(
    q, k, v, kc, vc, ks, vs, req["cs"], req["ss"], t(req["table"], torch.int32),
    t(req["qsl"], torch.int32), t(req["ctxs"], torch.int32), req["bs"], req["sm_scale"])
codes, scale = ref.quantize_per_token_head(t(req["qrow"], torch.float32))
print(json.dumps({"out": out.tolist(), "codes": codes.tolist(), "scale": float(scale),
                  "zero_scale": float(ref.quantize_per_token_head(torch.zeros(1, 8))[1][0]),
                  "flops": ref.attention_flops(req["qlens"], req["ctxs"], 24)}))
"""


def half_exact(rng: random.Random) -> float:
    return rng.randint(-64, 64) / 32  # exact in fp16


def build(rng: random.Random) -> tuple[dict, dict]:
    kv = BS * HKV * D  # K bytes per page
    scale_floats = BS * HKV
    page = (2 * kv + 8 * scale_floats + 32 + 15) // 16 * 16
    mem = bytearray(NB * page)
    floats: dict[int, float] = {}  # float index -> value (written into mem below)
    cache = {}  # (blk, tok, head) -> (k values, v values) dequantised
    for blk in range(NB):
        for tok in range(BS):
            for h in range(HKV):
                kcodes = [rng.randint(-127, 127) for _ in range(D)]
                vcodes = [rng.randint(-127, 127) for _ in range(D)]
                kscale, vscale = rng.randint(1, 64) / 1024, rng.randint(1, 64) / 1024
                base = blk * page + (tok * HKV + h) * D
                mem[base : base + D] = bytes(c & 0xFF for c in kcodes)
                mem[base + kv : base + kv + D] = bytes(c & 0xFF for c in vcodes)
                s0 = (blk * page + 2 * kv) // 4 + tok * HKV + h
                floats[s0] = kscale
                floats[s0 + scale_floats] = vscale
                cache[blk, tok, h] = ([c * kscale for c in kcodes], [c * vscale for c in vcodes])
    for idx, val in floats.items():
        mem[4 * idx : 4 * idx + 4] = struct.pack("<f", val)
    signed = [b - 256 if b > 127 else b for b in mem]
    tokens = sum(QLENS)
    req = {
        "page_bytes": signed,
        "k_off": 0,
        "v_off": kv,
        "ks_off": 2 * kv // 4,
        "vs_off": 2 * kv // 4 + scale_floats,
        "cs": [page, HKV * D, D],
        "ss": [page // 4, HKV, 1],
        "table": [[2, 0], [3, 1]],
        "qsl": [0, QLENS[0], tokens],
        "ctxs": CTXS,
        "qlens": QLENS,
        "bs": BS,
        "sm_scale": SM_SCALE,
        "q": [[[half_exact(rng) for _ in range(D)] for _ in range(HQ)] for _ in range(tokens)],
        "k": [[[half_exact(rng) for _ in range(D)] for _ in range(HKV)] for _ in range(tokens)],
        "v": [[[half_exact(rng) for _ in range(D)] for _ in range(HKV)] for _ in range(tokens)],
        "qrow": [0.5, -1.0, 0.25, 2.0, 0.0, -0.75, 1.5, 0.125],
    }
    return req, cache


def naive(req: dict, cache: dict) -> list:
    out = []
    group = HQ // HKV
    for b, (ctx, n) in enumerate(zip(req["ctxs"], req["qlens"], strict=True)):
        q0 = req["qsl"][b]
        for i in range(n):
            row = []
            for h in range(HQ):
                kvh = h // group
                keys, vals = [], []
                for j in range(ctx + i + 1):  # causal: positions 0 .. ctx + i
                    if j < ctx:
                        kk, vv = cache[req["table"][b][j // BS], j % BS, kvh]
                    else:
                        kk, vv = req["k"][q0 + j - ctx][kvh], req["v"][q0 + j - ctx][kvh]
                    keys.append(kk)
                    vals.append(vv)
                qv = req["q"][q0 + i][h]
                s = [SM_SCALE * sum(a * c for a, c in zip(qv, kk, strict=True)) for kk in keys]
                m = max(s)
                e = [math.exp(x - m) for x in s]
                tot = sum(e)
                row.append([sum(e[j] * vals[j][d] for j in range(len(e))) / tot
                            for d in range(D)])
            out.append(row)
    return out


def test_reference_matches_the_naive_loop():
    req, cache = build(random.Random(7))
    got = run_json(["-c", CHILD], req, timeout=300)
    want = naive(req, cache)
    worst = max(abs(a - b) for gt, wt in zip(got["out"], want, strict=True)
                for gh, wh in zip(gt, wt, strict=True) for a, b in zip(gh, wh, strict=True))
    assert worst < 1e-9, worst
    # the quantiser: scale max|x| / 127, codes round(x / scale); an all-zero row scale 0
    assert abs(got["scale"] - 2.0 / 127) < 1e-7
    assert got["codes"] == [round(x * 127 / 2.0) for x in req["qrow"]]  # exact products
    assert got["zero_scale"] == 0.0
    keys = sum(n * c + n * (n + 1) // 2 for n, c in zip(QLENS, CTXS, strict=True))
    assert got["flops"] == 4 * D * 24 * keys


def test_naive_loop_sees_the_mask_and_the_context():
    """The comparison can fail: a reference one key long, or without its context, differs
    from the loop by far more than the bound above (checked on the loop itself)."""
    req, cache = build(random.Random(7))
    want = naive(req, cache)
    no_ctx = dict(req, ctxs=[0, 0])
    assert abs(naive(no_ctx, cache)[0][0][0] - want[0][0][0]) > 1e-3
    # row 1 of sequence 1 (no context) with only its first key: a mask one key short
    first_only = req["v"][QLENS[0]][0][0]
    assert abs(want[QLENS[0] + 1][0][0] - first_only) > 1e-3
