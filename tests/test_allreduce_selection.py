"""Which all-reduce serves a call (vllm_patch/distributed/selection.py, pure) and the
communicator's glue (communicator.py) on the CPU: the class builds on the installed vLLM as
a CudaCommunicator subclass and routes fp16 tensors that fit to our op, everything else to
super(). The communicator itself has NOT run on two GPUs; nothing here pretends it has.

The buffer arithmetic is compared with the constants of csrc/allreduce/two_gpu.cuh, so the
Python capacity and the kernel's launch check cannot drift apart silently.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_patch.distributed import selection as sel

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "csrc" / "allreduce" / "two_gpu.cuh"
SERVE_PY = ROOT / ".serve-venv" / "bin" / "python"
MiB = 1024 * 1024


def test_constants_match_the_kernel_header() -> None:
    text = HEADER.read_text()
    assert int(re.search(r"kArHeaderBytes = (\d+);", text).group(1)) == sel.HEADER_BYTES
    # the capacity expressions of ar_capacity: half / 12 * 8 (12-bit), half / 16 * 8 (fp16)
    assert "half / 12ull * 8ull : half / 16ull * 8ull" in text
    assert "((total - kArHeaderBytes) / 2) & ~15ull" in text


@pytest.mark.parametrize(("buffer", "fp16", "int12"), [
    (16 * MiB, (16 * MiB - 4096) // 2 // 16 * 8, (16 * MiB - 4096) // 2 // 12 * 8),
    (4096, 0, 0),
    (4096 + 32, 8, 8),  # halves of 16 bytes: one fp16 group (16 B) or one packed (12 B)
    (4096 + 63, 8, 8),  # halves of 29 bytes round down to 16
    (4096 + 64, 16, 16),  # halves of 32 bytes: two fp16 groups, two packed (24 B)
    (4096 + 96, 24, 32),  # halves of 48 bytes: three fp16 groups, four packed
])
def test_capacity(buffer: int, fp16: int, int12: int) -> None:
    assert sel.capacity_elements(buffer, "fp16") == fp16
    assert sel.capacity_elements(buffer, "int12") == int12


def test_capacity_examples() -> None:
    # a 16 MiB buffer: 8 MiB halves; fp16 stages 2 B per element, 12-bit 1.5 B
    assert sel.half_bytes(16 * MiB) == 8 * MiB - 2048
    assert sel.capacity_elements(16 * MiB, "fp16") == (8 * MiB - 2048) // 2
    assert sel.capacity_elements(16 * MiB, "int12") == (8 * MiB - 2048) // 12 * 8
    with pytest.raises(ValueError, match="nccl"):
        sel.capacity_elements(16 * MiB, "nccl")


@pytest.mark.parametrize(("mode", "name", "world", "want"), [
    ("fp16", "tp:0", 2, "fp16"),
    ("int12", "tp:3", 2, "int12"),
    ("nccl", "tp:0", 2, None),
    ("auto", "tp:0", 2, None),  # not resolved by sm70ctl: vLLM's own path
    ("fp16", "tp:0", 4, None),
    ("fp16", "tp:0", 1, None),
    ("fp16", "pp:0", 2, None),
    ("fp16", "dp:0", 2, None),
    ("fp16", "eptp:0", 2, None),  # a name that merely contains "tp"
])
def test_communicator_mode(mode: str, name: str, world: int, want: str | None) -> None:
    assert sel.communicator_mode(mode=mode, unique_name=name, world_size=world) == want


def call(**over: object) -> bool:
    args: dict = {"mode": "fp16", "dtype": "float16", "numel": 5120, "contiguous": True,
                  "aligned16": True, "buffer_bytes": 16 * MiB}
    args.update(over)
    return sel.use_ours(**args)


def test_a_decode_step_all_reduce_is_ours() -> None:
    assert call()  # one token's hidden state, 10 KiB
    assert call(mode="int12", numel=8 * 5120)


@pytest.mark.parametrize("over", [
    {"mode": None}, {"mode": "nccl"}, {"dtype": "bfloat16"}, {"dtype": "float32"},
    {"contiguous": False}, {"aligned16": False}, {"numel": 0}, {"numel": 5124},
    {"numel": sel.capacity_elements(16 * MiB, "fp16") + 8},
    {"mode": "int12", "numel": sel.capacity_elements(16 * MiB, "int12") + 8},
])
def test_everything_else_goes_to_super(over: dict) -> None:
    assert not call(**over)


def test_the_largest_call_that_fits() -> None:
    for mode in ("fp16", "int12"):
        cap = sel.capacity_elements(16 * MiB, mode)
        assert call(mode=mode, numel=cap)
    # a 2048-token prefill chunk (20 MiB) does not fit a 16 MiB buffer: NCCL
    assert not call(numel=2048 * 5120)


# ------------------------------------------------------------------ the communicator's glue
def test_importing_the_communicator_imports_neither_torch_nor_vllm() -> None:
    code = ("import sys; import vllm_patch.distributed.communicator as c; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True, env={**os.environ,
                                                                 "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"


def test_the_plugin_does_not_install_the_communicator() -> None:
    """Not registered by default until it has run on two GPUs (runtime_patches R4)."""
    for path in (ROOT / "vllm_patch").rglob("*.py"):
        if path.parent.name == "distributed":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                    a.name for a in node.names]
                assert not any("distributed.communicator" in n for n in names), path
    readme = (ROOT / "vllm_patch" / "runtime_patches" / "README.md").read_text()
    section = readme[readme.index("## R4."):]
    assert "NOT RUN" in section and "not installed" in section


GLUE = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
calls = []
lib = torch.library.Library("sm70", "DEF")
for name in ("allreduce_fp16", "allreduce_int12"):
    lib.define(name + "(Tensor x, int mine, int peer, int buffer_bytes) -> Tensor")
    def impl(x, mine, peer, buffer_bytes, name=name):
        calls.append((name, mine, peer, buffer_bytes))
        return x * 2
    lib.impl(name, impl, "CPU")
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
def base_all_reduce(self, x):
    calls.append(("super", str(x.dtype), x.numel()))
    return x
CudaCommunicator.all_reduce = base_all_reduce
from vllm_patch.distributed import communicator as c
cls = c.Sm70CudaCommunicator
assert issubclass(cls, CudaCommunicator) and cls is c.Sm70CudaCommunicator
assert cls.__module__ + "." + cls.__name__ == c.CLASS_PATH
class Bufs:
    mine, peer, buffer_bytes = 4096 * 16, 8192 * 16, 16 * 2**20
inst = object.__new__(cls)
inst.sm70_buffers, inst.sm70_mode = Bufs(), "int12"
x = torch.ones(5120, dtype=torch.float16)
assert torch.equal(inst.all_reduce(x), x * 2)
inst.all_reduce(torch.ones(5120, dtype=torch.float32))
inst.all_reduce(torch.ones(5121, dtype=torch.float16))
inst.all_reduce(torch.ones(16, 8, dtype=torch.float16).t())
inst.all_reduce(torch.ones(5128, dtype=torch.float16)[1:5121])  # 2 bytes off alignment
inst.sm70_mode = "fp16"
inst.all_reduce(x)
inst.sm70_buffers = None
inst.all_reduce(x)
print(repr(calls))
"""


def test_the_communicator_routes_calls_on_the_installed_vllm() -> None:
    py = sys.executable if importlib.util.find_spec("vllm") else str(SERVE_PY)
    if not Path(py).is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"no vLLM here and no {SERVE_PY} (CI must provide it)")
        pytest.skip(f"no vLLM here and no {SERVE_PY}")
    out = subprocess.run([py, "-c", GLUE, str(ROOT)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    calls = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert calls == [
        ("allreduce_int12", 4096 * 16, 8192 * 16, 16 * MiB),
        ("super", "torch.float32", 5120),
        ("super", "torch.float16", 5121),
        ("super", "torch.float16", 128),
        ("super", "torch.float16", 5120),
        ("allreduce_fp16", 4096 * 16, 8192 * 16, 16 * MiB),
        ("super", "torch.float16", 5120),
    ]
