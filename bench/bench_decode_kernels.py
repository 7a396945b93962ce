"""Benchmark the decode-path kernels (torch.ops.sm70.*) on the GPU at hand.

    TORCH_CUDA_ARCH_LIST=9.0 python bench/bench_decode_kernels.py --out bench.json

Prints one JSON line per case as it is measured, then the whole JSON (or writes it to --out)
and a table. Every figure is measured in this run on this GPU:
  * copy_gbps: a device-to-device copy of a 4 GiB buffer (bytes read + written / time);
    the ceilings below are fractions of it.
  * frac_of_same_bytes_stream: the kernel against a streaming kernel that moves the same bytes
    (half read, half written, rotated and graphed the same way): the part of the gap to
    copy_gbps that any kernel of that size pays on this GPU (launch, ramp, tail), for
    reading the figures; the targets stay fractions of copy_gbps.
  * GEMV (--m rows) for each per-GPU shape of Qwen3.8-27B at TP=2 and the int8 lm_head:
    achieved bandwidth (weights + scales + activations moved once) as a fraction of the copy,
    and the speed-up over torch.nn.functional.linear in fp16 on the same shape.
  * paged decode attention at 4K, 64K and 262K tokens (1 and 4 query rows), other split
    counts and a batch of mixed lengths: bytes of K, V and scales read over time.
Each case runs what the op's launcher picks for that shape on this GPU's native
instantiation; on sm_80+ a few cases also run the Volta (m8n8k4) instantiation through
set_arch_path("sm70"), for the record (the H200 emulates m8n8k4, so those are slow).
L2 (50-60 MB on an H200) would flatter operands that fit: every timed call reads a
different copy of its weights / KV blocks, rotating through at least 512 MiB of copies,
and calls are replayed from a CUDA graph so launch gaps between them count, Python does not.
The V100 columns are projected, not measured: bytes / 898 GB/s (the roofline floor).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_cases as C
from bench_io import write_json
from gpu_timing import copy_bandwidth, same_bytes_stream_us, time_graph
from launch_cost import describe_fit, fit_launch_cost

from vllm_patch.ops import kernels, sources
from vllm_patch.ops import reference as ref
from vllm_patch.ops.loader import load_ops

SOFTMAX_SCALE = 0.0625  # 1 / sqrt(256)


@contextlib.contextmanager
def arch_path(path: str) -> Iterator[str]:
    """Run the enclosed launches (and graph captures) on one instantiation: "native" or
    "sm70" (m8n8k4); the process-wide path is restored afterwards."""
    before = kernels.arch_path()
    kernels.set_arch_path(path)
    try:
        yield path
    finally:
        kernels.set_arch_path(before)


def mma_shape(path: str) -> str:
    """The tensor-core instruction an instantiation runs on this GPU."""
    volta = torch.cuda.get_device_capability()[0] < 8
    return "m8n8k4" if path == "sm70" or volta else "m16n8k16"


def bench_gemv(name: str, n: int, k: int, m: int, copy_gbps: float, path: str = "native") -> dict:
    g, wbytes = C.gemv_group_and_bytes(name, n, k)
    ncopy = C.copies_for(wbytes)
    qws = [torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda") for _ in range(ncopy)]
    sz = torch.empty(n, k // g, 2, dtype=torch.float16, device="cuda")
    sz[..., 0].uniform_(1e-4, 2e-3)
    sz[..., 1].fill_(128)
    szs = [sz.clone() for _ in range(ncopy)]
    x = torch.randn(m, k, device="cuda").half()
    calls = [
        (lambda i=i: torch.ops.sm70.gptq_gemv(x, qws[i % ncopy], szs[i % ncopy], g, None))
        for i in range(max(ncopy, 16))
    ]
    fbytes = n * k * 2
    fcopy = C.copies_for(fbytes)
    ws = [torch.randn(n, k, device="cuda").half() for _ in range(fcopy)]
    fcalls = [(lambda i=i: F.linear(x, ws[i % fcopy])) for i in range(max(fcopy, 16))]
    # the kernel and F.linear are each timed twice, first and last, and keep the faster
    # median: the first graph timed on a shape can come out slow (warm-up of the clocks
    # and of the allocator's pages), and which of the two is first must not decide the ratio
    with arch_path(path):
        t_first = time_graph(calls)
        tf_first = time_graph(fcalls)
        t_last = time_graph(calls)
        tf_last = time_graph(fcalls)
    t = min(t_first, t_last)
    tf = min(tf_first, tf_last)
    moved = C.gemv_moved_bytes(name, n, k, m)
    same = same_bytes_stream_us(moved)
    gbps = moved / t / 1e9
    return {
        "kernel": "gptq_gemv",
        "shape": name,
        "m": m,
        "n": n,
        "k": k,
        "group_size": g,
        "arch_path": path,
        "mma": mma_shape(path),
        "us": t * 1e6,
        "bytes": moved,
        "gbps": gbps,
        "frac_of_copy": gbps / copy_gbps,
        "same_bytes_stream_us": same,
        "frac_of_same_bytes_stream": same / (t * 1e6),
        "fp16_linear_us": tf * 1e6,
        "us_first_last": [t_first * 1e6, t_last * 1e6],
        "fp16_linear_us_first_last": [tf_first * 1e6, tf_last * 1e6],
        "speedup_vs_fp16_linear": tf / t,
        "rotating_copies": ncopy,
        "v100_floor_us_projected": C.v100_floor_us(moved),
    }


def bench_decode(
    ctx: int | list[int],
    qn: int,
    copy_gbps: float,
    sms: int,
    path: str = "native",
    block_size: int = 16,
    max_splits: int = 256,
    splits: int | None = None,
) -> dict:
    """One context, or a batch of contexts (a list) sharing the launch."""
    hkv = C.KV_HEADS
    ctxs = [ctx] if isinstance(ctx, int) else list(ctx)
    nblks = [math.ceil(c / block_size) for c in ctxs]
    nblk = sum(nblks)
    ncopy = C.copies_for(C.kv_bytes(nblk * block_size, hkv))
    total = nblk * ncopy
    shape = (total, hkv, block_size, C.HEAD_DIM)
    k_cache = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
    v_cache = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
    k_scale = torch.rand(total, hkv, block_size, device="cuda") * 0.02 + 1e-3
    v_scale = torch.rand(total, hkv, block_size, device="cuda") * 0.02 + 1e-3
    perm = torch.randperm(total, device="cuda").int()  # scattered blocks, as in serving
    tables = []
    for i in range(ncopy):
        table = torch.zeros(len(ctxs), max(nblks), dtype=torch.int32, device="cuda")
        start = i * nblk
        for b, nb in enumerate(nblks):
            table[b, :nb] = perm[start : start + nb]
            start += nb
        tables.append(table)
    seq = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    q = torch.randn(len(ctxs) * qn, C.Q_HEADS, C.HEAD_DIM, device="cuda").half()
    default = splits is None and max_splits == 256 and path == "native" and len(ctxs) == 1
    with arch_path(path):
        # resident blocks of the instantiation this path launches, asked of the driver
        ctas = torch.ops.sm70.paged_decode_blocks_per_sm(qn)
        if splits is None:  # one full wave of resident blocks
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
                    SOFTMAX_SCALE,
                    splits,
                )
            )
            for i in range(max(ncopy, 8))
        ]
        t = time_graph(calls)
    moved = C.kv_bytes(sum(ctxs), hkv)
    same = same_bytes_stream_us(moved)
    gbps = moved / t / 1e9
    return {
        "kernel": "paged_decode",
        "context": ctxs[0] if len(ctxs) == 1 else max(ctxs),
        "batch_contexts": ctxs,
        "q_rows": qn,
        "splits": splits,
        "blocks_per_sm": ctas,
        "arch_path": path,
        "mma": mma_shape(path),
        "role": "default" if default else "tuning",
        "us": t * 1e6,
        "bytes": moved,
        "gbps": gbps,
        "frac_of_copy": gbps / copy_gbps,
        "same_bytes_stream_us": same,
        "frac_of_same_bytes_stream": same / (t * 1e6),
        "rotating_copies": ncopy,
        "v100_floor_us_projected": C.v100_floor_us(moved),
    }


def progress(row: dict) -> dict:
    """One JSON line per case as it is measured: a run cut short still leaves its data."""
    print(json.dumps(row), flush=True)
    return row


def run_gemv_cases(copy: float, ms: list[int], quick: bool, volta_too: bool) -> list[dict]:
    shapes = C.GEMV_SHAPES[:2] if quick else C.GEMV_SHAPES
    rows = [progress(bench_gemv(nm, n, k, m, copy)) for nm, n, k in shapes for m in ms]
    if volta_too and any(m > 1 for m in ms):
        # the Volta tensor-core instantiation (m8n8k4) on one shape, for the record
        nm, n, k = C.GEMV_SHAPES[0]
        rows.append(progress(bench_gemv(nm, n, k, max(ms), copy, path="sm70")))
    return rows


def run_decode_cases(copy: float, sms: int, volta_too: bool) -> list[dict]:
    rows = [
        progress(bench_decode(c, qn, copy, sms)) for c in (4096, 65536, 262144) for qn in (1, 4)
    ]
    if volta_too:  # the Volta instruction path on this GPU, for the record
        rows.append(progress(bench_decode(65536, 4, copy, sms, path="sm70")))
    # the serving default (SM70_DECODE_MAX_SPLITS=64): fewer partials to combine
    rows += [progress(bench_decode(262144, qn, copy, sms, max_splits=64)) for qn in (1, 4)]
    # other split counts around the default's one wave
    rows += [
        progress(bench_decode(ctx, qn, copy, sms, splits=s))
        for ctx, s in ((65536, 128), (262144, 512))
        for qn in (1, 4)
    ]
    # a batch: one 262K context and seven 4K ones share the launch by length; beside it the
    # 262K context alone with the batch's split count, which is what a schedule giving every
    # sequence the same split count would run for the long one
    mixed = progress(bench_decode([262144] + [4096] * 7, 1, copy, sms))
    rows.append(mixed)
    rows.append(progress(bench_decode(262144, 1, copy, sms, splits=mixed["splits"])))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument(
        "--section", choices=("all", "gemv", "decode"), default="all", help="what to run"
    )
    ap.add_argument("--m", default="1,4", help="GEMV activation rows, comma-separated")
    args = ap.parse_args()
    try:
        ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        ap.error(f"--m {args.m!r}: comma-separated integers 1..8 expected")
    if any(not 1 <= m <= 8 for m in ms):
        ap.error(f"--m {args.m!r}: gptq_gemv takes 1..8 rows")
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to benchmark", file=sys.stderr)
        return 1
    load_ops()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    volta_too = props.major >= 8  # on a V100 "native" already is the Volta path
    copies = copy_bandwidth()
    copy = max(copies.values())
    print(json.dumps({"copy": copies}), flush=True)
    gemv = []
    if args.section in ("all", "gemv"):
        gemv = run_gemv_cases(copy, ms, args.quick, volta_too)
    decode = []
    if args.section in ("all", "decode"):
        decode = run_decode_cases(copy, sms, volta_too)
    native_gemv = [r for r in gemv if r["arch_path"] == "native"]
    try:  # the M = 1 launch's cost beyond its bytes (compare bench_read_ceiling's fit)
        m1_fit = fit_launch_cost([r for r in native_gemv if r["m"] == 1])
    except ValueError:  # no M = 1 rows (--section decode, --m without 1, --quick)
        m1_fit = None
    result = {
        "device": props.name,
        "sm_count": sms,
        "torch": torch.__version__,
        "csrc_hash": sources.source_hash(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python3", *sys.argv]),
        "copy_gbps": copy,
        "copy_variants_gbps": copies,
        "l2_handling": "rotating weight/KV copies >= 512 MiB per case; CUDA-graph replay",
        "gemv": gemv,
        "gemv_m1_launch_fit": m1_fit,
        "decode": decode,
        "decode_step_us": {str(m): C.decode_step_us(native_gemv, m) for m in ms},
        "targets": C.targets(native_gemv, decode),
    }
    if args.out:
        write_json(args.out, result, indent=2, newline=True)
    else:
        print(json.dumps(result, indent=2) + "\n")
    print(C.render(result))
    if m1_fit:
        print("GEMV M = 1,", describe_fit(m1_fit))
    print("targets:", json.dumps(result["targets"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
