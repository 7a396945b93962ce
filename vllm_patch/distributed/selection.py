"""Which all-reduce serves a call, and how much one call may carry (pure Python, no torch).

The communicator (communicator.py) asks two questions:
- at construction, `communicator_mode`: does this group get our two-GPU all-reduce at all?
  Only vLLM's tensor-parallel group ("tp:N"), only with exactly two ranks, and only when the
  plugin configuration's `allreduce.mode` is a resolved "fp16" or "int12" (sm70ctl resolves
  it from the probed topology: sm70ctl/devices/topology.py). "nccl", and an "auto" that
  nobody resolved (vLLM started without sm70ctl), keep vLLM's own path.
- per call, `use_ours`: an fp16, contiguous, 16-byte aligned tensor whose element count is
  a multiple of 8 and fits one staging half of the buffer (`capacity_elements`); anything
  else goes to `super().all_reduce` (NCCL).

The buffer arithmetic mirrors csrc/allreduce/two_gpu.cuh (ar_half_bytes, ar_capacity): a
buffer of SM70_ALLREDUCE_BUFFER_BYTES holds a 4 KiB header and two staging halves, one per
call parity, so a call carries at most half the buffer: 2 bytes per element in fp16, 3/2
in the 12-bit format (a test compares the constants with the header).
"""

from __future__ import annotations

OURS = ("fp16", "int12")
HEADER_BYTES = 4096  # kArHeaderBytes
GROUP_ELEMENTS = 8  # one 16-byte load of halves per thread
STAGED_BYTES_PER_GROUP = {"fp16": 16, "int12": 12}


def half_bytes(buffer_bytes: int) -> int:
    """One staging half of a buffer (16-byte aligned; 0 when the buffer is too small)."""
    if buffer_bytes <= HEADER_BYTES:
        return 0
    return ((buffer_bytes - HEADER_BYTES) // 2) & ~15


def capacity_elements(buffer_bytes: int, mode: str) -> int:
    """The most fp16 elements one call may reduce in `mode` with this buffer."""
    if mode not in STAGED_BYTES_PER_GROUP:
        raise ValueError(f"allreduce.mode {mode!r}: our all-reduce is fp16 or int12")
    return half_bytes(buffer_bytes) // STAGED_BYTES_PER_GROUP[mode] * GROUP_ELEMENTS


def is_tensor_parallel_group(unique_name: str) -> bool:
    """vLLM names its groups "<name>:<n>" (parallel_state._get_unique_name); "tp" is TP."""
    return unique_name.split(":", 1)[0] == "tp"


def communicator_mode(*, mode: str, unique_name: str, world_size: int) -> str | None:
    """Our all-reduce mode for this group ("fp16" / "int12"), or None for vLLM's own."""
    if mode not in OURS or world_size != 2 or not is_tensor_parallel_group(unique_name):
        return None
    return mode


def use_ours(*, mode: str | None, dtype: str, numel: int, contiguous: bool, aligned16: bool,
             buffer_bytes: int) -> bool:
    """Whether this call runs our kernel (else super().all_reduce). `dtype` is the torch
    dtype's name without the "torch." prefix."""
    if mode not in OURS:
        return False
    if dtype != "float16" or not contiguous or not aligned16:
        return False
    if numel <= 0 or numel % GROUP_ELEMENTS:
        return False
    return numel <= capacity_elements(buffer_bytes, mode)
