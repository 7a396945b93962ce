"""What the doctor needs from the settings, as one small frozen value the checks take."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sm70ctl.settings.typed import SettingsView

MIB = 1024 * 1024
GB = 1000**3

# Requirements that are facts about the stack, not settings.
WEIGHTS_FREE_BYTES = 35 * GB  # int8 GPTQ checkpoint (about 32 GB) plus headroom
BUILD_FREE_BYTES = 2 * GB

# Defaults of the settings the doctor reads (docs/ARCHITECTURE.md); used only when the
# settings module cannot be imported (see command.py).
_DEFAULTS = {
    "SM70_GPUS": "0,1",
    "SM70_GPU_BUSY_MIB": "500MiB",
    "SM70_WEIGHTS_DIR": "~/.cache/sm70ctl/models",
    "SM70_BUILD_DIR": "~/.cache/sm70ctl/build",
    "SM70_SERVE_PYTHON": "~/.cache/sm70ctl/serve-env/bin/python",
    "SM70_CUDA_HOME": "",
    "SM70_HOST_CC": "",
}


@dataclass(frozen=True)
class DoctorConfig:
    gpus: tuple[str, ...] = ("0", "1")
    gpu_busy_bytes: int = 500 * MIB
    weights_dir: str = "~/.cache/sm70ctl/models"
    build_dir: str = "~/.cache/sm70ctl/build"
    serve_python: str = "~/.cache/sm70ctl/serve-env/bin/python"
    cuda_home: str | None = None
    host_cc: str | None = None

    @classmethod
    def from_settings(cls, settings: SettingsView) -> DoctorConfig:
        """Take the seven settings the doctor reads from a `Settings` object."""
        gpus = settings.gpus
        if isinstance(gpus, str):
            gpus = [g for g in gpus.split(",")]
        return cls(
            gpus=tuple(str(g).strip() for g in gpus if str(g).strip()),
            gpu_busy_bytes=int(settings.gpu_busy_mib),
            weights_dir=_path(settings.weights_dir),
            build_dir=_path(settings.build_dir),
            serve_python=_path(settings.serve_python),
            cuda_home=_path(settings.cuda_home) or None,
            host_cc=(str(settings.host_cc).strip() or None) if settings.host_cc else None,
        )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], lenient: bool = False) -> DoctorConfig:
        """Fallback parser for the seven variables, for when the settings module cannot
        load or rejects the values: the doctor must still diagnose a half-installed or
        misconfigured machine. `lenient` takes the default for an unreadable size (the
        settings check already reports it)."""
        from sm70ctl.errors import UsageError

        env = {k: (environ.get(k) or d) for k, d in _DEFAULTS.items()}
        try:
            busy = parse_size(env["SM70_GPU_BUSY_MIB"], "SM70_GPU_BUSY_MIB")
        except UsageError:
            if not lenient:
                raise
            busy = cls.gpu_busy_bytes
        return cls(
            gpus=tuple(g.strip() for g in env["SM70_GPUS"].split(",") if g.strip()),
            gpu_busy_bytes=busy,
            weights_dir=env["SM70_WEIGHTS_DIR"],
            build_dir=env["SM70_BUILD_DIR"],
            serve_python=env["SM70_SERVE_PYTHON"],
            cuda_home=env["SM70_CUDA_HOME"] or None,
            host_cc=env["SM70_HOST_CC"] or None,
        )

    @property
    def gpu_busy_mib(self) -> int:
        return self.gpu_busy_bytes // MIB


_UNITS = {"": MIB, "b": 1, "kib": 1024, "mib": MIB, "gib": 1024 * MIB}


def parse_size(text: str, name: str) -> int:
    """ "500MiB", "1GiB" or a bare number of MiB, in bytes."""
    import re

    from sm70ctl.errors import UsageError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UsageError(
            f"{name}={text!r} is not a size",
            hint=f"give a size with a unit, e.g. {name}=500MiB or 1GiB",
        )
    return int(float(m.group(1)) * _UNITS[unit])


def _path(value: Any) -> str:
    return "" if value is None else str(value)


def read_env_file(path: Path) -> dict[str, str]:
    """The env file's KEY=VALUE pairs by the settings loader's own (dotenv) rules, its
    syntax problems ignored: the doctor still wants the paths from a file that `env check`
    refuses."""
    from sm70ctl.errors import Sm70Error, UsageError
    from sm70ctl.settings.loader import parse_env_file

    try:
        values, _problems = parse_env_file(path)
    except Sm70Error as exc:
        raise UsageError(f"--env-file: {exc.message}") from None
    return {key: raw.text for key, raw in values.items()}
