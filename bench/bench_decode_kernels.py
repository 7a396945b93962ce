"""Benchmark the decode-path kernels (torch.ops.sm70.*) on the GPU at hand.

    TORCH_CUDA_ARCH_LIST=9.0 python bench/bench_decode_kernels.py --out bench.json

Prints a table and writes JSON. Every figure is measured in this run on this GPU:
  * copy_gbps: a device-to-device copy of a 4 GiB buffer (bytes read + written / time);
    the ceilings below are fractions of it.
  * frac_of_same_bytes_stream: the kernel against a streaming kernel that moves the same bytes
    (half read, half written, rotated and graphed the same way): the part of the gap to
    copy_gbps that any kernel of that size pays on this GPU (launch, ramp, tail), for
    reading the figures; the targets stay fractions of copy_gbps.
  * GEMV (M = 1 and 4) for each per-GPU shape of Qwen3.8-27B at TP=2 and the int8 lm_head:
    achieved bandwidth (weights + scales + activations moved once) as a fraction of the copy,
    and the speed-up over torch.nn.functional.linear in fp16 on the same shape.
  * paged decode attention at 4K, 64K and 262K tokens (1 and 4 query rows): bytes of K, V
    and scales read over time, as a fraction of the copy.
L2 (50-60 MB on an H200) would flatter operands that fit: every timed call reads a
different copy of its weights / KV blocks, rotating through at least 512 MiB of copies,
and calls are replayed from a CUDA graph so launch gaps do not count.
The V100 columns are projected, not measured: bytes / 898 GB/s (the roofline floor).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_cost import describe_fit, fit_launch_cost

from sm70ctl.kernels import reference as ref
from sm70ctl.kernels.loader import load_extension

V100_GBPS = 898.0
ROTATE_BYTES = 512 * 2**20
TP = 2
H = 5120
GEMV_SHAPES = [
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
LARGE = {"qkv_proj", "gdn_in_proj_qkvz", "gate_up_proj", "down_proj", "mtp_fc", "lm_head_int8"}


def time_graph(calls, reps: int = 7) -> float:
    """Median seconds per call of a list of closures, replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:3]:
            c()  # warm-up outside the graph (allocator, lazy init)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times)


def copy_bandwidth() -> dict:
    """Device-to-device copy of 4 GiB, bytes read + written over time: eager and graphed."""
    n = 4 * 2**30
    src = torch.empty(n // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    eager = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) / 1e3)
    t_graph = time_graph([lambda: dst.copy_(src)] * 4)
    return {
        "eager_gbps": 2 * n / statistics.median(eager) / 1e9,
        "graph_gbps": 2 * n / t_graph / 1e9,
    }


def copies_for(nbytes: int) -> int:
    return max(2, min(64, math.ceil(ROTATE_BYTES / max(1, nbytes))))


def same_bytes_stream_us(nbytes: int) -> float:
    """Microseconds to stream nbytes through the SMs (nbytes / 2 read, nbytes / 2 written):
    torch.bitwise_not over int32, graphed and rotated like the kernels. Not copy_: inside a
    CUDA graph a device-to-device copy_ becomes a memcpy node, which ran at 2.8 TB/s against
    4.3 eager on the H200 and switched between two speeds from case to case."""
    words = max(4, nbytes // 8 // 4 * 4)  # int32 words per side
    ncopy = copies_for(8 * words)
    src = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(ncopy)]
    dst = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(ncopy)]
    calls = [
        (lambda i=i: torch.bitwise_not(src[i % ncopy], out=dst[i % ncopy]))
        for i in range(max(ncopy, 16))
    ]
    return time_graph(calls) * 1e6 * nbytes / (8 * words)


def gemv_group_and_bytes(name: str, n: int, k: int) -> tuple[int, int]:
    """Group size and weight bytes (codes + fp16 (scale, zero) pairs) of a GEMV shape:
    groups of 128, the int8 lm_head one group per row."""
    g = k if name == "lm_head_int8" else 128
    return g, n * k + n * (k // g) * 4


def kv_bytes(tokens: int, hkv: int = 2) -> int:
    """int8 KV bytes of `tokens` tokens: K and V rows of 256 dims plus an fp32 scale each,
    per KV head."""
    return tokens * hkv * 2 * (256 + 4)


def bench_gemv(name: str, n: int, k: int, m: int, copy_gbps: float) -> dict:
    g, wbytes = gemv_group_and_bytes(name, n, k)
    ncopy = copies_for(wbytes)
    qws = [torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda") for _ in range(ncopy)]
    sz = torch.empty(n, k // g, 2, dtype=torch.float16, device="cuda")
    sz[..., 0].uniform_(1e-4, 2e-3)
    sz[..., 1].fill_(128)
    szs = [sz.clone() for _ in range(ncopy)]
    x = torch.randn(m, k, device="cuda").half()
    # (kernel, ksplit): auto, the classic kernel's K-split modes and, at M = 1, the
    # streamed kernel with U = 1 and 2 chunks per row per step (2, 3), stream-K with S = 2
    # and 3 pipeline stages (4, 5) and the streamed kernel with x in shared memory, 4 rows
    # x U = 2 and 8 rows x U = 1 (6, 7), packed-half math U = 1 / 2 (8, 9); each with its
    # own K-split rule (tuning data)
    # tensor cores (10): auto K split and forced 1, 2, 4, 8 warps per row tile, every M
    modes = [(0, 0), (1, 0), (1, 1), (1, 4), (10, 0), (10, 1), (10, 2), (10, 4), (10, 8)]
    if m == 1:
        modes += [(2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (7, 0), (8, 0), (8, 1), (8, 4), (9, 0)]
        modes += [(12, 0)]  # 8 with its grid balanced over the SMs
        modes += [(13, 0)]  # 12 with 2 rows per warp, 8 blocks per SM (the M = 1 default)
    by_mode = {}

    def mode_calls(kern: int, ks: int) -> list:
        return [
            (
                lambda i=i: torch.ops.sm70.gptq_gemv(
                    x, qws[i % ncopy], szs[i % ncopy], g, None, ks, kern
                )
            )
            for i in range(max(ncopy, 16))
        ]

    for kern, ks in modes:
        by_mode[(kern, ks)] = time_graph(mode_calls(kern, ks))
    moved = wbytes + m * k * 2 + m * n * 2
    fbytes = n * k * 2
    fcopy = copies_for(fbytes)
    ws = [torch.randn(n, k, device="cuda").half() for _ in range(fcopy)]
    fcalls = [(lambda i=i: F.linear(x, ws[i % fcopy])) for i in range(max(fcopy, 16))]
    # auto and F.linear are timed twice, first and last, and each keeps its faster median:
    # the first graph timed on a shape came out up to 12 % slow (qkv_proj auto 14.0 us and
    # down_proj 17.2 against 12.5 and 16.0 for the same launches timed later in the run)
    tf_first = time_graph(fcalls)
    t_last = time_graph(mode_calls(0, 0))
    tf_last = time_graph(fcalls)
    t = min(by_mode[(0, 0)], t_last)
    tf = min(tf_first, tf_last)
    same = same_bytes_stream_us(moved)
    gbps = moved / t / 1e9
    return {
        "kernel": "gptq_gemv",
        "shape": name,
        "m": m,
        "n": n,
        "k": k,
        "group_size": g,
        "us": t * 1e6,
        "bytes": moved,
        "gbps": gbps,
        "frac_of_copy": gbps / copy_gbps,
        "same_bytes_stream_us": same,
        "frac_of_same_bytes_stream": same / (t * 1e6),
        "fp16_linear_us": tf * 1e6,
        "us_first_last": [by_mode[(0, 0)] * 1e6, t_last * 1e6],
        "fp16_linear_us_first_last": [tf_first * 1e6, tf_last * 1e6],
        "speedup_vs_fp16_linear": tf / t,
        "rotating_copies": ncopy,
        "us_ksplit1": by_mode[(1, 1)] * 1e6,
        "us_ksplit4": by_mode[(1, 4)] * 1e6,
        # the classic kernel with its auto K split: the default before the streamed kernel
        "us_classic": by_mode[(1, 0)] * 1e6,
        "us_by_kernel_ksplit": {f"k{k}_ks{s}": v * 1e6 for (k, s), v in by_mode.items()},
        "v100_floor_us_projected": moved / (V100_GBPS * 1e9) * 1e6,
    }


def bench_decode(
    ctx: int | list[int],
    qn: int,
    copy_gbps: float,
    sms: int,
    mma: int = 0,
    block_size: int = 16,
    max_splits: int = 256,
    splits: int | None = None,
) -> dict:
    """One context, or a batch of contexts (a list) sharing the launch."""
    hkv = 2
    ctxs = [ctx] if isinstance(ctx, int) else list(ctx)
    nblks = [math.ceil(c / block_size) for c in ctxs]
    nblk = sum(nblks)
    per_copy = kv_bytes(nblk * block_size, hkv)
    ncopy = copies_for(per_copy)
    total = nblk * ncopy
    k_cache = torch.randint(
        -127, 128, (total, hkv, block_size, 256), dtype=torch.int8, device="cuda"
    )
    v_cache = torch.randint(
        -127, 128, (total, hkv, block_size, 256), dtype=torch.int8, device="cuda"
    )
    k_scale = torch.rand(total, hkv, block_size, device="cuda") * 0.02 + 1e-3
    v_scale = torch.rand(total, hkv, block_size, device="cuda") * 0.02 + 1e-3
    perm = torch.randperm(total, device="cuda").int()  # scattered blocks, as in serving
    tables = []
    for i in range(ncopy):
        table = torch.zeros(len(ctxs), max(nblks), dtype=torch.int32, device="cuda")
        start = i * nblk
        for b, n in enumerate(nblks):
            table[b, :n] = perm[start : start + n]
            start += n
        tables.append(table)
    seq = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    q = torch.randn(len(ctxs) * qn, 12, 256, device="cuda").half()
    volta = torch.cuda.get_device_capability()[0] < 8  # m8n8k4 is the native path there
    default = splits is None and max_splits == 256 and (mma != 1 or volta) and len(ctxs) == 1
    role = "default" if default else "tuning"
    ctas = torch.ops.sm70.paged_decode_blocks_per_sm(qn, mma)
    if splits is None:
        # one full wave of resident blocks (the kernel's occupancy, asked of the driver)
        splits = ref.decode_num_splits(
            max(ctxs), len(ctxs), hkv, sms, max_splits=max_splits, ctas_per_sm=ctas
        )
    calls = [
        (
            lambda i=i: torch.ops.sm70.paged_decode(
                q,
                k_cache,
                v_cache,
                k_scale,
                v_scale,
                tables[i % ncopy],
                seq,
                qn,
                0.0625,
                splits,
                mma,
            )
        )
        for i in range(max(ncopy, 8))
    ]
    t = time_graph(calls)
    moved = kv_bytes(sum(ctxs), hkv)
    same = same_bytes_stream_us(moved)
    gbps = moved / t / 1e9
    return {
        "kernel": "paged_decode",
        "context": ctxs[0] if len(ctxs) == 1 else max(ctxs),
        "batch_contexts": ctxs,
        "q_rows": qn,
        "splits": splits,
        "blocks_per_sm": ctas,
        "mma": {0: "auto", 1: "m8n8k4", 2: "m16n8k16"}[mma],
        "role": role,
        "us": t * 1e6,
        "bytes": moved,
        "gbps": gbps,
        "frac_of_copy": gbps / copy_gbps,
        "same_bytes_stream_us": same,
        "frac_of_same_bytes_stream": same / (t * 1e6),
        "rotating_copies": ncopy,
        "v100_floor_us_projected": moved / (V100_GBPS * 1e9) * 1e6,
    }


def progress(row: dict) -> dict:
    """One JSON line per case as it is measured: a run cut short still leaves its data."""
    print(json.dumps(row), flush=True)
    return row


def batch_label(ctxs: list[int]) -> str:
    """[262144, 4096, 4096] -> 256K+2x4K"""
    parts: list[list[int]] = []
    for c in ctxs:
        if parts and parts[-1][0] == c:
            parts[-1][1] += 1
        else:
            parts.append([c, 1])
    return "+".join(f"{n}x{c // 1024}K" if n > 1 else f"{c // 1024}K" for c, n in parts)


def render(result: dict) -> str:
    lines = [
        f"device: {result['device']}   copy: {result['copy_gbps']:.0f} GB/s (measured, "
        "read+write)   V100 columns: projected at 898 GB/s",
        f"{'kernel':<13}{'case':<24}{'us':>9}{'GB/s':>8}{'%copy':>7}{'%same':>7}{'fp16 us':>9}"
        f"{'x fp16':>8}{'V100 us*':>10}{'ks1 us':>8}{'ks4 us':>8}{'classic':>8}  streamed",
    ]
    for r in result["gemv"]:
        lines.append(
            f"{'gemv':<13}{r['shape'] + ' M=' + str(r['m']):<24}{r['us']:>9.1f}{r['gbps']:>8.0f}"
            f"{100 * r['frac_of_copy']:>6.0f}%{100 * r['frac_of_same_bytes_stream']:>6.0f}%"
            f"{r['fp16_linear_us']:>9.1f}"
            f"{r['speedup_vs_fp16_linear']:>8.2f}{r['v100_floor_us_projected']:>10.1f}"
            f"{r['us_ksplit1']:>8.1f}{r['us_ksplit4']:>8.1f}{r['us_classic']:>8.1f}  "
            + " ".join(
                f"{k}={v:.1f}"
                for k, v in r["us_by_kernel_ksplit"].items()
                if not k.startswith(("k0_", "k1_"))
            )
        )
    for r in result["decode"]:
        ctx = r["context"] if len(r["batch_contexts"]) == 1 else batch_label(r["batch_contexts"])
        case = f"ctx={ctx} q={r['q_rows']} s={r['splits']} {r['mma']}"
        lines.append(
            f"{'attention':<13}{case:<24}{r['us']:>9.1f}{r['gbps']:>8.0f}"
            f"{100 * r['frac_of_copy']:>6.0f}%{100 * r['frac_of_same_bytes_stream']:>6.0f}%"
            f"{'':>9}{'':>8}{r['v100_floor_us_projected']:>10.1f}"
        )
    lines.append(
        "%same: against a streaming kernel over the same bytes, this run; "
        "* projected floor: bytes / 898 GB/s, not measured"
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument(
        "--section", choices=("all", "gemv", "decode"), default="all", help="what to run"
    )
    ap.add_argument("--m", default="1,4", help="GEMV activation rows, comma-separated")
    args = ap.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to benchmark", file=sys.stderr)
        return 1
    load_extension()
    props = torch.cuda.get_device_properties(0)
    copies = copy_bandwidth()
    copy = max(copies.values())
    shapes = GEMV_SHAPES[:2] if args.quick else GEMV_SHAPES
    print(json.dumps({"copy": copies}), flush=True)
    gemv = []
    if args.section in ("all", "gemv"):
        gemv = [progress(bench_gemv(nm, n, k, m, copy)) for nm, n, k in shapes for m in ms]
    sms = props.multi_processor_count
    native = 2 if props.major >= 8 else 1  # m8n8k4 is emulated on sm_80+
    decode = []
    if args.section in ("all", "decode"):
        decode = [
            progress(bench_decode(ctx, qn, copy, sms, native))
            for ctx in (4096, 65536, 262144)
            for qn in (1, 4)
        ]
        if native == 2:  # the Volta instruction path on this GPU, for the record
            decode.append(bench_decode(65536, 4, copy, sms, 1))
        # the serving default (SM70_DECODE_MAX_SPLITS=64): fewer partials to combine
        decode += [bench_decode(262144, qn, copy, sms, native, max_splits=64) for qn in (1, 4)]
        # other split counts (198 = one wave at 3 blocks per SM, the QN = 4 residency)
        decode += [
            bench_decode(ctx, qn, copy, sms, native, splits=s)
            for ctx, s in ((65536, 128), (262144, 512))
            for qn in (1, 4)
        ]
        # a batch: one 262K context and seven 4K ones share the launch by length; the
        # schedule before gave every sequence the same split count, so the long one ran on
        # 1/8 of the grid: timed here as that context alone with that split count
        mixed = progress(bench_decode([262144] + [4096] * 7, 1, copy, sms, native))
        decode.append(mixed)
        decode.append(progress(bench_decode(262144, 1, copy, sms, native, splits=mixed["splits"])))
    large_m1 = [r for r in gemv if r["m"] == 1 and r["shape"] in LARGE]
    large_m4 = [r for r in gemv if r["m"] == 4 and r["shape"] in LARGE]
    # targets: the default split rule on this GPU's fastest tensor-core path
    long_ctx = [r for r in decode if r["context"] >= 65536 and r["role"] == "default"]

    def low(rows: list[dict], key) -> float | None:
        return min(key(r) for r in rows) if rows else None

    # the M = 1 default's launch cost beyond its bytes (compare bench_read_ceiling's fit)
    try:
        m1_fit = fit_launch_cost([r for r in gemv if r["m"] == 1])
    except ValueError:  # no M = 1 rows (--section decode, or --m without 1)
        m1_fit = None

    result = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "copy_gbps": copy,
        "copy_variants_gbps": copies,
        "l2_handling": "rotating weight/KV copies >= 512 MiB per case; CUDA-graph replay",
        "gemv": gemv,
        "gemv_m1_launch_fit": m1_fit,
        "decode": decode,
        "targets": {
            "gemv_m1_large_min_frac_of_copy": low(large_m1, lambda r: r["frac_of_copy"]),
            "gemv_m1_large_min_speedup_vs_fp16": low(
                large_m1, lambda r: r["speedup_vs_fp16_linear"]
            ),
            "gemv_m1_large_classic_min_frac_of_copy": low(
                large_m1, lambda r: r["bytes"] / (r["us_classic"] * 1e-6) / 1e9 / copy
            ),
            # not a target of the issue: MTP verification (1 + 3 draft tokens) runs M = 4
            "gemv_m4_large_min_speedup_vs_fp16": low(
                large_m4, lambda r: r["speedup_vs_fp16_linear"]
            ),
            "decode_64k_up_min_frac_of_copy": low(long_ctx, lambda r: r["frac_of_copy"]),
        },
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    print(render(result))
    if m1_fit:
        print("GEMV M = 1 default,", describe_fit(m1_fit))
    print("targets:", json.dumps(result["targets"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
