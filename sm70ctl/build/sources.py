"""Fetch and verify the pinned inputs: git at a commit, archives and wheels by sha256.

Every function here touches the world (network, git, files) and returns plain data or
raises Sm70Error. Where an input comes from (upstream or the mirror) is decided by
`mirror.Locator`; these functions only fetch from the location they are given.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from sm70ctl.errors import Sm70Error
from sm70ctl.fsutil import sha256_file

Progress = Callable[[float | None, str], None]


class FetchError(Sm70Error):
    """A source could not be fetched or did not verify."""


def git_env(offline: bool) -> dict[str, str]:
    """Environment for git subprocesses: never prompt; offline allows only local paths."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
        "LC_ALL": "C",
    }
    if offline:
        env["GIT_ALLOW_PROTOCOL"] = "file"
    return env


def _git(args: list[str], env: dict[str, str], cwd: Path | None = None) -> str:
    res = subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        last = msg[-1] if msg else f"exit {res.returncode}"
        raise FetchError(f"git {args[0]} failed: {last}")
    return res.stdout.strip()


def git_checkout(
    location: str, commit: str, tag: str, dest: Path, *, offline: bool, log=lambda m: None
) -> str:
    """Clone `location` into `dest` and check out `commit`; verify HEAD (and the tag).

    Returns the checked-out HEAD. Raises FetchError when the commit is absent, when HEAD
    differs from the pin, or when the pinned tag now points elsewhere.
    """
    env = git_env(offline)
    log(f"git clone {location} ({commit[:12] or 'tag ' + tag})")
    _git(["clone", "--quiet", "--no-checkout", location, str(dest)], env)
    if not commit:  # an unverified pin by tag: check out the tag, report what it was
        try:
            commit = _git(["rev-parse", f"refs/tags/{tag}^{{commit}}"], env, dest)
        except FetchError:
            raise FetchError(f"{location} has no tag {tag}") from None
        log(f"unverified pin: tag {tag} is {commit}")
    try:
        _git(["cat-file", "-e", f"{commit}^{{commit}}"], env, dest)
    except FetchError:
        raise FetchError(
            f"{location} has no commit {commit}",
            hint="the lock pins a commit the source does not have: check the lock or the mirror",
        ) from None
    _git(["-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", commit], env, dest)
    head = _git(["rev-parse", "HEAD"], env, dest)
    if head != commit:
        raise FetchError(f"checked-out HEAD {head} differs from the pinned commit {commit}")
    if tag:
        try:
            tagged = _git(["rev-parse", f"refs/tags/{tag}^{{commit}}"], env, dest)
        except FetchError:
            raise FetchError(f"{location} has no tag {tag} (pinned to {commit})") from None
        if tagged != commit:
            raise FetchError(
                f"tag {tag} of {location} points at {tagged}, the lock pins {commit}",
                hint="a moved tag is a different input: re-verify and update the lock",
            )
    return head


def verify_file(path: Path, sha256: str, what: str, name: str | None = None) -> None:
    """`name`: the file's name in messages (a temporary copy is hashed under another)."""
    got = sha256_file(path)
    if got != sha256:
        raise FetchError(
            f"{what}: sha256 mismatch for {name or path.name}: expected {sha256}, got {got}",
            hint="the file is corrupted or not the pinned release; delete it and fetch again",
        )


def download(
    url: str,
    dest: Path,
    sha256: str,
    what: str,
    progress: Progress = lambda f, n: None,
    timeout: float = 60.0,
) -> Path:
    """Download `url` to `dest` (tmp file + rename), verified against `sha256` if given."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                resp = urllib.request.urlopen(url, timeout=timeout)  # a pinned URL
            except OSError as exc:
                raise FetchError(f"{what}: cannot download {url}: {exc}") from None
            with resp:
                total = int(resp.headers.get("Content-Length") or 0)
                seen = 0
                while block := resp.read(1 << 20):
                    f.write(block)
                    seen += len(block)
                    progress(seen / total if total else None, f"{dest.name} {seen >> 20} MiB")
        if sha256:
            verify_file(tmp, sha256, what, dest.name)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def copy_verified(src: Path, dest: Path, sha256: str, what: str) -> Path:
    """Copy a local (mirror) file into place, verified, atomically.

    The copy is what gets hashed, not the source: a mirror file replaced or damaged
    between a check and the copy must not slip through."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            shutil.copyfile(src, tmp)
        except OSError as exc:
            raise FetchError(f"{what}: cannot read {src}: {exc.strerror or exc}") from None
        if sha256:
            verify_file(tmp, sha256, what, src.name)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def unpack_archive(archive: Path, dest: Path, strip: str) -> None:
    """Extract a .tar.gz into `dest`, removing the top folder `strip` if given."""
    with tarfile.open(archive) as tf:
        members = tf.getmembers()
        for m in members:
            parts = Path(m.name).parts
            if m.name.startswith("/") or ".." in parts:
                raise FetchError(f"{archive.name}: unsafe member path {m.name!r}")
            if strip:
                if not parts or parts[0] != strip:
                    raise FetchError(f"{archive.name}: member {m.name!r} is outside {strip}/")
                m.name = str(Path(*parts[1:])) if len(parts) > 1 else "."
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(dest, members=[m for m in members if m.name != "."], **kwargs)
