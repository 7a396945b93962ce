"""The 12-bit exchange format (vllm_patch/distributed/int12.py) against an independent
checker written from the format's description, on every one of the 65,536 fp16 patterns.

The checker here decodes with `struct` and finds each value's nearest 12-bit neighbour by
comparing distances (not by the reference's integer rounding trick); sums are computed in
Python floats, exact for two fp16 values, and rounded to fp16 once. The reference runs in a
child with torch (this interpreter if it has torch, else the serving environment
.serve-venv); without either the test skips, except under CI=true, where it fails.
Each plausible bug in MUTANTS (a wrong shift, an off-by-one rounding bias or saturation
code, a lost NaN rule, asymmetric quantisation) is applied to the reference's source in the
child and must make the checker report a problem.
"""

from __future__ import annotations

import math
import random
import struct
from pathlib import Path

import pytest
from serve_venv import run_json

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "vllm_patch" / "distributed" / "int12.py"

# (name, old source text, new source text): each must occur exactly once in the reference.
MUTANTS: tuple[tuple[str, str, str], ...] = (
    ("pack-shift", "(c[:, 1] << CODE_BITS)", "(c[:, 1] << 8)"),
    ("unpack-shift", "(v >> CODE_BITS) & 0xFFF", "(v >> 11) & 0xFFF"),
    ("drop-5-bits", "DROP_BITS = 4 ", "DROP_BITS = 5 "),
    ("round-bias-off-by-one", "((1 << (DROP_BITS - 1)) - 1) + lsb", "(1 << (DROP_BITS - 1)) + lsb"),
    ("ties-not-even", "((1 << (DROP_BITS - 1)) - 1) + lsb", "((1 << (DROP_BITS - 1)) - 1)"),
    ("saturate-to-inf", "MAX_FINITE_CODE = 0x7BF", "MAX_FINITE_CODE = 0x7C0"),
    ("nan-rule-lost", "torch.where(mag > 0x7C00,", "torch.where(mag > 0x7FFF,"),
    ("own-value-unquantised", "_sum([quantize(x).float() for x in inputs])",
     "_sum([inputs[0].float()] + [quantize(x).float() for x in inputs[1:]])"),
    ("fp16-path-quantises", "_sum([x.float() for x in inputs])",
     "_sum([quantize(x).float() for x in inputs])"),
)

PROBE = r"""
import json, sys, types
import torch
req = json.load(sys.stdin)
text = open(req["reference"]).read()
results = []
for mutant in req["mutants"]:
    src = text
    if mutant is not None:
        assert src.count(mutant[0]) == 1, mutant
        src = src.replace(mutant[0], mutant[1])
    mod = types.ModuleType("int12_under_test")
    exec(compile(src, "int12.py", "exec"), mod.__dict__)
    def h(bits):
        t = torch.tensor(bits, dtype=torch.int32)
        t = torch.where(t >= 0x8000, t - 0x10000, t)
        return t.to(torch.int16).view(torch.float16)
    def b(x):
        return (x.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    every = h(list(range(65536)))
    a, c = h(req["a"]), h(req["b"])
    results.append({
        "codes": mod.encode(every).tolist(),
        "decoded": b(mod.decode(torch.tensor(req["codes"], dtype=torch.int32))),
        "packed": mod.pack(h(req["stream"])).tolist(),
        "unpacked": b(mod.unpack(torch.tensor(req["bytes"], dtype=torch.uint8))),
        "sum12": b(mod.all_reduce_int12([a, c])),
        "sum12_swapped": b(mod.all_reduce_int12([c, a])),
        "sum16": b(mod.all_reduce_fp16([a, c])),
        "bound": mod.sum_error_bound(a, c).tolist(),
    })
json.dump(results, sys.stdout)
"""


# ------------------------------------------------------------------ the independent checker
def f16(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def is_nan_bits(bits: int) -> bool:
    return (bits & 0x7C00) == 0x7C00 and (bits & 0x3FF) != 0


def round_f16(value: float) -> int:
    """The fp16 pattern nearest to `value` (ties to even; past the largest finite, inf)."""
    if math.isnan(value):
        return 0x7E00
    if abs(value) >= 65520.0:  # halfway between 65504 and the next binade's 65536
        return 0xFC00 if value < 0 else 0x7C00
    return struct.unpack("<H", struct.pack("<e", value))[0]


def expected_code(bits: int) -> int:
    """The format's rule, from its description: nearest 12-bit value (a pattern whose low
    four bits are zero), ties to the even code; finite saturates; inf and NaN kept."""
    sign, mag = bits & 0x8000, bits & 0x7FFF
    if mag > 0x7C00:
        return (sign >> 4) | 0x7E0
    if mag == 0x7C00:
        return (sign >> 4) | 0x7C0
    lo = mag & 0x7FF0
    hi = lo + 0x10
    x = f16(mag)
    dlo, dhi = x - f16(lo), f16(hi) - x  # exact: fp16 differences fit in a double
    pick = lo if dlo < dhi else hi if dhi < dlo else (lo if (lo >> 4) % 2 == 0 else hi)
    if pick >= 0x7C00:
        pick = 0x7BF0
    return (sign >> 4) | (pick >> 4)


def value_problems(codes: list[int]) -> list[str]:
    out = []
    for bits, code in enumerate(codes):
        want = expected_code(bits)
        if code != want:
            out.append(f"encode({bits:#06x}) = {code:#05x}, expected {want:#05x}")
            continue
        x, q = f16(bits), f16(code << 4)
        if math.isfinite(x):
            if not math.isfinite(q) or abs(q - x) > max(2**-7 * abs(x), 2**-21):
                out.append(f"encode({bits:#06x}): |Q(x) - x| = {abs(q - x)} above the bound")
            if x == 0 and math.copysign(1, q) != math.copysign(1, x):
                out.append(f"encode({bits:#06x}): the sign of zero is lost")
    return out


def stream_bytes(codes: list[int]) -> list[int]:
    out = []
    for i in range(0, len(codes), 2):
        c0, c1 = codes[i], codes[i + 1]
        out += [c0 & 0xFF, (c0 >> 8) | ((c1 & 0xF) << 4), c1 >> 4]
    return out


def sum_problems(a: list[int], b: list[int], got: dict) -> list[str]:
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        qa, qb = f16(expected_code(x) << 4), f16(expected_code(y) << 4)
        want12 = round_f16(qa + qb)  # exact in a double, rounded once
        if got["sum12"][i] != want12 and not (is_nan_bits(want12) and is_nan_bits(got["sum12"][i])):
            out.append(f"int12 sum of {x:#06x} + {y:#06x} = {got['sum12'][i]:#06x}, "
                       f"expected {want12:#06x}")
        if got["sum12_swapped"][i] != got["sum12"][i] and not (
            is_nan_bits(got["sum12"][i]) and is_nan_bits(got["sum12_swapped"][i])
        ):
            out.append(f"int12 sum of {x:#06x} + {y:#06x} depends on the rank order")
        s = f16(got["sum12"][i])
        exact = f16(x) + f16(y)
        if math.isfinite(s) and math.isfinite(exact):
            err = abs(s - exact)
            bound = (2**-7 + 2**-10) * (abs(f16(x)) + abs(f16(y))) + 2**-19
            if err > bound or err > got["bound"][i]:
                out.append(f"int12 sum of {x:#06x} + {y:#06x}: error {err} above the bound")
        want16 = round_f16(exact) if not (math.isnan(exact)) else 0x7E00
        g16 = got["sum16"][i]
        if g16 != want16 and not (is_nan_bits(want16) and is_nan_bits(g16)):
            out.append(f"fp16 sum of {x:#06x} + {y:#06x} = {g16:#06x}, not the correctly "
                       f"rounded {want16:#06x}")
    return out


def problems(req: dict, got: dict) -> list[str]:
    found = value_problems(got["codes"])
    # decoding is the top 12 bits of the pattern: exact for every code
    want = [c << 4 for c in req["codes"]]
    if got["decoded"] != want:
        found.append("decode is not code << 4")
    stream_codes = [expected_code(x) for x in req["stream"]]
    if got["packed"] != stream_bytes(stream_codes):
        found.append("pack does not lay two codes in three little-endian bytes")
    byte_codes = []
    for i in range(0, len(req["bytes"]), 3):
        v = req["bytes"][i] | (req["bytes"][i + 1] << 8) | (req["bytes"][i + 2] << 16)
        byte_codes += [v & 0xFFF, v >> 12]
    if got["unpacked"] != [c << 4 for c in byte_codes]:
        found.append("unpack does not read two codes from three little-endian bytes")
    return found + sum_problems(req["a"], req["b"], got)


# ------------------------------------------------------------------ the request and the run
EDGES = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x0008, 0x0018, 0x3C00, 0x3C08,
         0x3C18, 0x3C17, 0x3C09, 0x7BFF, 0xFBFF, 0x7BF7, 0x7BF8, 0x7BE8, 0x7C00, 0xFC00,
         0x7E00, 0x7C01, 0xFC05, 0x7FFF]


def request(mutants: list) -> dict:
    rng = random.Random(26)
    a = [rng.randrange(65536) for _ in range(6000)]
    b = [rng.randrange(65536) for _ in range(6000)]
    # same-magnitude pairs (cancellation) and activation-sized values
    for _ in range(3000):
        x = rng.randrange(0x2000, 0x5800)
        a.append(x)
        b.append(x ^ 0x8000 if rng.random() < 0.5 else (x + rng.randrange(-64, 64)) & 0xFFFF)
    for x in EDGES:
        for y in EDGES:
            a.append(x)
            b.append(y)
    stream = [rng.randrange(65536) for _ in range(64)] + EDGES
    return {
        "reference": str(REFERENCE),
        "mutants": mutants,
        "codes": list(range(4096)),
        "stream": stream,
        "bytes": [rng.randrange(256) for _ in range(96)],
        "a": a,
        "b": b,
    }


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    req = request([None] + [[old, new] for _, old, new in MUTANTS])
    return req, run_json(["-c", PROBE], req, timeout=600)


def test_the_checker_reads_fp16_right() -> None:
    assert f16(0x3C00) == 1.0 and f16(0x7BFF) == 65504.0 and f16(0x0001) == 2.0**-24
    assert expected_code(0x3C08) == 0x3C0  # 1 + 2^-7 is a tie: to the even code
    assert expected_code(0x3C18) == 0x3C2  # 1 + 3 * 2^-7: a tie, up to the even code
    assert expected_code(0x7BFF) == 0x7BF  # 65504 saturates instead of becoming inf
    assert expected_code(0x7C01) == 0x7E0  # a NaN stays NaN
    assert round_f16(65519.0) == 0x7BFF and round_f16(65520.0) == 0x7C00


def test_reference_meets_the_format_and_the_bound(runs) -> None:
    req, got = runs
    assert problems(req, got[0]) == []


def test_values_of_twelve_bits_round_trip_exactly(runs) -> None:
    _, got = runs
    codes = got[0]["codes"]
    for code in range(4096):
        bits = code << 4
        if not is_nan_bits(bits):
            assert codes[bits] == code, hex(bits)
    # small integers and powers of two are exact
    for k in list(range(-128, 129)) + [2.0**e for e in range(-14, 16)]:
        bits = struct.unpack("<H", struct.pack("<e", float(k)))[0]
        assert codes[bits] << 4 == bits, k


def test_zero_inf_nan_and_subnormals(runs) -> None:
    _, got = runs
    codes = got[0]["codes"]
    assert codes[0x0000] == 0x000 and codes[0x8000] == 0x800
    assert codes[0x7C00] == 0x7C0 and codes[0xFC00] == 0xFC0
    assert all(codes[b] in (0x7E0, 0xFE0) for b in range(65536) if is_nan_bits(b))
    assert codes[0x7BFF] == 0x7BF and codes[0xFBFF] == 0xFBF  # +-65504 -> +-65024
    assert codes[0x0007] == 0 and codes[0x0008] == 0 and codes[0x0009] == 1  # 2^-21 tie
    assert codes[0x03FF] == 0x040  # the largest subnormal rounds up to the smallest normal


@pytest.mark.parametrize("index", range(len(MUTANTS)), ids=[m[0] for m in MUTANTS])
def test_a_plausible_bug_is_caught(runs, index: int) -> None:
    req, got = runs
    assert problems(req, got[index + 1]) != [], MUTANTS[index][0]
