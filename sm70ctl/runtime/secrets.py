"""The secrets file vLLM reads through `--config` (the API key never goes on the command line,
where any local user could read it in `ps`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sm70ctl.settings.typed import SettingsView


def secrets_path(settings: SettingsView) -> Path:
    """Where serve writes the secrets file while the server runs: beside its port lock."""
    return Path(settings.lock_dir).expanduser() / f"serve-{settings.port}.secrets.yaml"


def secrets_yaml(settings: SettingsView) -> str | None:
    """The YAML for vLLM's `--config` file carrying the secrets, or None when there are none.

    JSON string quoting is valid YAML, so any key survives as written.
    """
    if settings.api_key is None:
        return None
    return f"api-key: {json.dumps(settings.api_key.get_secret_value())}\n"


@contextmanager
def secrets_file(settings: SettingsView) -> Iterator[Path | None]:
    """Write vLLM's `--config` secrets file (mode 0600 from the start, never world-readable)
    for the server's lifetime and remove it afterwards; None when there are no secrets."""
    text = secrets_yaml(settings)
    if text is None:
        yield None
        return
    path = secrets_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        yield path
    finally:
        path.unlink(missing_ok=True)
