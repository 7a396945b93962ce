"""What serve's pre-flight looks at, each probe returning plain data (the side effects).

GPU data comes from the doctor's NVML probe (one implementation of NVML access), reduced
to the few fields pre-flight judges.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path
from typing import Any

from sm70ctl.serve.preflight import GpuUse, ModelDirState, PortState


def probe_port(host: str, port: int) -> PortState:
    """Free when we could bind it the way the server will (SO_REUSEADDR, as uvicorn does,
    so a socket in TIME_WAIT from a previous run does not count as busy)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    bind_host = "" if host in ("0.0.0.0", "::") else host.strip("[]")
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return PortState(False, "another process is listening")
            return PortState(False, f"cannot bind: {exc.strerror or exc}")
    return PortState(True)


def probe_model_dir(path: Path) -> ModelDirState:
    path = Path(path).expanduser()
    if not path.is_dir():
        return ModelDirState(str(path), exists=False)
    cfg = path / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except FileNotFoundError:
        return ModelDirState(str(path), exists=True, error="config.json is missing")
    except (OSError, ValueError) as exc:
        return ModelDirState(str(path), exists=True, error=str(exc))
    if not isinstance(data, dict):
        return ModelDirState(str(path), exists=True, error="config.json is not an object")
    return ModelDirState(str(path), exists=True, config=data)


def quant_problems(config: dict[str, Any] | None) -> list[str] | None:
    """The weights module's verdict on the checkpoint's quantization_config, as lines;
    None when the checkpoint has no quantization_config at all."""
    from sm70ctl.weights.quant import has_quant_config, validate_quant_config

    if config is None or not has_quant_config(config):
        return None

    return [p.message for p in validate_quant_config(config)]


def probe_executable(path: Path) -> bool:
    p = Path(path).expanduser()
    return p.is_file() and os.access(p, os.X_OK)


def probe_gpus(settings: Any) -> tuple[list[GpuUse], str | None]:
    """(GPUs in NVML order, error). NVML numbers GPUs in PCI bus order."""
    from sm70ctl.doctor.config import DoctorConfig
    from sm70ctl.doctor.probes import probe_nvml

    nvml = probe_nvml(DoctorConfig.from_settings(settings))
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
