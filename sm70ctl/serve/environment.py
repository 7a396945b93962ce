"""The server's environment and how it is shown (pure).

The child gets the caller's environment minus every SM70_* variable (our settings reach
vLLM only through the flags and variables launch.py derives, and secrets such as
SM70_HF_TOKEN stay out of the child), plus the managed variables. Inherited variables the
stack does not manage are listed in the log, because vLLM folds every variable it knows
into its compile-cache key and a stray one can change behaviour; anything that looks
secret is listed by name only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

MASK = "***"

_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|PASSWD|API_?KEY|ACCESS_?KEY|PRIVATE|CREDENTIAL|AUTH",
                          re.IGNORECASE)
# Prefixes of variables that can change what vLLM/torch/NCCL do (flagged in the log).
_INFLUENTIAL = ("VLLM_", "CUDA_", "NCCL_", "TORCH", "PYTORCH_", "TRITON_", "HF_",
                "TRANSFORMERS_", "OMP_", "MKL_", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHON")


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def child_env(environ: Mapping[str, str], managed: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if not k.startswith("SM70_")}
    env.update(managed)
    return env


def unmanaged(environ: Mapping[str, str], managed: Iterable[str]) -> list[tuple[str, str, bool]]:
    """Inherited variables we pass on but do not manage: (name, shown value, influential).
    Secret-looking values are replaced by the mask."""
    managed = set(managed)
    rows = []
    for name in sorted(environ):
        if name in managed or name.startswith("SM70_"):
            continue
        value = MASK if is_secret_name(name) else environ[name]
        rows.append((name, value, name.startswith(_INFLUENTIAL)))
    return rows


def mask_env(env: Mapping[str, str], secrets: Iterable[str] = ()) -> dict[str, str]:
    values = [s for s in secrets if s]
    out = {}
    for k, v in env.items():
        out[k] = MASK if is_secret_name(k) or any(s in v for s in values) else v
    return out


def shell_line(argv: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in argv)
