"""The FMHA prefill kernel's dynamic shared memory: variants.FMHA_SMEM / FMHA_SMEM_H200 (what
the limit check adds to the static figure) are the header's kFmSmemBytes / kFm16SmemBytes,
recomputed from its constexpr constants, and within Volta's 96 KB per block."""

from __future__ import annotations

import re
from pathlib import Path

from sm70ctl.kernels import variants

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "attention" / "fmha_prefill.cuh"


def header_constants(text: str) -> dict[str, int]:
    """The `constexpr int kFm... = expr;` constants of the header, evaluated in order (pure:
    integer arithmetic on earlier constants only)."""
    env: dict[str, int] = {}
    for name, expr in re.findall(r"constexpr int (kFm\w+) =\s*([^;]+);", text, re.S):
        expr = re.sub(r"//[^\n]*", "", expr).replace("\n", " ")
        if not re.fullmatch(r"[\w\s+*/()-]+", expr):
            raise ValueError(f"{name}: unexpected expression {expr!r}")
        env[name] = int(eval(expr, {"__builtins__": {}}, dict(env)))
    return env


def test_header_constants_parse_an_expression_over_earlier_ones():
    text = "constexpr int kFmA = 4;\nconstexpr int kFmB = 2 * kFmA +  // why\n    1;\n"
    assert header_constants(text) == {"kFmA": 4, "kFmB": 9}


def test_variants_carry_the_headers_dynamic_shared_memory():
    consts = header_constants(HEADER.read_text())
    volta, h200 = consts["kFmSmemBytes"], consts["kFm16SmemBytes"]
    assert variants.FMHA_SMEM == volta <= 96 * 1024
    assert variants.FMHA_SMEM_H200 == h200 <= 96 * 1024
    want = {f"sm70::fmha_prefill_kernel<{variants.VOLTA}>": volta,
            f"sm70::fmha_prefill_kernel<{variants.H200}>": h200}
    got = {v.expr: v.dynamic_smem for v in variants.VARIANTS + variants.H200_VARIANTS
           if v.expr.startswith("sm70::fmha_prefill_kernel")}
    assert got == want
