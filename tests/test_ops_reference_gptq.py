"""The reference's GPTQ int8 packing, unpacking and repack against an independent decoder.

The decoder here is written from the checkpoint format's description (GPTQ int8, desc_act
false), byte by byte with `struct`, not from vllm_patch.ops.reference:
- qweight [K/4, N] int32: the four bytes of qweight[i, n], least significant first, are the
  codes of rows 4i, 4i+1, 4i+2, 4i+3 of column n;
- qzeros [K/G, N/4] int32: the four bytes of qzeros[g, j], least significant first, are the
  stored zeros of columns 4j .. 4j+3 in group g; the zero is stored + zero_offset (1 for the
  classic checkpoints, which store zero - 1);
- scales [K/G, N] fp16; row k belongs to group k // G;
- w[k, n] = scale[g, n] * (code[k, n] - zero[g, n]).
The reference runs in a child with torch: this interpreter if it has torch, else the serving
environment CI builds (.serve-venv, .ci/setup.d/20-serve-env.sh); without either the test
skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest
from serve_venv import run_json

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "ops_reference_probe.py"
K, N, G = 256, 12, 64


def word(four: list[int]) -> int:
    """The signed int32 whose little-endian bytes are `four`."""
    return struct.unpack("<i", bytes(four))[0]


def word_bytes(value: int) -> list[int]:
    return list(struct.pack("<i", value))


def decode_qweight(qweight: list[list[int]]) -> list[list[int]]:
    codes = [[0] * N for _ in range(K)]
    for i, row in enumerate(qweight):
        for n, value in enumerate(row):
            for j, b in enumerate(word_bytes(value)):
                codes[4 * i + j][n] = b
    return codes


def decode_qzeros(qzeros: list[list[int]]) -> list[list[int]]:
    stored = [[0] * N for _ in range(K // G)]
    for g, row in enumerate(qzeros):
        for jj, value in enumerate(row):
            for j, b in enumerate(word_bytes(value)):
                stored[g][4 * jj + j] = b
    return stored


def checkpoint(seed: int, zero_offset: int) -> dict:
    rng = random.Random(seed)
    codes = [[rng.randrange(256) for _ in range(N)] for _ in range(K)]
    # zeros the format can store (stored = zero - offset in 0..255), extremes included
    zeros = [[rng.randrange(zero_offset, 256 + zero_offset) for _ in range(N)]
             for _ in range(K // G)]
    zeros[0][0], zeros[-1][-1] = zero_offset, 255 + zero_offset
    # scales exact in fp16 (k / 2^14), so every product below is exact in float32
    scales = [[rng.randrange(1, 2048) / 2**14 for _ in range(N)] for _ in range(K // G)]
    qweight = [[word([codes[4 * i + j][n] for j in range(4)]) for n in range(N)]
               for i in range(K // 4)]
    qzeros = [[word([zeros[g][4 * jj + j] - zero_offset for j in range(4)])
               for jj in range(N // 4)] for g in range(K // G)]
    lm_head = [[rng.uniform(-0.05, 0.05) for _ in range(K)] for _ in range(N)]
    lm_head[3] = [0.0] * K  # an all-zero row keeps a usable scale
    return {"k": K, "n": N, "group": G, "zero_offset": zero_offset, "codes": codes,
            "zeros": zeros, "scales": scales, "qweight": qweight, "qzeros": qzeros,
            "lm_head": lm_head}


def run_reference(req: dict) -> dict:
    return run_json([str(PROBE)], req, timeout=300)


@pytest.fixture(scope="module", params=[1, 0], ids=["v1-offset-1", "offset-0"])
def case(request: pytest.FixtureRequest) -> tuple[dict, dict]:
    req = checkpoint(20 + request.param, request.param)
    return req, run_reference(req)


def test_pack_writes_the_format(case) -> None:
    req, got = case
    assert got["dtypes"] == ["torch.int32", "torch.int32"]
    assert got["qweight"] == req["qweight"]
    assert got["qzeros"] == req["qzeros"]
    # and the independent decoder reads back what went in
    assert decode_qweight(got["qweight"]) == req["codes"]
    off = req["zero_offset"]
    assert [[z + off for z in row] for row in decode_qzeros(got["qzeros"])] == req["zeros"]


def test_dequant_follows_the_format(case) -> None:
    req, got = case
    codes = decode_qweight(req["qweight"])
    stored = decode_qzeros(req["qzeros"])
    off = req["zero_offset"]
    for k in range(K):
        g = k // G
        want = [req["scales"][g][n] * (codes[k][n] - (stored[g][n] + off)) for n in range(N)]
        assert got["w"][k] == want, k


def test_repack_is_output_major_with_scale_and_zero_side_by_side(case) -> None:
    req, got = case
    codes = decode_qweight(req["qweight"])
    stored = decode_qzeros(req["qzeros"])
    off = req["zero_offset"]
    assert got["sz_dtype"] == "torch.float16"
    assert got["qw"] == [[codes[k][n] for k in range(K)] for n in range(N)]
    assert got["sz"] == [[[req["scales"][g][n], float(stored[g][n] + off)]
                          for g in range(K // G)] for n in range(N)]


def test_lm_head_int8_is_symmetric_per_row_with_zero_128(case) -> None:
    req, got = case
    assert got["lm_group"] == K
    for n, row in enumerate(req["lm_head"]):
        (scale, zero), = got["lm_sz"][n]
        assert zero == 128.0
        amax = max(abs(float(v)) for v in row)
        if amax == 0:
            assert scale == 1.0 and set(got["lm_qw"][n]) == {128}
            continue
        assert abs(scale - amax / 127) <= amax / 127 * 2**-10  # fp16 scale
        assert min(got["lm_qw"][n]) >= 1 and max(got["lm_qw"][n]) <= 255
        # each weight within half a step (plus the fp16 rounding of the input and the scale)
        for v, back in zip(row, got["lm_dequant"][n], strict=True):
            assert abs(back - v) <= 0.5 * scale + 2**-10 * abs(v) + 1e-6
