"""Peak GPU memory of prompt logprobs before and after slicing (issue 24 item 5).

tests/gpu/logprobs/device_logprobs.py runs one 32K-token prompt with `prompt_logprobs`
through `LLM.generate` on the real-shape slice (vocabulary 248,320, 2048-token prefill
chunks) in two engine processes of the same checkpoint: `before` with the rebinding off
(plugin config `logprobs.prompt_chunk` 0: vLLM's own path) and `after` with it on. Each
side writes its JSON (peak allocated while the request ran, reset after start-up; the
same prompt without logprobs as the baseline) and its prompt logprobs as flat binary
arrays; this module turns them into the comparison, the bench JSON and the table. Pure
Python (no numpy, no torch): it runs here on the returned files as well as on the device.

`python bench/bench_prompt_logprobs.py OUT_DIR [--out bench/results/h200_prompt_logprobs.json]`
"""

from __future__ import annotations

import argparse
import json
import sys
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FP32_TOL = 1e-5  # a few fp32 ulps of a log-prob of magnitude ~10
ARRAYS = {"target_lp": "f", "target_rank": "i", "top_ids": "i", "top_lp": "f"}
GIB = 1024**3


def arrays_from_prompt_logprobs(prompt: Sequence[int], plp: Sequence[Any],
                                k: int) -> dict[str, list[Any]]:
    """Flat arrays of vLLM's prompt logprobs (position 0 is None; position i >= 1 maps
    token id -> Logprob for the prompt token i and the top k): per position the prompt
    token's log-prob and rank, and the top k ids and log-probs in rank order (-1 / 0.0
    pad where fewer came back)."""
    if len(plp) != len(prompt):
        raise ValueError(f"{len(plp)} prompt-logprob positions for a {len(prompt)}-token "
                         "prompt")
    out: dict[str, list[Any]] = {name: [] for name in ARRAYS}
    for i in range(1, len(prompt)):
        pos = plp[i]
        if pos is None:
            raise ValueError(f"prompt logprobs position {i} is empty")
        tgt = pos.get(prompt[i])
        if tgt is None:
            raise ValueError(f"position {i}: the prompt token {prompt[i]} is missing")
        out["target_lp"].append(float(tgt.logprob))
        out["target_rank"].append(int(tgt.rank))
        top = sorted(((lp.rank, tok, float(lp.logprob)) for tok, lp in pos.items()
                      if lp.rank is not None and lp.rank <= k))[:k]
        top += [(0, -1, 0.0)] * (k - len(top))
        out["top_ids"] += [t for _, t, _ in top]
        out["top_lp"] += [v for _, _, v in top]
    return out


def save_arrays(arrays: Mapping[str, Sequence[Any]], k: int, stem: Path) -> None:
    """`stem`.<name>.bin (fp32 / int32, native order) and `stem`.meta.json."""
    for name, code in ARRAYS.items():
        with open(f"{stem}.{name}.bin", "wb") as fh:
            array(code, arrays[name]).tofile(fh)
    n = len(arrays["target_lp"])
    Path(f"{stem}.meta.json").write_text(json.dumps({"positions": n, "k": k}))


def load_arrays(stem: Path) -> dict[str, Any]:
    meta = json.loads(Path(f"{stem}.meta.json").read_text())
    n, k = meta["positions"], meta["k"]
    out: dict[str, Any] = {"positions": n, "k": k}
    for name, code in ARRAYS.items():
        a = array(code)
        count = n * k if name.startswith("top") else n
        with open(f"{stem}.{name}.bin", "rb") as fh:
            a.fromfile(fh, count)
        out[name] = a
    return out


def compare_arrays(ref: Mapping[str, Any], sut: Mapping[str, Any],
                   tol: float = FP32_TOL) -> dict[str, Any]:
    """How far `sut`'s prompt logprobs are from `ref`'s. The top-k values are compared
    rank by rank (a swap of two tied tokens changes ids, not values); an id that differs
    counts as a tie only where `ref`'s value at that rank is within `tol` of a neighbour."""
    n, k = ref["positions"], ref["k"]
    if (sut["positions"], sut["k"]) != (n, k):
        return {"passed": False, "error": f"shapes differ: {n} x {k} against "
                f"{sut['positions']} x {sut['k']}"}
    d_target = max((abs(a - b) for a, b in zip(ref["target_lp"], sut["target_lp"],
                                                strict=True)), default=0.0)
    rank_diffs = [abs(a - b) for a, b in zip(ref["target_rank"], sut["target_rank"],
                                             strict=True) if a != b]
    d_top = max((abs(a - b) for a, b in zip(ref["top_lp"], sut["top_lp"], strict=True)),
                default=0.0)
    bitwise = sum(a == b for a, b in zip(ref["target_lp"], sut["target_lp"], strict=True))
    id_positions = untied = 0
    rid, sid, rlp = ref["top_ids"], sut["top_ids"], ref["top_lp"]
    for p in range(n):
        row = range(p * k, p * k + k)
        bad = [j for j in row if rid[j] != sid[j]]
        if not bad:
            continue
        id_positions += 1
        for j in bad:
            near = [rlp[m] for m in (j - 1, j + 1) if m in row]
            if not any(abs(rlp[j] - v) <= tol for v in near):
                untied += 1
                break
    return {
        "positions": n, "k": k, "tol": tol,
        "max_abs_dtarget_logprob": d_target,
        "max_abs_dtop_logprob": d_top,
        "target_bitwise_equal": bitwise,
        "target_rank_mismatches": len(rank_diffs),
        "max_abs_drank": max(rank_diffs, default=0),
        "top_id_mismatch_positions": id_positions,
        "top_id_mismatch_untied": untied,
        "passed": d_target <= tol and d_top <= tol and untied == 0,
    }


def memory_row(name: str, side: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one side's JSON that the table shows (None where the step failed)."""
    main = side.get("steps", {}).get("prompt_logprobs", {})
    base = side.get("steps", {}).get("no_logprobs", {})
    rows_ = {"side": name, "prompt_chunk": side.get("prompt_chunk"),
             "rebinding": side.get("plugin", {}).get("prompt_logprobs"),
             "error": main.get("error"),
             "peak_allocated": main.get("max_memory_allocated"),
             "peak_over_start": main.get("peak_over_start"),
             "baseline_peak_over_start": base.get("peak_over_start"),
             "peak_reserved": main.get("max_memory_reserved"),
             "seconds": main.get("seconds")}
    over, base_over = rows_["peak_over_start"], rows_["baseline_peak_over_start"]
    rows_["logprobs_extra"] = (over - base_over if over is not None and base_over is not None
                               else None)
    # vLLM sizes its memory from the start-up profile run, which has no prompt logprobs:
    # a request peak above the start-up peak is memory nothing reserved for.
    start_peak = side.get("startup_memory", {}).get("max_memory_allocated")
    peak = rows_["peak_allocated"]
    rows_["above_startup_peak"] = (peak - start_peak if peak is not None and start_peak
                                   is not None else None)
    util = side.get("engine_kwargs", {}).get("gpu_memory_utilization")
    total = main.get("device_total")
    reserved = rows_["peak_reserved"]
    rows_["over_engine_share"] = (reserved > util * total if None not in (util, total, reserved)
                                  else None)
    return rows_


def combine(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """Both sides' rows and after / before of the request's peak over start-up."""
    b, a = memory_row("before", before), memory_row("after", after)
    ratio = None
    if b["peak_over_start"] and a["peak_over_start"] is not None:
        ratio = round(a["peak_over_start"] / b["peak_over_start"], 3)
    return {"before": b, "after": a, "after_over_before_peak": ratio}


def _gib(v: Any) -> str:
    return "-" if v is None else f"{v / GIB:.3f}"


def table(pairs: Mapping[str, Mapping[str, Any]]) -> str:
    lines = ["| checkpoint | side | rows per slice | peak allocated GiB | request peak over "
             "start GiB | of which logprobs GiB | above start-up peak GiB | seconds | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ckpt, pair in pairs.items():
        for side in ("before", "after"):
            r = pair[side]
            lines.append(f"| {ckpt} | {side} | {r['prompt_chunk'] or 'all'} | "
                         f"{_gib(r['peak_allocated'])} | {_gib(r['peak_over_start'])} | "
                         f"{_gib(r['logprobs_extra'])} | {_gib(r.get('above_startup_peak'))} | "
                         f"{r['seconds']} | {r['error'] or r.get('startup_error') or ''} |")
    return "\n".join(lines)


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# vLLM's own memory lines on the kv_cache_memory_bytes path (no memory profiling: the
# worker takes the given KV bytes as its budget and logs what it loaded and reserved).
VLLM_MEMORY_LINES = ("Model loading took", "Initial free memory", "GPU KV cache size",
                     "Maximum concurrency")


def memory_lines(log_text: str, limit: int = 8) -> list[str]:
    """The lines of an engine log where vLLM states its memory, message part only."""
    out = []
    for line in log_text.splitlines():
        hit = next((m for m in VLLM_MEMORY_LINES if m in line), None)
        if hit:
            out.append(line[line.index(hit):][:300])
            if len(out) == limit:
                break
    return out


def pair_from_dir(out_dir: Path, ckpt: str) -> dict[str, Any] | None:
    """The pair `ckpt` of the device script's --out folder: both sides' rows, the direct
    check, and the logprobs comparison where both sides saved arrays (None: no side ran).

    The comparison's `passed` is within fp32 rounding (FP32_TOL); `within_noise` allows
    twice the difference the direct check measured between the same head's logits at
    2047 rows and at one slice's rows (the GEMM may round differently at another M)."""
    sides = {s: _read(out_dir / "sides" / f"{ckpt}_{s}.json") for s in ("before", "after")}
    if not any(sides.values()):
        return None
    pair = combine(sides["before"], sides["after"])
    for s, side in sides.items():
        pair[s]["startup_error"] = side.get("error")
        pair[s]["runner_method"] = side.get("runner_method")
        log = out_dir / "logs" / f"{ckpt}_{s}.log"
        pair[s]["vllm_memory"] = (memory_lines(log.read_text(errors="replace"))
                                  if log.is_file() else [])
    direct = sides["after"].get("steps", {}).get("direct") or {}
    pair["direct"] = {k: direct.get(k) for k in (
        "error", "all_at_once", "sliced", "max_abs_dlogprob", "logprob_bitwise_equal_fraction",
        "id_mismatches", "rank_mismatches")}
    stems = {s: out_dir / "arrays" / f"{ckpt}_{s}" for s in sides}
    if all(Path(f"{st}.meta.json").is_file() for st in stems.values()):
        ref, sut = load_arrays(stems["before"]), load_arrays(stems["after"])
        cmp = compare_arrays(ref, sut)
        noise = max(FP32_TOL, 2 * (direct.get("max_abs_dlogprob") or 0.0))
        cmp["noise_bound"] = noise
        cmp["within_noise"] = compare_arrays(ref, sut, noise)["passed"]
        pair["logprobs"] = cmp
    return pair


def verdict(pairs: Mapping[str, Any]) -> bool | None:
    """Passed: the pair's logprobs agree within noise and the request's peak over start-up
    shrank. The int8 pair (our served path) decides; the fp16 pair only when the int8 one
    has no comparison; None when neither has one."""
    p = next((pairs[c] for c in ("int8", "fp16") if "logprobs" in pairs.get(c, {})), None)
    if p is None:
        return None
    before, after = p["before"]["peak_over_start"], p["after"]["peak_over_start"]
    return bool(p["logprobs"].get("within_noise") and before is not None
                and after is not None and after < before)


def headline(pairs: Mapping[str, Any]) -> dict[str, Any]:
    """The key figures per checkpoint, for summary.json."""
    out: dict[str, Any] = {}
    for ckpt, p in pairs.items():
        lp = p.get("logprobs") or {}
        out[ckpt] = {
            "before_request_peak_over_start_gib": _round_gib(p["before"]["peak_over_start"]),
            "after_request_peak_over_start_gib": _round_gib(p["after"]["peak_over_start"]),
            "before_logprobs_extra_gib": _round_gib(p["before"]["logprobs_extra"]),
            "after_logprobs_extra_gib": _round_gib(p["after"]["logprobs_extra"]),
            "before_above_startup_peak_gib": _round_gib(p["before"]["above_startup_peak"]),
            "after_above_startup_peak_gib": _round_gib(p["after"]["above_startup_peak"]),
            "before_error": p["before"]["error"] or p["before"].get("startup_error"),
            "after_error": p["after"]["error"] or p["after"].get("startup_error"),
            "max_abs_dtarget_logprob": lp.get("max_abs_dtarget_logprob"),
            "max_abs_dtop_logprob": lp.get("max_abs_dtop_logprob"),
            "within_fp32": lp.get("passed"), "within_noise": lp.get("within_noise"),
        }
    return out


def _round_gib(v: Any) -> float | None:
    return None if v is None else round(v / GIB, 3)


def write(out_dir: Path, pairs: Mapping[str, Any], extra: Path | None = None) -> str:
    """bench_prompt_logprobs.json and .md in `out_dir` (and the JSON at `extra`)."""
    doc = json.dumps({"passed": verdict(pairs), "headline": headline(pairs), "pairs": pairs},
                     indent=1)
    (out_dir / "bench_prompt_logprobs.json").write_text(doc)
    text = table(pairs)
    (out_dir / "bench_prompt_logprobs.md").write_text(text + "\n")
    if extra:
        extra.write_text(doc)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="the device script's --out folder")
    ap.add_argument("--out", type=Path, help="write the bench JSON here too")
    a = ap.parse_args()
    pairs = {c: p for c in ("int8", "fp16") if (p := pair_from_dir(a.out_dir, c))}
    if not pairs:
        print(f"no side JSON under {a.out_dir / 'sides'}", file=sys.stderr)
        return 1
    print(write(a.out_dir, pairs, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
