"""How the decode benches time a GPU: CUDA-graph replay, the copy yardstick and a plain
streaming kernel over the same bytes (torch; no sm70 ops)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from decode_cases import copies_for


def time_graph(calls: list[Callable[[], object]], reps: int = 7) -> float:
    """Median seconds per call of a list of closures, replayed from one CUDA graph (launch
    gaps between graph nodes count, Python and eager launch overhead do not)."""
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


def copy_bandwidth() -> dict[str, float]:
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


def same_bytes_stream_us(nbytes: int) -> float:
    """Microseconds to stream nbytes through the SMs (nbytes / 2 read, nbytes / 2 written):
    torch.bitwise_not over int32, graphed and rotated like the kernels. Not copy_: inside a
    CUDA graph a device-to-device copy_ becomes a memcpy node, which runs well below the
    eager copy and switches between two speeds from case to case."""
    words = max(4, nbytes // 8 // 4 * 4)  # int32 words per side
    ncopy = copies_for(8 * words)
    src = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(ncopy)]
    dst = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(ncopy)]
    calls = [
        (lambda i=i: torch.bitwise_not(src[i % ncopy], out=dst[i % ncopy]))
        for i in range(max(ncopy, 16))
    ]
    return time_graph(calls) * 1e6 * nbytes / (8 * words)
