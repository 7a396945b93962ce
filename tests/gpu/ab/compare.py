"""Compare two sides of the A/B (the JSON `ab_side.py` writes): pure Python, no torch.

Per request: are the 64 greedy tokens equal; the largest |logprob difference| of the chosen
tokens while both sides still agree; and where they first differ, the reference's top-1 /
top-2 log-prob margin at that step (a flip is only explainable by rounding if that margin is
small). The noise bound of a pair is twice the largest |logprob difference| seen on agreeing
steps over all its requests: a divergence whose reference margin is within it is reported as
"within noise"; one above it fails the comparison.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def compare_request(ref: Mapping[str, Any], sut: Mapping[str, Any]) -> dict[str, Any]:
    rt: Sequence[int] = ref["tokens"]
    st: Sequence[int] = sut["tokens"]
    n = min(len(rt), len(st))
    first = next((i for i in range(n) if rt[i] != st[i]), None)
    if first is None and len(rt) != len(st):
        first = n
    agree = n if first is None else first
    deltas = [abs(ref["logprobs"][i] - sut["logprobs"][i]) for i in range(agree)]
    out: dict[str, Any] = {
        "prompt_len": ref.get("prompt_len"),
        "new_tokens": len(rt),
        "equal": first is None,
        "max_abs_dlogprob": max(deltas, default=0.0),
    }
    if first is not None:
        top = ref["top2"][first] if first < len(ref["top2"]) else None
        margin = None if not top or top[3] is None else top[1] - top[3]
        out["first_diff"] = {
            "step": first,
            "ref_token": rt[first] if first < len(rt) else None,
            "sut_token": st[first] if first < len(st) else None,
            "ref_margin": margin,
            "sut_took_ref_second": bool(top) and first < len(st) and st[first] == top[2],
        }
    return out


def compare_sides(ref: Mapping[str, Any], sut: Mapping[str, Any]) -> dict[str, Any]:
    """Every phase both sides ran, request by request, and the verdict."""
    phases: dict[str, list[dict[str, Any]]] = {}
    missing: list[str] = []
    for phase, reqs in ref.get("phases", {}).items():
        other = sut.get("phases", {}).get(phase)
        if other is None or len(other) != len(reqs):
            missing.append(phase)
            continue
        phases[phase] = [compare_request(a, b) for a, b in zip(reqs, other, strict=True)]
    rows = [r for rs in phases.values() for r in rs]
    noise = 2 * max((r["max_abs_dlogprob"] for r in rows), default=0.0)
    divergences = []
    for phase, rs in phases.items():
        for i, r in enumerate(rs):
            if not r["equal"]:
                d = dict(r["first_diff"], phase=phase, request=i)
                m = d["ref_margin"]
                d["within_noise"] = m is not None and m <= noise
                divergences.append(d)
    equal = sum(r["equal"] for r in rows)
    return {
        "requests": len(rows),
        "equal_requests": equal,
        "all_equal": bool(rows) and equal == len(rows),
        "max_abs_dlogprob": max((r["max_abs_dlogprob"] for r in rows), default=None),
        "noise_bound": noise,
        "divergences": divergences,
        "missing_phases": missing,
        "passed": bool(rows) and not missing and all(d["within_noise"] for d in divergences),
        "phases": phases,
    }
