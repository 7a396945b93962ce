"""The two-GPU all-reduce on two GPUs of one host (NOT RUN yet: no two-GPU machine was
lent; issue 26 stays open until this passes there).

    python -m pytest -q -m gpu tests/test_allreduce_two_gpu.py
    SM70_ALLREDUCE_RESULTS=out.json  (optional: the results JSON the issue asks for)

Two processes (one per GPU, NCCL for the reference, gloo for the IPC handles, as vLLM's
groups), each registering its buffer through vllm_patch.distributed.communicator's
TwoGpuBuffers (CUDA IPC, peer access):
- correctness: fp16 equals NCCL's sum and the reference bitwise, 12-bit equals the
  reference bitwise, both ranks equal, over sizes from one group of 8 to the buffer's
  capacity;
- 10,000 replays of a CUDA graph holding the all-reduce (a decode step's size), inputs
  changed between replays, checked along the way: no hang (the child's timeout), no drift;
- latency at 10 KiB and bandwidth at 80 MiB against NCCL in the same run (recorded in the
  results JSON, not asserted: the issue's targets are judged from that file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs"),
]

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, socket, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
sys.path.insert(0, sys.argv[1])
RESULTS = sys.argv[2]

MiB = 1 << 20

def rank_main(rank, port, queue):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=dev)
    cpu = dist.new_group(backend="gloo")
    from vllm_patch.distributed import int12 as ref
    from vllm_patch.distributed.communicator import TwoGpuBuffers
    from vllm_patch.distributed.selection import capacity_elements
    ops = torch.ops.sm70
    BUF = 16 * MiB
    bufs = TwoGpuBuffers(cpu, dev, rank, BUF)
    gen = torch.Generator().manual_seed(100 + rank)
    out = {"rank": rank, "checks": 0}

    def mine(n):
        return ((torch.randn(n, generator=gen) * 4).half()).to(dev)

    def both(x):
        got = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(got, x)
        return [g.cpu() for g in got]

    def bits(t):
        return t.view(torch.int16).cpu()

    def check(mode, x, y):
        a, b = both(x)
        want = (ref.all_reduce_fp16 if mode == "fp16" else ref.all_reduce_int12)([a, b])
        assert torch.equal(bits(y), bits(want)), (mode, x.numel())
        other = [torch.empty_like(y) for _ in range(2)]
        dist.all_gather(other, y)
        assert torch.equal(bits(other[0]), bits(other[1])), ("ranks differ", mode)
        out["checks"] += 1

    op = {"fp16": ops.allreduce_fp16, "int12": ops.allreduce_int12}
    for mode in ("fp16", "int12"):
        for n in (8, 5120, 4 * 5120, 8 * 5120, 2048 * 64, capacity_elements(BUF, mode)):
            x = mine(n)
            y = op[mode](x, bufs.mine, bufs.peer, BUF)
            check(mode, x, y)
            if mode == "fp16":
                z = x.clone()
                dist.all_reduce(z)
                out.setdefault("fp16_equals_nccl", True)
                out["fp16_equals_nccl"] &= bool(torch.equal(bits(z), bits(y)))

    # CUDA graph: one decode-step all-reduce, replayed 10,000 times
    for mode in ("fp16", "int12"):
        x = mine(5120)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            op[mode](x, bufs.mine, bufs.peer, BUF)  # warm-up
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = op[mode](x, bufs.mine, bufs.peer, BUF)
        t0 = time.time()
        for step in range(10_000):
            if step % 1000 == 0 or step == 9_999:
                x.copy_(mine(5120))
                g.replay()
                check(mode, x, y)
            else:
                g.replay()
        torch.cuda.synchronize()
        out[f"graph_{mode}_10000_replays_s"] = time.time() - t0

    def timed(fn, iters):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        dist.barrier(cpu)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / iters * 1000.0  # microseconds per call

    small = mine(5120)
    out["us_10KiB"] = {
        "nccl": timed(lambda: dist.all_reduce(small.clone()), 1000),
        "fp16": timed(lambda: op["fp16"](small, bufs.mine, bufs.peer, BUF), 1000),
        "int12": timed(lambda: op["int12"](small, bufs.mine, bufs.peer, BUF), 1000),
    }
    big_n = 80 * MiB // 2
    big_buf = 2 * 80 * MiB + 4096 + 64
    big = TwoGpuBuffers(cpu, dev, rank, big_buf)
    xb = mine(big_n)
    out["us_80MiB"] = {
        "nccl": timed(lambda: dist.all_reduce(xb.clone()), 20),
        "fp16": timed(lambda: op["fp16"](xb, big.mine, big.peer, big_buf), 20),
        "int12": timed(lambda: op["int12"](xb, big.mine, big.peer, big_buf), 20),
    }
    big.close()
    bufs.close()
    out["device"] = torch.cuda.get_device_name(dev)
    queue.put(out)
    dist.destroy_process_group()

if __name__ == "__main__":
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results.sort(key=lambda r: r["rank"])
    if RESULTS:
        with open(RESULTS, "w") as fh:
            json.dump({"not_a_v100": "H200" in results[0]["device"], "ranks": results}, fh,
                      indent=1)
    print("two-gpu ok", json.dumps(results[0]))
"""


def test_two_gpu_all_reduce() -> None:
    script = Path(os.environ.get("TMPDIR", "/tmp")) / "sm70_allreduce_two_gpu.py"
    script.write_text(CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), str(ROOT), os.environ.get("SM70_ALLREDUCE_RESULTS", "")],
        capture_output=True, text=True, timeout=1500, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "two-gpu ok" in proc.stdout
    result = json.loads(proc.stdout.split("two-gpu ok", 1)[1])
    assert result["checks"] > 20
    assert result["fp16_equals_nccl"], "the fp16 all-reduce differs from NCCL's sum"
