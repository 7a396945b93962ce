"""Error of the packed-half GEMV arithmetic (gptq_gemv at M = 1, the streamed kernel), emulated
on the CPU with torch's fp16 rounding, against a float64 reference.

    .serve-venv/bin/python bench/emulate_gemv_half2_error.py --trials 300

The kernel per 16-code chunk: v = (q - z) / 256 exactly in fp16; four half2 chains, each a
product then a fused multiply-add (two fp16 roundings); the chain pairs added in fp16; the
two float sums times 256 * scale into the fp32 accumulator. This script repeats those
roundings in that order for one output row and reports, per (K, group size): the relative
error per output (median, p99, max), the share above 2e-3, and the worst constant c in
|y - want| <= u |want| + c u sum |x w| (u = 2^-11), the bound the GPU tests check with c = 2.
Measured here, not on a GPU: the GPU's HFMA2 rounds the same way (IEEE fp16, round to nearest).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

U = 2.0**-11


def h2_row(x: torch.Tensor, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g: int) -> float:
    """One output of the M = 1 kernel (without bias), emulated."""
    def r16(t: torch.Tensor) -> torch.Tensor:
        return t.half().float()

    acc = torch.zeros((), dtype=torch.float32)
    for c in range(x.numel() // 16):
        xs = x[16 * c : 16 * c + 16].float()
        grp = (16 * c) // g
        v = r16((q[16 * c : 16 * c + 16].float() - z[grp]) / 256)  # exact
        pa: list[torch.Tensor] = [torch.zeros(2)] * 4
        for qq in range(4):  # bytes 4qq..4qq+3 of the chunk: two half2
            for h in range(2):
                i0, idx = 4 * qq + 2 * h, 2 * (qq % 2) + h
                prod = v[i0 : i0 + 2] * xs[i0 : i0 + 2]
                pa[idx] = r16(prod) if qq < 2 else r16(prod + pa[idx])
        f0, f1 = r16(pa[0] + pa[1]), r16(pa[2] + pa[3])
        acc = acc + s[grp] * 256 * ((f0[0] + f0[1]) + (f1[0] + f1[1]))
    return float(acc)


def run(k: int, g: int, trials: int, gen: torch.Generator) -> dict:
    rel, worst_c = [], 0.0
    for _ in range(trials):
        x = torch.randn(k, generator=gen).half()
        q = torch.randint(0, 256, (k,), generator=gen)
        z = torch.randint(1, 256, (k // g,), generator=gen).float()
        s = (torch.rand(k // g, generator=gen) * 2e-3 + 1e-4).half().float()
        b = torch.randn((), generator=gen).half().double()
        w = (q.double() - z.repeat_interleave(g).double()) * s.repeat_interleave(g).double()
        terms = x.double() * w
        want = float(terms.sum() + b)
        y = float(torch.tensor(h2_row(x, q, z, s, g) + float(b)).half())
        rel.append(abs(y - want) / abs(want))
        worst_c = max(worst_c, (abs(y - want) - U * abs(want)) / (U * float(terms.abs().sum())))
    rel.sort()
    return {
        "k": k,
        "group_size": g,
        "trials": trials,
        "rel_err_median": statistics.median(rel),
        "rel_err_p99": rel[min(len(rel) - 1, int(0.99 * len(rel)))],
        "rel_err_max": rel[-1],
        "share_above_2e-3": sum(r > 2e-3 for r in rel) / len(rel),
        "worst_c": worst_c,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    cases = ((128, 128), (384, 16), (1152, 128), (2048, 16))
    rows = [run(k, g, args.trials, gen) for k, g in cases]
    print(json.dumps(rows, indent=2))
    print(f"{'K':>6}{'G':>5}{'median':>10}{'p99':>10}{'max':>10}{'>2e-3':>8}{'worst c':>9}")
    for r in rows:
        print(
            f"{r['k']:>6}{r['group_size']:>5}{r['rel_err_median']:>10.2e}{r['rel_err_p99']:>10.2e}"
            f"{r['rel_err_max']:>10.2e}{r['share_above_2e-3']:>8.3f}{r['worst_c']:>9.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
