"""What only serve's pre-flight looks at, each probe returning plain data (the side effects).

The probes warmup shares (GPUs, model folder, serving interpreter) are sm70ctl.runtime.probes.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from sm70ctl.serve.preflight import PortState


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


def quant_problems(config: dict[str, Any] | None) -> list[str] | None:
    """The weights module's verdict on the checkpoint's quantization_config, as lines;
    None when the checkpoint has no quantization_config at all."""
    from sm70ctl.weights.quant import has_quant_config, validate_quant_config

    if config is None or not has_quant_config(config):
        return None

    return [p.message for p in validate_quant_config(config)]
