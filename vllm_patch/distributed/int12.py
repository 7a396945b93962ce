"""The 12-bit exchange format of the two-GPU all-reduce, in plain PyTorch (the reference the
CUDA kernels in csrc/allreduce/ must match bit for bit).

Format ("fp16 with six mantissa bits", 1 sign + 5 exponent + 6 mantissa bits): the code of an
fp16 value is its 16-bit pattern rounded to nearest, ties to even, at bit 4 and shifted right
by 4, so decoding is `code << 4`. fp16's exponent, bias and subnormals carry over unchanged.
- finite values: rounded as above; a finite value that would round to infinity (|x| above
  65280) saturates to the largest finite code (65024), so a finite sum never turns into inf
  through the exchange alone;
- +-0 keep their sign; +-inf stay +-inf; every NaN becomes the quiet NaN of its sign (a NaN
  whose payload sits in the four dropped bits would otherwise round to inf).
- Two codes fill three bytes, little-endian: value 2i in the low 12 bits of the 24-bit
  group, value 2i+1 in the high 12; a GPU thread's 8 values are thus three little-endian
  32-bit words (the same byte stream).

Why this and not a per-block scale with 12-bit integers: the error of each value is relative
to itself (2^-7), not to the largest value of its block, so the outlier channels of an LLM's
hidden state cost the other values nothing; no scale travels, no block maximum is reduced
before packing, and packing is a few integer operations per value.

Error bound (docs/allreduce.md): per value |Q(x) - x| <= max(2^-7 |x|, 2^-21); for the
all-reduce of two fp16 inputs, out = fp16(float(Q(a)) + float(Q(b))), whenever out is finite:
    |out - (a + b)| <= (2^-7 + 2^-10) (|a| + |b|) + 2^-19.
Both ranks compute Q(own) + Q(peer) (their own value quantised too), so the two results are
bitwise equal. The fp16 all-reduce is fp16(float(a) + float(b)): the correctly rounded sum
(float32 holds 2 x 11 + 2 bits, so rounding twice equals rounding once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DROP_BITS = 4  # fp16 mantissa bits the code drops
CODE_BITS = 12
MAX_FINITE_CODE = 0x7BF  # 65024
INF_CODE = 0x7C0
NAN_CODE = 0x7E0  # quiet NaN
SIGN_BIT = 0x800
PACK_GROUP = 8  # values per GPU thread (three 32-bit words); the kernels need n % 8 == 0
# The stated bound, as (relative to |a| + |b|, absolute) for a sum of two values.
SUM_REL_BOUND = 2.0**-7 + 2.0**-10
SUM_ABS_BOUND = 2.0**-19
VALUE_REL_BOUND = 2.0**-7
VALUE_ABS_BOUND = 2.0**-21


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float16:
        raise ValueError(f"the 12-bit exchange packs float16, got {x.dtype}")
    return x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def encode(x: torch.Tensor) -> torch.Tensor:
    """fp16 -> 12-bit codes (int32 in 0..4095), same shape."""
    h = _bits(x)
    sign = (h >> DROP_BITS) & SIGN_BIT
    mag = h & 0x7FFF
    lsb = (mag >> DROP_BITS) & 1
    rounded = (mag + ((1 << (DROP_BITS - 1)) - 1) + lsb) >> DROP_BITS
    rounded = torch.clamp(rounded, max=MAX_FINITE_CODE)
    rounded = torch.where(mag == 0x7C00, torch.full_like(mag, INF_CODE), rounded)
    rounded = torch.where(mag > 0x7C00, torch.full_like(mag, NAN_CODE), rounded)
    return sign | rounded


def decode(codes: torch.Tensor) -> torch.Tensor:
    """12-bit codes -> fp16 (exact: the code is the top 12 bits of the fp16 pattern)."""
    h = (codes.to(torch.int32) & 0xFFF) << DROP_BITS
    h = torch.where(h >= 0x8000, h - 0x10000, h)
    return h.to(torch.int16).view(torch.float16)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Q(x): what the peer sees of x after the exchange."""
    return decode(encode(x))


def packed_bytes(n: int) -> int:
    """Bytes of n packed values (n even)."""
    if n < 0 or n % 2:
        raise ValueError(f"the 12-bit format packs an even number of values, got {n}")
    return n * 3 // 2


def pack(x: torch.Tensor) -> torch.Tensor:
    """fp16 [n] (n even; any shape, flattened) -> uint8 [3n/2], two codes per three bytes."""
    flat = x.reshape(-1)
    packed_bytes(flat.numel())
    c = encode(flat).reshape(-1, 2)
    v = c[:, 0] | (c[:, 1] << CODE_BITS)
    out = torch.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], dim=1)
    return out.reshape(-1).to(torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [3n/2] -> fp16 [n] (inverse of pack on the codes)."""
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() % 3:
        raise ValueError("packed must be a 1-D uint8 tensor of a multiple of 3 bytes")
    b = packed.to(torch.int32).reshape(-1, 3)
    v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    codes = torch.stack([v & 0xFFF, (v >> CODE_BITS) & 0xFFF], dim=1).reshape(-1)
    return decode(codes)


def _sum(terms: Sequence[torch.Tensor]) -> torch.Tensor:
    # Not the builtin sum: its integer 0 start would turn -0 + -0 into +0.
    if not terms:
        raise ValueError("an all-reduce needs at least one input")
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def all_reduce_int12(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """What every rank of the 12-bit all-reduce returns: fp16(sum of float(Q(x_r)))."""
    total = _sum([quantize(x).float() for x in inputs])
    return total.to(torch.float16)


def all_reduce_fp16(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """What every rank of the fp16 all-reduce returns: the float32 sum rounded to fp16."""
    total = _sum([x.float() for x in inputs])
    return total.to(torch.float16)


def sum_error_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The stated bound on |all_reduce_int12([a, b]) - (a + b)| (float64, elementwise)."""
    return SUM_REL_BOUND * (a.double().abs() + b.double().abs()) + SUM_ABS_BOUND
