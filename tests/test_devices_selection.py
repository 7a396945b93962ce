"""The one SM70_GPUS resolver (sm70ctl.devices.selection): the rules doctor, plan, serve and
warmup all follow."""

from __future__ import annotations

from sm70ctl.devices.nvml import GpuProbe
from sm70ctl.devices.selection import GpuMatch, resolve_gpu_entries, resolve_gpus

GPUS = [GpuProbe(index=0, uuid="GPU-aa11"), GpuProbe(index=1, uuid="GPU-aa22"),
        GpuProbe(index=2, uuid=None)]


def test_indices_uuids_and_unique_prefixes() -> None:
    got = resolve_gpus(["2", "GPU-AA22", "gpu-aa1"], GPUS)
    assert [m.index for m in got] == [2, 1, 0]
    assert all(m.problem is None and m.hits == 1 for m in got)


def test_what_names_no_gpu() -> None:
    got = resolve_gpus(["GPU-aa", "7", "MIG-x", "", " 1 "], GPUS)
    assert got[0] == GpuMatch("GPU-aa", None, "GPU-aa matches 2 GPUs", 2)
    assert got[1] == GpuMatch("7", None, "7 matches no GPU (found 3)", 0)
    assert got[2].index is None and got[2].hits == 0  # a MIG UUID is not a GPU
    assert got[3].index is None  # an empty entry
    assert got[4] == GpuMatch("1", 1)  # whitespace around an entry is ignored


def test_a_gpu_named_twice_is_a_problem_but_still_found() -> None:
    got = resolve_gpus(["1", "GPU-aa22"], GPUS)
    assert [m.index for m in got] == [1, 1]
    assert got[0].problem is None and got[1].problem == "GPU-aa22 names GPU 1 twice"
    assert resolve_gpu_entries(["1", "GPU-aa22"], GPUS) == ([1, 1],
                                                            ["GPU-aa22 names GPU 1 twice"])


def test_entries_keep_their_order() -> None:
    assert resolve_gpu_entries(["2", "0"], GPUS) == ([2, 0], [])
    assert resolve_gpu_entries([], GPUS) == ([], [])
