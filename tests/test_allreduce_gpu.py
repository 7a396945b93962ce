"""The all-reduce kernels on ONE CUDA GPU (run on the H200: job `allreduce1`, call4 in
tests/gpu/results/h200_round_calls.json).

    python -m pytest -q -m gpu tests/test_allreduce_gpu.py

- int12_pack / int12_unpack against the plain-PyTorch reference, bit for bit, on every one
  of the 65,536 fp16 patterns;
- the two-GPU kernels with both "ranks" on one GPU: two registered buffers on the same
  device (each rank's `peer` is the other's buffer, a plain device pointer, so no IPC is
  needed) and the two ranks' kernels on two streams, which run side by side (2 x 32 blocks
  fit any sm_70+ GPU). Both outputs must equal the reference bitwise, for many calls of
  changing sizes (both staging halves, growing call counts), eagerly and as CUDA-graph
  replays (the call count advances on the device, so replays must stay in step).
A hang (the handshake waiting forever) ends the child at its timeout and fails the test.
This proves the kernels' arithmetic, layout and handshake on one device; it proves nothing
about peer memory over NVLink or PCIe, which needs the two-GPU machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from vllm_patch.ops.loader import load_ops
from vllm_patch.distributed import int12 as ref
load_ops()
ops = torch.ops.sm70
what = sys.argv[2]
dev = torch.device("cuda")

def patterns():
    bits = torch.arange(65536, dtype=torch.int32)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return bits.view(torch.float16)

def same_bits(a, b):
    return torch.equal(a.view(torch.int16).cpu(), b.view(torch.int16).cpu())

if what == "format":
    x = patterns()
    packed = ops.int12_pack(x.to(dev))
    assert torch.equal(packed.cpu(), ref.pack(x)), "pack differs from the reference"
    back = ops.int12_unpack(packed)
    assert same_bits(back, ref.unpack(ref.pack(x))), "unpack differs from the reference"
    print("format ok")
    sys.exit(0)

BUF = 1 << 20
a_ptr, _ = ops.allreduce_alloc(BUF)
b_ptr, _ = ops.allreduce_alloc(BUF)
s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
gen = torch.Generator().manual_seed(26)

def inputs(n):
    x = (torch.randn(2, n, generator=gen) * 8).half()
    k = min(64, n)  # some raw fp16 patterns (inf, nan, subnormals) in every call
    x[:, :k] = patterns()[torch.randint(0, 65536, (k,), generator=gen)].view(1, k)
    return x[0].to(dev), x[1].to(dev)

def want(mode, x0, x1):
    f = ref.all_reduce_fp16 if mode == "fp16" else ref.all_reduce_int12
    return f([x0.cpu(), x1.cpu()])

def check(mode, x0, x1, o0, o1):
    w = want(mode, x0, x1)
    nan = torch.isnan(w)
    for o in (o0, o1):
        o = o.cpu()
        assert torch.equal(torch.isnan(o), nan), mode
        assert same_bits(o[~nan], w[~nan]), mode
    assert same_bits(o0.cpu()[~nan], o1.cpu()[~nan]), "ranks differ"

def both(mode, x0, x1):
    op = ops.allreduce_fp16 if mode == "fp16" else ops.allreduce_int12
    torch.cuda.synchronize()
    with torch.cuda.stream(s0):
        o0 = op(x0, a_ptr, b_ptr, BUF)
    with torch.cuda.stream(s1):
        o1 = op(x1, b_ptr, a_ptr, BUF)
    torch.cuda.synchronize()
    return o0, o1

if what == "eager":
    for i in range(200):
        mode = ("fp16", "int12")[i % 2]
        n = 8 * (1 + (i * 7919) % 20000)  # up to 160,000 elements, both halves in turn
        x0, x1 = inputs(n)
        check(mode, x0, x1, *both(mode, x0, x1))
    print("eager ok")

if what == "graphs":
    for mode in ("fp16", "int12"):
        op = ops.allreduce_fp16 if mode == "fp16" else ops.allreduce_int12
        x0, x1 = inputs(5120)
        both(mode, x0, x1)  # warm-up call, eager
        g0, g1 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # capture executes nothing, so neither side waits for the other here
        with torch.cuda.graph(g0, stream=s0):
            o0 = op(x0, a_ptr, b_ptr, BUF)
        with torch.cuda.graph(g1, stream=s1):
            o1 = op(x1, b_ptr, a_ptr, BUF)
        for step in range(2000):
            n0, n1 = inputs(5120)
            x0.copy_(n0)
            x1.copy_(n1)
            torch.cuda.synchronize()
            with torch.cuda.stream(s0):
                g0.replay()
            with torch.cuda.stream(s1):
                g1.replay()
            torch.cuda.synchronize()
            if step % 97 == 0 or step == 1999:
                check(mode, x0, x1, o0, o1)
        # an eager call after the replays is still in step with the other side
        check(mode, x0, x1, *both(mode, x0, x1))
    print("graphs ok")

ops.allreduce_release(a_ptr, False)
ops.allreduce_release(b_ptr, False)
"""


@pytest.mark.parametrize("what", ["format", "eager", "graphs"])
def test_on_one_gpu(what: str) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), what], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"{what} ok" in proc.stdout
