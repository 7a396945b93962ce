"""The op surface itself on a CUDA GPU: the loader registers the ops once, the architecture
path is process-wide and checked, and bad input is refused with a message that names the
rule (each case in a child process: a crash must not end the run).

    python -m pytest -q -m gpu tests/gpu/test_ops_surface_gpu.py
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

from vllm_patch.ops import kernels, loader  # noqa: E402

PROBE = Path(__file__).with_name("reject_probe.py")
REJECTIONS = {
    "gemv-rows": "1 to 8 rows",
    "gemv-group": "group_size",
    "gemv-k": "multiple of 16",
    "gemv-bias": "bias",
    "decode-qn": "q_per_seq",
    "decode-gqa": "GQA",
    "decode-splits": "num_splits",
    "arch-path": "sm75",
}


def test_loading_is_idempotent_and_registers_every_op() -> None:
    first = loader.load_ops()
    assert loader.load_ops() == first
    for op in ("gptq_gemv", "int8_gemm_lowrank", "kv_int8_write", "paged_decode",
               "paged_decode_blocks_per_sm", "set_arch_path", "arch_path"):
        assert hasattr(torch.ops.sm70, op), op
    schema = str(torch.ops.sm70.gptq_gemv.default._schema)
    assert "kernel" not in schema and "ksplit" not in schema, schema
    assert "mma" not in str(torch.ops.sm70.paged_decode.default._schema)


def test_arch_path_is_process_wide_and_checked() -> None:
    assert kernels.arch_path() == "native"
    try:
        for path in ("sm70", "native", "sm70"):
            kernels.set_arch_path(path)
            assert kernels.arch_path() == path
    finally:
        kernels.set_arch_path("native")
    with pytest.raises(ValueError, match="arch path"):
        kernels.set_arch_path("volta")
    assert kernels.arch_path() == "native"


def test_bad_input_is_refused_with_the_rule() -> None:
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(PROBE), *REJECTIONS],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = {ln.split(" ", 1)[0]: ln for ln in proc.stdout.splitlines() if ln.strip()}
    for case, message in REJECTIONS.items():
        assert case in lines, (case, proc.stdout, proc.stderr[-2000:])
        assert " REJECTED " in lines[case] and message in lines[case], lines[case]
