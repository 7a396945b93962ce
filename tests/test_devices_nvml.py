"""The one NVML probe (sm70ctl.devices.nvml) on a stand-in pynvml, and the plan's reading of it.

The stand-in answers the few queries the tests care about and refuses every other one with
an NVMLError, the way a driver refuses a query it does not support; the probe must record
those refusals and carry on.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from sm70ctl.devices import nvml
from sm70ctl.plan import gpus as plan_gpus

V100_TOTAL = 34_089_730_048  # not a whole number of MiB: the plan needs the bytes


class NVMLError(Exception):
    pass


@dataclass
class _Mem:
    total: int
    used: int


@dataclass
class _Pci:
    busId: str


class FakeNvml(types.ModuleType):
    def __init__(self, cards: list[tuple[str, str, int]], init_error: bool = False) -> None:
        super().__init__("pynvml")
        self.cards = cards  # (name, uuid, total bytes)
        self.init_error = init_error
        self.pairs: list[tuple[int, int]] = []
        self.NVMLError = NVMLError

    def __getattr__(self, name: str) -> Any:
        if name.startswith("NVMLError_"):
            raise AttributeError(name)
        if name.startswith("NVML_"):
            return 0

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise NVMLError(f"{name}: Not Supported")

        return refuse

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.cards[h][0].encode()

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.cards[h][1]

    def nvmlDeviceGetPciInfo(self, h: int) -> _Pci:
        return _Pci(f"00000000:{0x1A + h:02X}:00.0")

    def nvmlDeviceGetMemoryInfo(self, h: int, version: Any = None) -> _Mem:
        return _Mem(self.cards[h][2], 3 << 20)

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, cap: int) -> int:
        self.pairs.append((a, b))
        return 0


CARDS = [("Tesla T4", "GPU-aaaa-1", 16 << 30), ("Tesla V100-SXM2-32GB", "GPU-bbbb-2", V100_TOTAL),
         ("Tesla V100-SXM2-32GB", "GPU-cccc-3", V100_TOTAL)]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    module = FakeNvml(list(CARDS))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    yield module


def test_every_gpu_with_exact_bytes_and_refusals_recorded(fake: FakeNvml) -> None:
    probe = nvml.probe_nvml(())
    assert probe.available and [g.index for g in probe.gpus] == [0, 1, 2]
    v100 = probe.gpus[1]
    assert (v100.name, v100.uuid, v100.memory_total_bytes) == CARDS[1]
    assert v100.memory_total_mib == V100_TOTAL // (1 << 20) and v100.memory_used_mib == 3
    assert v100.pci_bus_id == "00000000:1B:00.0"
    assert "persistence" in v100.errors and v100.persistence_mode is None
    assert probe.pairs == []  # no GPUs selected: no pair probed


def test_pairs_follow_the_selected_gpus(fake: FakeNvml) -> None:
    probe = nvml.probe_nvml(["GPU-cccc", "1", "7"])  # a UUID prefix, an index, a missing one
    assert [(p.a, p.b) for p in probe.pairs] == [(2, 1)]
    assert probe.pairs[0].p2p_read == "ok"  # the stand-in's constants are all 0, P2P_STATUS_OK too


def test_no_driver(fake: FakeNvml) -> None:
    fake.init_error = True
    probe = nvml.probe_nvml(("0",))
    assert not probe.available and probe.gpus == [] and probe.error == "Driver Not Loaded"
    assert probe.error_kind == "other"
    assert plan_gpus.probe_nvml() is None


def test_the_plan_reads_names_uuids_and_bytes(fake: FakeNvml) -> None:
    rows = plan_gpus.probe_nvml()
    assert rows == [{"index": i, "name": n, "uuid": u, "total": t}
                    for i, (n, u, t) in enumerate(CARDS)]
    src = plan_gpus.resolve_gpus(None, 2, rows, ["GPU-cccc", "1"])
    assert [(g.index, g.total_bytes) for g in src.gpus] == [(2, V100_TOTAL), (1, V100_TOTAL)]


def test_the_plan_refuses_what_the_resolver_refuses(fake: FakeNvml) -> None:
    from sm70ctl.errors import Sm70Error

    rows = plan_gpus.probe_nvml()
    with pytest.raises(Sm70Error, match="GPU-bbbb names GPU 1 twice"):
        plan_gpus.resolve_gpus(None, 2, rows, ["1", "GPU-bbbb"])
    with pytest.raises(Sm70Error, match="GPU- matches 3 GPUs"):
        plan_gpus.resolve_gpus(None, 2, rows, ["GPU-"])
