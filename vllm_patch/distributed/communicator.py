"""Our tensor-parallel communicator: vLLM's CudaCommunicator with the two-GPU fp16 / 12-bit
all-reduce (csrc/allreduce/) in front of its own chain.

NOT RUN: no two-GPU machine has run this module yet (issue 26 stays open), so the plugin
does NOT install it; `install()` exists for the two-GPU test run and is documented as R4 in
vllm_patch/runtime_patches/README.md. vLLM is imported lazily: the class is built on first
access of `Sm70CudaCommunicator` (vLLM resolves the class by its dotted name), so importing
this module imports neither vLLM nor torch.

How it fits vLLM 0.22.1: `CudaPlatformBase.get_device_communicator_cls` names the class
every GroupCoordinator builds; `graph_capture` asserts it is a CudaCommunicator, hence a
subclass. `all_reduce` runs ours when selection.use_ours says so, else super() (NCCL,
with vLLM's custom all-reduce disabled by --disable-custom-all-reduce). Graph safety is the
kernels': a fixed buffer per rank registered once here, before any capture, and call
counts kept on the device (docs/allreduce.md); nothing per call happens on the host.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_patch.distributed.selection import communicator_mode, use_ours

CLASS_PATH = "vllm_patch.distributed.communicator.Sm70CudaCommunicator"

_lock = threading.Lock()
_built: dict[str, type] = {}


class TwoGpuBuffers:
    """This rank's registered buffer and the peer's, opened through CUDA IPC."""

    def __init__(self, cpu_group: Any, device: Any, rank: int, buffer_bytes: int) -> None:
        import torch
        import torch.distributed as dist

        from vllm_patch.ops.loader import load_ops

        load_ops()
        self.buffer_bytes = buffer_bytes
        with torch.cuda.device(device):
            self.mine, handle = torch.ops.sm70.allreduce_alloc(buffer_bytes)
            handles: list[Any] = [None, None]
            dist.all_gather_object(handles, bytes(handle.tolist()), group=cpu_group)
            peer = torch.tensor(list(handles[1 - rank]), dtype=torch.uint8)
            self.peer = torch.ops.sm70.allreduce_open(peer)
        # both ranks hold both buffers (zeroed) before either launches a kernel
        dist.barrier(group=cpu_group)

    def close(self) -> None:
        import torch

        torch.ops.sm70.allreduce_release(self.peer, True)
        torch.ops.sm70.allreduce_release(self.mine, False)
        self.peer = self.mine = 0


def _build() -> type:
    import torch
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    from vllm_patch.config import PluginConfig

    class Sm70CudaCommunicator(CudaCommunicator):
        def __init__(self, cpu_group: Any, device: Any = None, device_group: Any = None,
                     unique_name: str = "", *args: Any, **kwargs: Any) -> None:
            super().__init__(cpu_group, device, device_group, unique_name, *args, **kwargs)
            cfg = PluginConfig.from_env().allreduce
            self.sm70_mode = communicator_mode(mode=cfg.mode, unique_name=unique_name,
                                               world_size=self.world_size)
            self.sm70_buffers: TwoGpuBuffers | None = None
            if self.sm70_mode is not None:
                self.sm70_buffers = TwoGpuBuffers(self.cpu_group, self.device,
                                                  self.rank_in_group, cfg.buffer_bytes)

        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            bufs = self.sm70_buffers
            if bufs is not None and use_ours(
                mode=self.sm70_mode, dtype=str(input_.dtype).removeprefix("torch."),
                numel=input_.numel(), contiguous=input_.is_contiguous(),
                aligned16=input_.data_ptr() % 16 == 0, buffer_bytes=bufs.buffer_bytes,
            ):
                op = (torch.ops.sm70.allreduce_fp16 if self.sm70_mode == "fp16"
                      else torch.ops.sm70.allreduce_int12)
                return op(input_, bufs.mine, bufs.peer, bufs.buffer_bytes)
            return super().all_reduce(input_)

        def destroy(self) -> None:
            if self.sm70_buffers is not None:
                self.sm70_buffers.close()
                self.sm70_buffers = None
            super().destroy()

    Sm70CudaCommunicator.__module__ = __name__
    return Sm70CudaCommunicator


def __getattr__(name: str) -> Any:
    if name != "Sm70CudaCommunicator":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _lock:
        if name not in _built:
            _built[name] = _build()
        return _built[name]


def install() -> str:
    """R4 (NOT RUN; not called by the plugin): make vLLM's CUDA platform build our
    communicator for every group. Call in every process before the groups are built."""
    from vllm.platforms.cuda import CudaPlatformBase

    def get_device_communicator_cls(cls: type) -> str:
        return CLASS_PATH

    CudaPlatformBase.get_device_communicator_cls = classmethod(  # type: ignore[method-assign]
        get_device_communicator_cls
    )
    return CLASS_PATH
