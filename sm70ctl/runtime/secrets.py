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
    """vLLM's `--config` secrets file for the server's lifetime; None when there are no
    secrets.

    The key lives only in this process's memory: the path is a link to an anonymous
    in-memory file (memfd, mode 0600) held open by this process, reached through
    /proc/<pid>/fd. vLLM opens the link by its `.yaml` name as usual; when serve ends in
    any way, a SIGKILL included, the kernel drops the memory file with the process, so no
    copy of the key outlives it on disk (a dangling link may remain until the next start,
    which removes it). Where memfd or /proc is missing, a 0600 file is written instead and
    removed on every way out but a SIGKILL."""
    text = secrets_yaml(settings)
    if text is None:
        yield None
        return
    path = secrets_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a link or file left by a serve that was killed
    fd = _memory_file(text)
    try:
        if fd is None or not _link(path, fd, text):
            _write_private(path, text)
        yield path
    finally:
        path.unlink(missing_ok=True)
        if fd is not None:
            os.close(fd)


def _memory_file(text: str) -> int | None:
    """An anonymous in-memory file holding `text` (closed on exec: children open it by
    path, so none keeps it alive after serve), or None where the kernel has no memfd."""
    try:
        fd = os.memfd_create("sm70ctl-secrets.yaml", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("utf-8"))
    except OSError:
        os.close(fd)
        return None
    return fd


def _link(path: Path, fd: int, text: str) -> bool:
    """Point `path` at the memory file; False (nothing left behind) when it cannot be read
    back through the link, e.g. /proc not mounted or links not allowed in the folder."""
    try:
        os.symlink(f"/proc/{os.getpid()}/fd/{fd}", path)
    except OSError:
        return False
    try:
        if path.read_text(encoding="utf-8") == text:
            return True
    except OSError:
        pass
    path.unlink(missing_ok=True)
    return False


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
