"""Projected (not measured) op mix of Qwen3.8-27B on 2 x V100 at TP=2: a prefill of S tokens
and a batch-1 decode step, per op class, from FLOP and byte counts of the model's shapes and
V100 rates stated below. It answers issue 23's question (which kernel work buys most on a V100)
where no V100 exists; the H200 measurement beside it (bench/results/h200_vllm_op_split.json,
stock vLLM 0.22.1 on the real-shape slice) checks the class split, not the V100 rates.

    python bench/project_v100_op_mix.py --out bench/results/v100_op_mix_projection.json

Rates (per GPU; all assumptions, each a round figure from FACTS.md):
- cuBLAS fp16 GEMM on tensor cores: 100 TFLOP/s (80 % of the 125 nominal);
- Triton's `tl.dot` on sm_70 compiles to FMA: 8 TFLOP/s (half the 15.7 fp32 FMA peak);
- a Volta tensor-core FMHA / GDN chunk kernel: 55 TFLOP/s (the best public V100 head_dim-256
  attention reaches 54 exact, 75 with fp16 accumulation);
- HBM: 720 GB/s (80 % of 898).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    """The model widths the counts need (`reference_shape()` reads them from the built-in
    config, the one `sm70ctl plan` uses)."""

    hidden: int
    mlp: int
    full_layers: int
    gdn_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    k_heads: int
    v_heads: int
    gdn_dim: int
    conv_kernel: int
    vocab: int
    gdn_chunk: int = 64  # SM70_GDN_CHUNK_SIZE's default


def reference_shape() -> Shape:
    from sm70ctl.plan.model_config import builtin_config_path, load_config

    m = load_config(builtin_config_path())
    assert m.linear_key_head_dim == m.linear_value_head_dim  # the counts take one GDN width
    return Shape(hidden=m.hidden_size, mlp=m.intermediate_size, full_layers=len(m.full_layers),
                 gdn_layers=len(m.linear_layers), q_heads=m.num_attention_heads,
                 kv_heads=m.num_key_value_heads, head_dim=m.head_dim,
                 k_heads=m.linear_num_key_heads, v_heads=m.linear_num_value_heads,
                 gdn_dim=m.linear_key_head_dim, conv_kernel=m.linear_conv_kernel_dim,
                 vocab=m.vocab_size)


TFLOPS_CUBLAS = 100e12
TFLOPS_TRITON_FMA = 8e12
TFLOPS_VOLTA_TC_KERNEL = 55e12
HBM = 720e9
V100_TC_PEAK = 125e12  # nominal fp16 tensor-core rate (FACTS.md)


def linear_params(s: Shape) -> dict[str, int]:
    """Weights of the decoder's linear layers (whole model, all GPUs)."""
    mlp = 3 * s.hidden * s.mlp
    # q_proj carries the output gate (2 x heads x head_dim)
    full = (s.hidden * 2 * s.q_heads * s.head_dim + 2 * s.hidden * s.kv_heads * s.head_dim
            + s.q_heads * s.head_dim * s.hidden)
    kd, vd = s.k_heads * s.gdn_dim, s.v_heads * s.gdn_dim
    gdn = s.hidden * (2 * kd + vd) + s.hidden * vd + s.hidden * 2 * s.v_heads + vd * s.hidden
    layers = s.full_layers + s.gdn_layers
    return {"mlp": layers * mlp, "full_attention": s.full_layers * full,
            "gdn": s.gdn_layers * gdn, "lm_head": s.hidden * s.vocab}


def attention_flops(s: Shape, tokens: int, context: int = 0) -> float:
    """Causal attention of `tokens` new queries after `context` earlier tokens, all layers:
    QK^T and PV, 2 FLOP per multiply-add each."""
    pairs = tokens * context + tokens * (tokens + 1) / 2
    return s.full_layers * 4 * s.head_dim * s.q_heads * pairs


def gdn_chunk_flops(s: Shape, tokens: int) -> float:
    """The chunked delta rule per token and value head: K K^T and Q K^T inside the chunk
    (2 C dk each), the WY transforms of K and V (2 C (dk + dv)), the chunk output of (Q K^T) V
    (2 C dv), and three state products (state update, Q S, W S: 2 dk dv each)."""
    c, d = s.gdn_chunk, s.gdn_dim
    per = 3 * 2 * d * d + 2 * c * d * 2 + 2 * c * (2 * d) + 2 * c * d
    return s.gdn_layers * s.v_heads * per * tokens


def project(s: Shape, tokens: int, tp: int = 2,
            fmha_rate: float = TFLOPS_VOLTA_TC_KERNEL,
            gdn_chunk_rate: float = TFLOPS_VOLTA_TC_KERNEL) -> dict[str, Any]:
    p = linear_params(s)
    dec = p["mlp"] + p["full_attention"] + p["gdn"]
    prefill = {
        # the lm_head scores only the last token of a prefill
        "linear": {"flop": 2 * dec * tokens / tp, "rate": TFLOPS_CUBLAS,
                   "note": "cuBLAS on dequantised slices (sm70_gptq)"},
        "attention (Triton, FMA)": {"flop": attention_flops(s, tokens) / tp,
                                    "rate": TFLOPS_TRITON_FMA, "note": "stock vLLM on sm_70"},
        "attention (Volta TC FMHA)": {"flop": attention_flops(s, tokens) / tp,
                                      "rate": fmha_rate, "note": "issue 22"},
        "gdn_chunk (Triton, FMA)": {"flop": gdn_chunk_flops(s, tokens) / tp,
                                    "rate": TFLOPS_TRITON_FMA, "note": "stock FLA on sm_70"},
        "gdn_chunk (Volta TC)": {"flop": gdn_chunk_flops(s, tokens) / tp,
                                 "rate": gdn_chunk_rate, "note": "issue 23 (not routed yet)"},
    }
    conv_ch = (2 * s.k_heads + s.v_heads) * s.gdn_dim // tp
    # memory-bound elementwise work: conv1d in/out, norms and gating over the residual stream
    elementwise_bytes = tokens * (s.gdn_layers * conv_ch * 2 * 2
                                  + (s.full_layers + s.gdn_layers) * s.hidden * 2 * 2 * 4)
    prefill["conv1d, norms, gating"] = {"bytes": elementwise_bytes, "rate_bytes": HBM}
    for v in prefill.values():
        v["seconds"] = v["flop"] / v["rate"] if "flop" in v else v["bytes"] / v["rate_bytes"]
    stock = ["linear", "attention (Triton, FMA)", "gdn_chunk (Triton, FMA)",
             "conv1d, norms, gating"]
    # what the stack runs today: our FMHA, FLA's chunk kernel (ours exists, not routed)
    ours = ["linear", "attention (Volta TC FMHA)", "gdn_chunk (Triton, FMA)",
            "conv1d, norms, gating"]
    routed = ["linear", "attention (Volta TC FMHA)", "gdn_chunk (Volta TC)",
              "conv1d, norms, gating"]
    decode_bytes = {
        "linear (int8 weights)": dec / tp + p["lm_head"] / tp,
        "gdn_recurrent (fp32 state read + write)": s.gdn_layers * (s.v_heads // tp)
        * s.gdn_dim * s.gdn_dim * 4 * 2,
        "attention at 1K (int8 KV)": 1024 * s.full_layers * 2 * (s.kv_heads // tp)
        * (s.head_dim + 4),
        "attention at 32K (int8 KV)": 32768 * s.full_layers * 2 * (s.kv_heads // tp)
        * (s.head_dim + 4),
    }
    return {
        "what": "PROJECTED op mix on 2 x V100 (TP=2), per GPU; rates are assumptions",
        "tokens": tokens, "tp": tp, "linear_params": p,
        "rates": {"cublas_flops": TFLOPS_CUBLAS, "triton_fma_flops": TFLOPS_TRITON_FMA,
                  "volta_tc_kernel_flops": TFLOPS_VOLTA_TC_KERNEL, "hbm_bytes_s": HBM},
        "prefill": prefill,
        "prefill_total_s": {"stock": sum(prefill[k]["seconds"] for k in stock),
                            "with_our_kernels": sum(prefill[k]["seconds"] for k in ours),
                            "with_our_gdn_chunk_too": sum(prefill[k]["seconds"]
                                                          for k in routed)},
        "decode_step_bytes": decode_bytes,
        "decode_step_ms": {k: v / HBM * 1e3 for k, v in decode_bytes.items()},
    }


def table(r: dict[str, Any]) -> str:
    lines = [f"Prefill of {r['tokens']:,} tokens, per GPU (PROJECTED)", "",
             "| op class | TFLOP or GB | rate | seconds |", "|---|---|---|---|"]
    for k, v in r["prefill"].items():
        amount = (f"{v['flop'] / 1e12:.1f} TFLOP" if "flop" in v else f"{v['bytes'] / 1e9:.1f} GB")
        rate = (f"{v['rate'] / 1e12:.0f} TFLOP/s" if "rate" in v
                else f"{v['rate_bytes'] / 1e9:.0f} GB/s")
        lines.append(f"| {k} | {amount} | {rate} | {v['seconds']:.2f} |")
    t = r["prefill_total_s"]
    lines += ["", f"total: stock {t['stock']:.1f} s, with our kernels "
              f"{t['with_our_kernels']:.1f} s, with our GDN chunk kernel routed too "
              f"{t['with_our_gdn_chunk_too']:.1f} s", "",
              "Decode step, batch 1, per GPU (PROJECTED, bytes at HBM rate)", "",
              "| what | MB | ms |", "|---|---|---|"]
    for k, b in r["decode_step_bytes"].items():
        lines.append(f"| {k} | {b / 1e6:.0f} | {r['decode_step_ms'][k]:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--fmha-fraction", type=float, default=None,
                    help="our FMHA's measured fraction of the m8n8k4 peak (bench/bench_fmha.py), "
                    "applied to the V100's 125 TFLOP/s nominal; default: the 55 TFLOP/s above")
    ap.add_argument("--gdn-chunk-fraction", type=float, default=None,
                    help="our chunked GDN prefill's measured fraction of the m8n8k4 peak "
                    "(bench/bench_gdn_chunk.py), on the same 125 TFLOP/s; default: 55 TFLOP/s")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rate = TFLOPS_VOLTA_TC_KERNEL if a.fmha_fraction is None else a.fmha_fraction * V100_TC_PEAK
    gdn_rate = (TFLOPS_VOLTA_TC_KERNEL if a.gdn_chunk_fraction is None
                else a.gdn_chunk_fraction * V100_TC_PEAK)
    r = project(reference_shape(), a.tokens, fmha_rate=rate, gdn_chunk_rate=gdn_rate)
    print(table(r))
    if a.out:
        a.out.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
