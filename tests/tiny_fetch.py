"""The tiny checkpoint (tests/hubserver.py's tiny_files) fetched through `weights fetch`'s
own code, for the tests that check a fetched folder afterwards."""

from __future__ import annotations

from pathlib import Path

from hubserver import HubServer, Repo, lock_text, tiny_files

from sm70ctl.weights.fetch import FetchConfig, fetch_pin
from sm70ctl.weights.pins import parse_model_pins

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def fetch_tiny(root: Path, repo: str, commit: str) -> Path:
    """root/models/tiny, fetched from a hub server serving `repo` at `commit` that is stopped
    again before this returns; the lock naming it is root/models.lock.toml."""
    text = lock_text("tiny", repo, commit)
    (root / "models.lock.toml").write_text(text)
    pin = parse_model_pins(tomllib.loads(text), "test.lock")[0]
    server = HubServer()
    server.add_repo(Repo(repo, {commit: tiny_files()}))
    with server:
        fetch_pin(pin, FetchConfig(weights_dir=root / "models", endpoint=server.url,
                                   progress=False))
    return root / "models" / "tiny"
