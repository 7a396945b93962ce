"""Made-up results of tests/gpu/clef/device_clef_vllm.py's engines and server, shared by its
CPU tests (the checks, the HTTP cases, the driver)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for p in (HERE / "gpu" / "clef", HERE / "gpu" / "ab", HERE / "gpu" / "serving"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import device_clef_vllm as d  # noqa: E402

N = len(d.LENGTHS)


def row(lps: list[float], toks: tuple[int, ...] = (1, 2, 3), margin: float = 1.0) -> dict:
    return {"prompt_len": 5, "tokens": list(toks), "logprobs": lps,
            "top2": [[t, lp, 0, lp - margin] for t, lp in zip(toks, lps, strict=True)]}


def results(clef_shift: float = 0.4, merged_off: float = 0.005,
            chat_change: float = 0.0) -> dict[str, Any]:
    only = [row([-0.5, -0.6, -0.7]) for _ in range(N)]
    mixed = copy.deepcopy(only)
    for i in d.CLEF_IDX:
        mixed[i] = row([-0.5 - clef_shift, -0.6, -0.7 + clef_shift])
    mixed[d.CHAT_IDX[0]]["logprobs"][0] += chat_change
    merged = [row([-0.5 - clef_shift + merged_off, -0.6, -0.7 + clef_shift])
              for _ in range(N)]
    base16 = [row([-0.501, -0.6, -0.7]) for _ in range(N)]
    return {"ours": {"phases": {"chat_first": copy.deepcopy(only), "mixed": mixed,
                                "chat_only": only}},
            "merged": {"phases": {"all": merged, "base16": base16}}}


def score_body(scores: list[list[float]], prompt_tokens: int = 40) -> dict[str, Any]:
    return {"results": [{"id": f"q{i}", "scores": [{"option": str(j), "score": v}
                                                   for j, v in enumerate(s)]}
                        for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": prompt_tokens}}


def burst(images_ok: int | None = 2, alloc: int = 100) -> dict[str, Any]:
    return {"scores_ok": 10, "chats_ok": 6, "images_ok": images_ok, "allocated": alloc,
            "reserved": 200}


def stability(bursts: list[dict[str, Any]], images: bool = True) -> dict[str, Any]:
    return {"phases": {"stability": {"bursts": bursts, "images_on": images,
                                     "long": {"scores_ok": True, "prompt_tokens": 8190},
                                     "left_in_store": {"partial": 0, "done": 0}}}}
