"""What the decode benches measure and how their rows add up (pure: no torch, no GPU).

The shapes are Qwen3.8-27B's per-GPU projections at TP = 2; the byte counts are what a
kernel has to move once; the decode-step sums and the targets read the rows that
bench_decode_kernels.py writes. kernels_table.py renders the same rows for docs/kernels.md.
"""

from __future__ import annotations

import math

V100_GBPS = 898.0  # V100-SXM2 HBM2 peak: the projected floors divide by it
ROTATE_BYTES = 512 * 2**20  # rotating copies per case: far past the H200's 50-60 MB of L2
TP = 2
H = 5120
KV_HEADS = 2  # per GPU: 4 KV heads over TP = 2
Q_HEADS = 12  # per GPU: 24 query heads over TP = 2 (GQA 6:1)
HEAD_DIM = 256

GEMV_SHAPES: list[tuple[str, int, int]] = [
    ("qkv_proj", 14336 // TP, H),
    ("o_proj", H, 6144 // TP),
    ("gdn_in_proj_qkvz", (10240 + 6144) // TP, H),
    ("gdn_in_proj_ba", 96 // TP, H),
    ("gdn_out_proj", H, 6144 // TP),
    ("gate_up_proj", 2 * 17408 // TP, H),
    ("down_proj", H, 17408 // TP),
    ("mtp_fc", H, 2 * H),
    ("lm_head_int8", 248320 // TP, H),
]
# the shapes the GEMV targets are stated for (>= 38 MB of weights each)
LARGE = frozenset(
    {"qkv_proj", "gdn_in_proj_qkvz", "gate_up_proj", "down_proj", "mtp_fc", "lm_head_int8"}
)
# launches of each shape in one decode step: 16 full-attention layers, 48 Gated DeltaNet
# layers, an MLP in all 64, the lm_head once (the MTP head's fc runs only when drafting)
STEP_LAUNCHES: dict[str, int] = {
    "qkv_proj": 16,
    "o_proj": 16,
    "gdn_in_proj_qkvz": 48,
    "gdn_in_proj_ba": 48,
    "gdn_out_proj": 48,
    "gate_up_proj": 64,
    "down_proj": 64,
    "lm_head_int8": 1,
}
# the targets, as fractions of the copy bandwidth / speed-ups
TARGET_GEMV_M1_FRAC = 0.80
TARGET_GEMV_M1_SPEEDUP = 1.6
TARGET_DECODE_FRAC = 0.70
TARGET_DECODE_MIN_CONTEXT = 65536


def gemv_group_and_bytes(name: str, n: int, k: int) -> tuple[int, int]:
    """Group size and weight bytes (codes + fp16 (scale, zero) pairs) of a GEMV shape:
    groups of 128, the int8 lm_head one group per row."""
    g = k if name == "lm_head_int8" else 128
    return g, n * k + n * (k // g) * 4


def gemv_moved_bytes(name: str, n: int, k: int, m: int) -> int:
    """Bytes a GEMV of M rows moves once: weights, the fp16 activations and outputs."""
    return gemv_group_and_bytes(name, n, k)[1] + m * k * 2 + m * n * 2


def kv_bytes(tokens: int, hkv: int = KV_HEADS) -> int:
    """int8 KV bytes of `tokens` tokens: K and V rows of 256 dims plus an fp32 scale each,
    per KV head."""
    return tokens * hkv * 2 * (HEAD_DIM + 4)


def copies_for(nbytes: int) -> int:
    """Rotating copies of an operand of nbytes: enough for ROTATE_BYTES, 2 to 64."""
    return max(2, min(64, math.ceil(ROTATE_BYTES / max(1, nbytes))))


def v100_floor_us(nbytes: int) -> float:
    """Projected, not measured: the time a V100 needs to move nbytes at its peak."""
    return nbytes / (V100_GBPS * 1e9) * 1e6


def context_runs(ctxs: list[int]) -> list[tuple[int, int]]:
    """[262144, 4096, 4096, 262144] -> [(262144, 1), (4096, 2), (262144, 1)]: each run of
    equal contexts in order, with its length."""
    parts: list[list[int]] = []
    for c in ctxs:
        if parts and parts[-1][0] == c:
            parts[-1][1] += 1
        else:
            parts.append([c, 1])
    return [(c, n) for c, n in parts]


def batch_label(ctxs: list[int]) -> str:
    """[262144, 4096, 4096] -> 256K+2x4K"""
    return "+".join(f"{n}x{c // 1024}K" if n > 1 else f"{c // 1024}K"
                    for c, n in context_runs(ctxs))


def decode_step_us(gemv_rows: list[dict], m: int) -> float | None:
    """Microseconds all int8 GEMVs of one decode step take at M rows (sum over STEP_LAUNCHES
    of the rows' times), or None when a shape of the step has no row at that M."""
    us = {r["shape"]: r["us"] for r in gemv_rows if r["m"] == m}
    if any(name not in us for name in STEP_LAUNCHES):
        return None
    return sum(us[name] * count for name, count in STEP_LAUNCHES.items())


def decode_step_weight_bytes() -> int:
    """int8 weight bytes (codes + scales) one decode step streams through the GEMVs."""
    shapes = {name: (n, k) for name, n, k in GEMV_SHAPES}
    return sum(
        gemv_group_and_bytes(name, *shapes[name])[1] * count
        for name, count in STEP_LAUNCHES.items()
    )


def targets(gemv_rows: list[dict], decode_rows: list[dict]) -> dict[str, float | None]:
    """The figures the targets are judged by: the worst large M = 1 GEMV (fraction of the
    copy, speed-up over fp16 F.linear), the worst M = 4 speed-up (MTP verification, not a
    target) and the worst default-split attention row from 64K tokens up."""
    m1 = [r for r in gemv_rows if r["m"] == 1 and r["shape"] in LARGE]
    m4 = [r for r in gemv_rows if r["m"] == 4 and r["shape"] in LARGE]
    long_ctx = [
        r
        for r in decode_rows
        if r["context"] >= TARGET_DECODE_MIN_CONTEXT and r["role"] == "default"
    ]

    def low(rows: list[dict], key: str) -> float | None:
        return min(r[key] for r in rows) if rows else None

    return {
        "gemv_m1_large_min_frac_of_copy": low(m1, "frac_of_copy"),
        "gemv_m1_large_min_speedup_vs_fp16": low(m1, "speedup_vs_fp16_linear"),
        "gemv_m4_large_min_speedup_vs_fp16": low(m4, "speedup_vs_fp16_linear"),
        "decode_64k_up_min_frac_of_copy": low(long_ctx, "frac_of_copy"),
    }


def render(result: dict) -> str:
    """The bench's printed table: one line per GEMV and attention row of a result."""
    lines = [
        f"device: {result['device']}   copy: {result['copy_gbps']:.0f} GB/s (measured, "
        "read+write)   V100 columns: projected at 898 GB/s",
        f"{'kernel':<11}{'case':<34}{'us':>9}{'GB/s':>8}{'%copy':>7}{'%same':>7}{'fp16 us':>9}"
        f"{'x fp16':>8}{'V100 us*':>10}",
    ]
    for r in result["gemv"]:
        case = f"{r['shape']} M={r['m']} {r['arch_path']}"
        lines.append(
            f"{'gemv':<11}{case:<34}{r['us']:>9.1f}{r['gbps']:>8.0f}"
            f"{100 * r['frac_of_copy']:>6.0f}%{100 * r['frac_of_same_bytes_stream']:>6.0f}%"
            f"{r['fp16_linear_us']:>9.1f}"
            f"{r['speedup_vs_fp16_linear']:>8.2f}{r['v100_floor_us_projected']:>10.1f}"
        )
    for r in result["decode"]:
        ctxs = r["batch_contexts"]
        ctx = r["context"] if len(ctxs) == 1 else batch_label(ctxs)
        case = f"ctx={ctx} q={r['q_rows']} s={r['splits']} {r['arch_path']}"
        lines.append(
            f"{'attention':<11}{case:<34}{r['us']:>9.1f}{r['gbps']:>8.0f}"
            f"{100 * r['frac_of_copy']:>6.0f}%{100 * r['frac_of_same_bytes_stream']:>6.0f}%"
            f"{'':>9}{'':>8}{r['v100_floor_us_projected']:>10.1f}"
        )
    lines.append(
        "%same: against a streaming kernel over the same bytes, this run; "
        "* projected floor: bytes / 898 GB/s, not measured"
    )
    return "\n".join(lines)
