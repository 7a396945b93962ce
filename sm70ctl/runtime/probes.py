"""What a server start needs to know about this machine, as plain data (the side effects
serve's pre-flight and warmup's step plan share): the GPUs and how busy they are, the model
folder, the serving interpreter.

GPU data comes from the one NVML probe (sm70ctl.devices.nvml), reduced to the few fields
the checks judge.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sm70ctl.devices.nvml import probe_nvml
from sm70ctl.devices.selection import resolve_gpu_entries
from sm70ctl.devices.topology import AllreduceChoice, choose_allreduce, serving_links
from sm70ctl.errors import Sm70Error
from sm70ctl.readers import read_json
from sm70ctl.settings.typed import SettingsView


@dataclass(frozen=True)
class GpuUse:
    """What pre-flight needs to know about one GPU (from the NVML probe)."""

    index: int
    uuid: str | None = None
    name: str | None = None
    memory_used_mib: int | None = None
    processes: tuple[tuple[int, str | None, int | None], ...] = ()  # (pid, name, MiB)


@dataclass(frozen=True)
class ModelDirState:
    path: str
    exists: bool
    config: Mapping[str, Any] | None = None
    error: str | None = None


def probe_model_dir(path: Path) -> ModelDirState:
    path = Path(path).expanduser()
    if not path.is_dir():
        return ModelDirState(str(path), exists=False)
    cfg = path / "config.json"
    if not cfg.exists():
        return ModelDirState(str(path), exists=True, error="config.json is missing")
    try:
        data = read_json(cfg, what="model config")
    except Sm70Error as exc:
        return ModelDirState(str(path), exists=True, error=exc.message)
    if not isinstance(data, dict):
        return ModelDirState(str(path), exists=True, error="config.json is not an object")
    return ModelDirState(str(path), exists=True, config=data)


def probe_executable(path: Path) -> bool:
    p = Path(path).expanduser()
    return p.is_file() and os.access(p, os.X_OK)


def probe_gpus(settings: SettingsView) -> tuple[list[GpuUse], str | None]:
    """(GPUs in NVML order, error). NVML numbers GPUs in PCI bus order."""
    nvml = probe_nvml(settings.gpus)
    if not nvml.available:
        return [], nvml.error or "NVML unavailable"
    gpus = [
        GpuUse(
            index=g.index,
            uuid=g.uuid,
            name=g.name,
            memory_used_mib=g.memory_used_mib,
            processes=tuple((p.pid, p.name, p.used_mib) for p in g.processes),
        )
        for g in nvml.gpus
    ]
    return gpus, None


def gpu_indices(settings: SettingsView) -> list[int] | None:
    """SM70_GPUS as CUDA indices in PCI bus order; None when NVML or an entry fails (the
    pre-flight check then says why)."""
    gpus, err = probe_gpus(settings)
    if err:
        return None
    indices, problems = resolve_gpu_entries(settings.gpus, gpus)
    return None if problems else indices


def probe_allreduce(settings: SettingsView, gpu_indices: list[int] | None) -> AllreduceChoice:
    """The all-reduce for the serving GPUs from their NVML links (sm70ctl.devices.topology);
    an unknown topology (no NVML, unresolved GPUs) is passed on as unknown. Raises
    Sm70Error when SM70_ALLREDUCE_MODE / SM70_P2P ask for what the links cannot do."""
    links = None
    if gpu_indices is not None:
        nvml = probe_nvml(settings.gpus)
        if nvml.available:
            links = serving_links(nvml.pairs, gpu_indices)
    return choose_allreduce(
        mode=settings.allreduce_mode, p2p=settings.p2p,
        tensor_parallel_size=settings.tensor_parallel_size,
        gpu_indices=gpu_indices or [], links=links,
    )
