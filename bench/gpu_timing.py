"""How the benches time a GPU: CUDA events around one call, CUDA-graph replay, the copy
yardstick, a plain streaming kernel over the same bytes, the tensor-core ceiling of
fmha_tc_peak and our kernels timed against it on one architecture path. torch is imported
by each function, not here: the benches' pure parts (and their CPU tests) import this module
on machines without a GPU."""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

from decode_cases import copies_for

PEAK_FLOPS_PER_MMA = {"m8n8k4": 2048, "m16n8k16": 4096}  # per warp instruction
PEAK_CHAINS = 8  # independent accumulators per warp in fmha_tc_peak
PEAK_WARPS = 8  # per block


def event_seconds(fn: Callable[[], object]) -> float:
    """Seconds of one call of fn between two CUDA events on the current stream."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_ms(fn: Callable[[], object], min_reps: int = 3, target_s: float = 0.3) -> float:
    """Median milliseconds of fn over CUDA events, after one warm-up call: at least
    `min_reps` calls, more (up to 50) while `target_s` lasts. An even count takes the upper
    of the two middle times."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    t_end = time.monotonic() + target_s
    while len(times) < min_reps or (time.monotonic() < t_end and len(times) < 50):
        times.append(event_seconds(fn) * 1e3)
    times.sort()
    return times[len(times) // 2]


def time_graph(calls: list[Callable[[], object]], reps: int = 7) -> float:
    """Median seconds per call of a list of closures, replayed from one CUDA graph (launch
    gaps between graph nodes count, Python and eager launch overhead do not)."""
    import torch

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
    times = [event_seconds(graph.replay) / len(calls) for _ in range(reps)]
    return statistics.median(times)


def copy_bandwidth() -> dict[str, float]:
    """Device-to-device copy of 4 GiB, bytes read + written over time: eager and graphed."""
    import torch

    n = 4 * 2**30
    src = torch.empty(n // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    eager = [event_seconds(lambda: dst.copy_(src)) for _ in range(10)]
    t_graph = time_graph([lambda: dst.copy_(src)] * 4)
    return {
        "eager_gbps": 2 * n / statistics.median(eager) / 1e9,
        "graph_gbps": 2 * n / t_graph / 1e9,
    }


def same_bytes_stream_us(nbytes: int) -> float:
    """Microseconds to stream nbytes through the SMs (nbytes / 2 read, nbytes / 2 written):
    torch.bitwise_not over int32, graphed and rotated like the kernels. Not copy_: inside a
    CUDA graph a device-to-device copy_ becomes a memcpy node, which runs well below the
    eager copy and switches between two speeds from case to case."""
    import torch

    words = max(4, nbytes // 8 // 4 * 4)  # int32 words per side
    ncopy = copies_for(8 * words)
    src = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(ncopy)]
    dst = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(ncopy)]
    calls = [
        (lambda i=i: torch.bitwise_not(src[i % ncopy], out=dst[i % ncopy]))
        for i in range(max(ncopy, 16))
    ]
    return time_graph(calls) * 1e6 * nbytes / (8 * words)


def peak_flops(shape: str, blocks: int, iters: int) -> int:
    """FLOPs of one fmha_tc_peak launch (pure)."""
    return PEAK_FLOPS_PER_MMA[shape] * PEAK_CHAINS * PEAK_WARPS * blocks * iters


def measure_peaks(kernels: Any) -> dict[str, float]:
    """TFLOP/s of fmha_tc_peak's m8n8k4 loop (and m16n8k16 on sm_80+) on this GPU: the
    ceiling the tensor-core benches divide by."""
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = 4 * sms
    out = torch.empty(blocks * 256, device="cuda")
    peaks = {}
    shapes = ["m8n8k4"] + (["m16n8k16"] if torch.cuda.get_device_capability(0)[0] >= 8 else [])
    for shape in shapes:
        wide = shape == "m16n8k16"
        iters = 64
        while True:  # grow until one launch takes a few tens of milliseconds
            ms = time_ms(lambda i=iters, w=wide: kernels.fmha_tc_peak(out, i, w), min_reps=3,
                         target_s=0)
            if ms > 20 or iters >= 1 << 22:
                break
            iters *= 4
        ms = time_ms(lambda i=iters, w=wide: kernels.fmha_tc_peak(out, i, w))
        peaks[shape] = peak_flops(shape, blocks, iters) / (ms * 1e-3) / 1e12
    return peaks


def record_peaks(kernels: Any, result: dict[str, Any]) -> dict[str, float]:
    """measure_peaks into result["peak_tflops"]; if it fails, the error goes to
    result["errors"] and the peaks are empty (the rows then leave their fractions out)."""
    try:
        result["peak_tflops"] = peaks = measure_peaks(kernels)
    except Exception as exc:
        peaks = {}
        result["errors"].append(f"peak: {exc!r}")
    return peaks


def time_against_peaks(row: dict[str, Any], fn: Callable[[], object], flops: float,
                       peaks: dict[str, float]) -> None:
    """Into `row`: fn's median ms (time_ms), its TFLOP/s for `flops`, and its fraction of
    each tensor-core ceiling measured (frac_of_<shape>_peak)."""
    row["ms"] = time_ms(fn)
    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    for shape in PEAK_FLOPS_PER_MMA:
        if shape in peaks:
            row[f"frac_of_{shape}_peak"] = row["tflops"] / peaks[shape]


def time_on_arch_path(kernels: Any, row: dict[str, Any], path: str, fn: Callable[[], object],
                      flops: float, peaks: dict[str, float], errors: list[str],
                      then: Callable[[], Any] | None = None) -> Any:
    """Into `row` (its impl and tokens set): fn timed against the peaks (time_against_peaks)
    on our kernels' architecture path `path`, then then() on that path too; the path goes
    back to native whatever happens. A failure leaves its repr in row["error"], its
    traceback in `errors`, and gives None; else then()'s value (None without it)."""
    try:
        kernels.set_arch_path(path)
        time_against_peaks(row, fn, flops, peaks)
        return None if then is None else then()
    except Exception as exc:
        row["error"] = repr(exc)[:300]
        errors.append(f"{row['impl']} {row['tokens']}: {traceback.format_exc()[-800:]}")
        return None
    finally:
        kernels.set_arch_path("native")
