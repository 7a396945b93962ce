"""Where a vLLM 0.22.1 decode step and a long prefill spend GPU time, per op class.

Run by `tests/gpu/ab/ab_side.py --profile` inside each side's engine process (the engine core
runs there, so torch.profiler's CUPTI trace sees every kernel, those replayed from CUDA graphs
included). Decode: the same batch-1 prompt generated with 1 and with 1 + STEPS new tokens, both
profiled; the per-class difference divided by STEPS is one step (prefill cancels out). Prefill:
one prompt of PREFILL_LEN tokens (vLLM splits it into chunks of max_num_batched_tokens).

Classes come from the kernel names (`classify`): the FLA Triton kernels vLLM uses for Gated
DeltaNet, causal conv1d, vLLM's Triton attention and cache writes, GEMMs (cuBLAS/CUTLASS and our
sm70 ops), norms and gating, sampling; everything else is `other` and the largest names of each
class are kept so the split can be checked by eye.

`python bench/profile_vllm_ops.py SIDES_JSON [--out FILE]` prints the table of both sides.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import write_json

STEPS = 16
DECODE_CONTEXT = 1024
PREFILL_LEN = 32768
CLASSES = ["gdn_chunk", "gdn_recurrent", "conv1d", "attention", "linear", "norm_gating",
           "sampling", "other"]

# First match wins; order matters (fused_recurrent before the generic chunk patterns, the
# attention cache write before the GEMMs' "gemm" that no attention kernel contains).
_RULES: list[tuple[str, re.Pattern[str]]] = [
    ("gdn_recurrent", re.compile(r"fused_recurrent|recurrent_gated_delta|sigmoid_gating_delta"
                                 r"|sm70::gdn_recurrent|gdn_recurrent", re.I)),
    ("gdn_chunk", re.compile(r"chunk_|gated_delta|delta_rule|solve_tril|wy_fast|cumsum"
                             r"|chunk_local|merge_16x16|l2norm|recompute_w_u|kkt", re.I)),
    ("conv1d", re.compile(r"conv1d|causal_conv", re.I)),
    ("attention", re.compile(r"attention|attn|flash|reshape_and_cache|paged|rotary|rope"
                             r"|kv_cache|kv_int8|unified", re.I)),
    ("linear", re.compile(r"gemm|gemv|cutlass|cublas|sm\d+_xmma|ampere_|hopper|nvjet|wgmma"
                          r"|matmul|_mm_|splitk|int8_gemm|gptq|lowrank|quantize_rows|quant", re.I)),
    ("sampling", re.compile(r"sampl|topk|top_k|argmax|softmax|log_softmax|gather|scatter"
                            r"|cunn_SoftMax|radix|sort|multinomial|logprob", re.I)),
    ("norm_gating", re.compile(r"norm|silu|gelu|sigmoid|act_and_mul|swiglu|gate|gating"
                               r"|softplus", re.I)),
]


def classify(kernel: str) -> str:
    for name, pattern in _RULES:
        if pattern.search(kernel):
            return name
    return "other"


def _device_times(prof: Any) -> dict[str, float]:
    """Kernel name -> self device time (microseconds) over the profiled region."""
    from torch.autograd import DeviceType

    out: dict[str, float] = {}
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        out[e.key] = out.get(e.key, 0.0) + float(us)
    return out


def split(times: dict[str, float], top: int = 4) -> dict[str, Any]:
    """Per-class microseconds plus each class's largest kernels (pure; tested on CPU)."""
    per: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
    names: dict[str, list[tuple[str, float]]] = {c: [] for c in CLASSES}
    for k, us in times.items():
        c = classify(k)
        per[c] += us
        names[c].append((k, us))
    total = sum(per.values())
    return {
        "total_us": round(total, 1),
        "us": {c: round(v, 1) for c, v in per.items()},
        "share": {c: round(v / total, 4) if total else 0.0 for c, v in per.items()},
        "top": {c: [[n[:120], round(u, 1)] for n, u in sorted(v, key=lambda x: -x[1])[:top]]
                for c, v in names.items() if v},
    }


def difference(long: dict[str, float], short: dict[str, float], steps: int) -> dict[str, float]:
    """Per-kernel (long - short) / steps, negatives (noise) clipped to 0."""
    keys = set(long) | set(short)
    return {k: max(0.0, (long.get(k, 0.0) - short.get(k, 0.0)) / steps) for k in keys}


def _profiled(llm: Any, prompts: list[Any], sp: Any) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
    return _device_times(prof)


def measure(llm: Any, max_model_len: int, seed: int = 3) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)

    def prompt(n: int) -> list[Any]:
        return [TokensPrompt(prompt_token_ids=[rng.randrange(1024) for _ in range(n)])]

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    many = SamplingParams(temperature=0.0, max_tokens=1 + STEPS, ignore_eos=True,
                          detokenize=False)
    res: dict[str, Any] = {"steps": STEPS, "decode_context": DECODE_CONTEXT}
    p = prompt(DECODE_CONTEXT)
    llm.generate(p, many, use_tqdm=False)  # warm: the profiled runs compile nothing
    short = _profiled(llm, p, one)
    long = _profiled(llm, p, many)
    res["decode_step_b1"] = split(difference(long, short, STEPS))
    if max_model_len > PREFILL_LEN:
        p = prompt(PREFILL_LEN)
        llm.generate(p, one, use_tqdm=False)
        res["prefill_len"] = PREFILL_LEN
        res["prefill"] = split(_profiled(llm, p, one))
    return res


def table(sides: dict[str, dict[str, Any]]) -> str:
    lines = []
    for what in ("decode_step_b1", "prefill"):
        cols = [n for n, s in sides.items() if (s.get("profile") or {}).get(what)]
        if not cols:
            continue
        lines += [f"### {what} (GPU microseconds; share)", "",
                  "| class | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for c in [*CLASSES, "total"]:
            cells = []
            for n in cols:
                sp = sides[n]["profile"][what]
                if c == "total":
                    cells.append(f"{sp['total_us']:.0f}")
                else:
                    cells.append(f"{sp['us'][c]:.0f} ({sp['share'][c]:.0%})")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sides", type=Path, help="sides_<shape>.json from tests/gpu/ab/run_ab.py")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    sides = json.loads(a.sides.read_text())
    prof = {n: {"profile": s.get("profile")} for n, s in sides.items() if s.get("profile")}
    if not prof:
        print(f"no profile in {a.sides}", file=sys.stderr)
        return 1
    print(table(prof))
    if a.out:
        write_json(a.out, {"steps": STEPS, "sides": prof})
    return 0


if __name__ == "__main__":
    sys.exit(main())
