"""The fastest read-only stream over the decode kernels' byte counts, on the GPU at hand.

    python bench/bench_read_ceiling.py --out read_ceiling.json

A yardstick for the GEMV and attention figures of bench_decode_kernels.py: what a kernel
that only reads the same bytes (no math, one 4-byte result per thread) reaches, as a
fraction of the same 4 GiB device-to-device copy, with the same L2 handling (rotating
copies >= 512 MiB, CUDA-graph replay). The bench's "same bytes" stream (torch.bitwise_not)
reads half and writes half; a read-only kernel reaches more (no write traffic), and the
GEMV reads only. Several grid shapes and loads in flight per thread are timed; the table
shows the best and how the time depends on the bytes in flight per SM. Needs nvcc (it
compiles its kernel with torch.utils.cpp_extension.load_inline). Every figure is measured
in this run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_cases as C
from bench_io import write_json
from gpu_timing import copy_bandwidth, time_graph
from launch_cost import describe_fit, fit_launch_cost

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
// every thread reads U 16-byte words a loop step, all issued before any is used; the
// xor of everything is written only if it equals a constant, so nothing is optimised away
template <int U>
__global__ void read_stream(const int4* __restrict__ p, long long n, int* out) {
  int acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldg(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const int4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x5eed1e55) out[0] = acc;
}

void read_words(torch::Tensor x, torch::Tensor out, int64_t grid, int64_t threads, int64_t u) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.nbytes() % 16 == 0,
              "x: contiguous CUDA, 16-byte words");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* p = reinterpret_cast<const int4*>(x.data_ptr());
  const long long n = (long long)(x.nbytes() / 16);
  int* o = out.data_ptr<int>();
  const dim3 g((unsigned)grid), b((unsigned)threads);
  switch (u) {
    case 1: read_stream<1><<<g, b, 0, stream>>>(p, n, o); break;
    case 2: read_stream<2><<<g, b, 0, stream>>>(p, n, o); break;
    case 4: read_stream<4><<<g, b, 0, stream>>>(p, n, o); break;
    case 8: read_stream<8><<<g, b, 0, stream>>>(p, n, o); break;
    default: TORCH_CHECK(false, "u must be 1, 2, 4 or 8");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""
# (blocks per SM, threads per block, 16-byte loads in flight per thread)
CONFIGS = [
    (4, 256, 1), (8, 256, 1), (4, 256, 2), (8, 256, 2), (4, 256, 4), (8, 256, 4),
    (16, 128, 2), (16, 128, 4), (2, 1024, 4), (4, 256, 8),
]


def cases() -> list[tuple[str, int]]:
    """(name, bytes): a 64 KB read (what one launch costs when it moves almost nothing),
    the GEMV shapes' weight bytes and the attention contexts' KV bytes."""
    out = [("floor 64 KB", 64 * 1024)]
    for name, n, k in C.GEMV_SHAPES:
        out.append((f"gemv {name}", C.gemv_group_and_bytes(name, n, k)[1]))
    for ctx in (65536, 262144):
        out.append((f"attention {ctx // 1024}K", C.kv_bytes(ctx)))
    return out


def time_configs(ext, nbytes: int, sms: int) -> dict[str, float]:
    """Microseconds per read of nbytes for every config, rotating copies, graphed."""
    ncopy = C.copies_for(nbytes)
    bufs = [
        torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
        for _ in range(ncopy)
    ]
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = {}
    read = ext.read_words
    for bps, threads, u in CONFIGS:
        calls = [
            (lambda b=bufs[i % ncopy], g=bps * sms, t=threads, u=u: read(b, sink, g, t, u))
            for i in range(max(ncopy, 16))
        ]
        out[f"{bps}x{threads}_u{u}"] = time_graph(calls) * 1e6
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure", file=sys.stderr)
        return 1
    from torch.utils.cpp_extension import load_inline

    ext = load_inline(
        "sm70_read_ceiling",
        "void read_words(torch::Tensor x, torch::Tensor out, int64_t grid, int64_t threads,"
        " int64_t u);",
        cuda_sources=SOURCE,
        functions=["read_words"],
        extra_cuda_cflags=["-O3"],
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()["eager_gbps"]
    rows = []
    for name, nbytes in cases():
        nbytes = (nbytes + 15) // 16 * 16
        by_config = time_configs(ext, nbytes, sms)
        best = min(by_config, key=by_config.get)
        us = by_config[best]
        row = {
            "case": name,
            "bytes": nbytes,
            "best_config": best,
            "us": us,
            "frac_of_copy": nbytes / (us * 1e-6) / 1e9 / copy,
            "us_by_config": by_config,
        }
        rows.append(row)
        brief = {k: row[k] for k in ("case", "bytes", "best_config", "us", "frac_of_copy")}
        print(json.dumps(brief), flush=True)
    result = {
        "device": torch.cuda.get_device_name(0),
        "sm_count": sms,
        "copy_gbps": copy,
        "l2_handling": "rotating copies >= 512 MiB per case; CUDA-graph replay",
        "configs": "blocks per SM x threads per block _u 16-byte loads in flight per thread",
        "kb_in_flight_per_sm_by_config": {
            f"{b}x{t}_u{u}": b * t * u * 16 // 1024 for b, t, u in CONFIGS
        },
        "rows": rows,
        "fit": fit_launch_cost(rows),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python3", *sys.argv]),
    }
    print(f"copy {copy:.0f} GB/s (4 GiB, read + written, eager)")
    head = f"{'case':28s} {'MB':>8s} {'best us':>9s} {'% copy':>7s}  {'best config':12s}"
    print(head + "  16 KB/SM  32 KB/SM  64 KB/SM")
    for r in rows:
        by = r["us_by_config"]
        print(
            f"{r['case']:28s} {r['bytes'] / 1e6:8.1f} {r['us']:9.2f}"
            f" {r['frac_of_copy'] * 100:6.0f} %  {r['best_config']:12s}"
            f" {by['4x256_u1']:8.2f} {by['4x256_u2']:9.2f} {by['4x256_u4']:9.2f}"
        )
    print(describe_fit(result["fit"]))
    if args.out:
        write_json(args.out, result, indent=2, newline=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
