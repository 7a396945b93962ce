"""What a server start needs to know about this machine, as plain data (the side effects
serve's pre-flight and warmup's step plan share): the GPUs and how busy they are, the model
folder, the serving interpreter.

GPU data comes from the one NVML probe (sm70ctl.devices.nvml), reduced to the few fields
the checks judge. The attention-backend names come from the serving vLLM's source, read
without importing vLLM.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import subprocess
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


# --- the attention-backend names of the serving vLLM --------------------------------------
# Where the serving interpreter would import vllm from, found without importing it (vLLM's
# import takes seconds and starts its platform detection; find_spec of a top-level package
# only walks sys.path).
_VLLM_LOCATION_SCRIPT = (
    "import importlib.util, json\n"
    "spec = importlib.util.find_spec('vllm')\n"
    "print(json.dumps(None if spec is None else list(spec.submodule_search_locations or [])))\n"
)
# vLLM 0.22.1's closed list of --attention-backend names, and the class that holds it
BACKEND_REGISTRY = Path("v1", "attention", "backends", "registry.py")
BACKEND_ENUM = "AttentionBackendEnum"
PATCHED_BACKEND_NAME = "SM70_PAGED"  # what patch 0002 adds to that enum


@dataclass(frozen=True)
class BackendNameProbe:
    """Whether the serving vLLM's attention-backend enum has PATCHED_BACKEND_NAME.

    has_name None: unknown, and `detail` says what was not found; vllm_dir is the vllm
    package folder the serving interpreter would import, when it was found."""

    has_name: bool | None
    vllm_dir: str | None = None
    detail: str = ""


def enum_members(source: str, class_name: str) -> set[str] | None:
    """The names assigned in the body of the top-level class `class_name` of a Python source
    (an Enum's members, read without running the module); None when there is no such class
    or the source does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            names: set[str] = set()
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else (
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
                names.update(t.id for t in targets if isinstance(t, ast.Name))
            return names
    return None


def probe_backend_name(python: Path, *, env: Mapping[str, str] | None = None,
                       timeout: float = 20.0) -> BackendNameProbe:
    """Does the vLLM that `python` (SM70_SERVE_PYTHON) serves with know the SM70_PAGED
    backend name? The interpreter only locates the vllm package (env: its environment, as
    the server gets it, so PYTHONPATH counts); the enum's source is read here."""
    python = Path(python).expanduser()
    try:
        proc = subprocess.run([str(python), "-c", _VLLM_LOCATION_SCRIPT], capture_output=True,
                              text=True, timeout=timeout, check=False,
                              env=None if env is None else dict(env))
    except subprocess.TimeoutExpired:
        return BackendNameProbe(None, detail=f"{python} did not say where vllm is within "
                                             f"{timeout:g}s")
    except OSError as exc:
        return BackendNameProbe(None, detail=f"{python} does not run: {exc.strerror or exc}")
    locations: Any = False  # False: no answer; None: no vllm; a list: its folders
    if proc.returncode == 0:
        with contextlib.suppress(ValueError):
            locations = json.loads(proc.stdout)
    if locations is not None and not isinstance(locations, list):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        return BackendNameProbe(None, detail=f"{python} could not look for vllm (exit "
                                             f"{proc.returncode}: {' '.join(tail)})")
    if not locations:
        return BackendNameProbe(None, detail=f"{python} finds no vllm package")
    vllm_dir = str(locations[0])
    registry = Path(vllm_dir) / BACKEND_REGISTRY
    try:
        source = registry.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return BackendNameProbe(None, vllm_dir, f"{registry} is missing or unreadable")
    members = enum_members(source, BACKEND_ENUM)
    if members is None:
        return BackendNameProbe(None, vllm_dir, f"{registry} defines no {BACKEND_ENUM}")
    has = PATCHED_BACKEND_NAME in members
    return BackendNameProbe(has, vllm_dir, f"{BACKEND_ENUM} in {registry} "
                                           f"{'has' if has else 'lacks'} "
                                           f"{PATCHED_BACKEND_NAME}")


def probe_serving_backend(settings: SettingsView,
                          environ: Mapping[str, str]) -> BackendNameProbe | None:
    """What serve and warmup both need before they pass --attention-backend: for the
    patched tree's name (SM70_PAGED) whether the serving vLLM has it, probed with the
    environment the server gets (child_env: no SM70_* variable); None for any other
    setting, which is vLLM's own name and passed as set."""
    if settings.attention_backend != PATCHED_BACKEND_NAME:
        return None
    from sm70ctl.runtime.environment import child_env

    return probe_backend_name(settings.serve_python, env=child_env(environ, {}))
