"""The offline mirror: everything the lock pins, in one folder.

Layout of a mirror DIR:
    git/<name>.git        a bare repository (from `git clone --mirror`), or
    git/<name>.bundle     a git bundle holding the pinned commit
    archives/<filename>   source archives, checked by sha256
    wheels/<filename>     the serving environment's wheelhouse, checked by sha256
    MIRROR.json           what was put there, from which lock (informational)

`Locator` decides where each input comes from; in offline mode it only ever returns
mirror paths, so nothing downstream can reach the network.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sm70ctl.build.lock import Archive, GitSource, Lock, Wheel
from sm70ctl.build.sources import FetchError, copy_verified, download, git_env
from sm70ctl.errors import Sm70Error
from sm70ctl.fsutil import atomic_write_text, rmtree_quiet, sha256_file
from sm70ctl.readers import check_path


class MirrorError(Sm70Error):
    """The mirror lacks or holds a wrong copy of a pinned input."""


def git_path(mirror: Path, g: GitSource) -> Path | None:
    for cand in (mirror / "git" / f"{g.name}.git", mirror / "git" / f"{g.name}.bundle"):
        if cand.exists():
            return cand
    return None


def archive_path(mirror: Path, a: Archive) -> Path:
    return mirror / "archives" / a.filename


def wheel_path(mirror: Path, w: Wheel) -> Path:
    return mirror / "wheels" / w.filename


def _has_commit(repo: Path, commit: str, tag: str = "") -> bool:
    if not commit:  # unverified pin by tag
        commit = f"refs/tags/{tag}"
    if repo.suffix == ".bundle":
        res = subprocess.run(
            ["git", "bundle", "list-heads", str(repo)],
            capture_output=True, text=True, env=git_env(True), check=False,
        )
        # A bundle holds a commit when one of its heads is it or contains it; a cheap and
        # sufficient check for our bundles (made at the pinned commit) is the heads list.
        return res.returncode == 0 and commit in res.stdout
    res = subprocess.run(
        ["git", "--git-dir", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True, text=True, env=git_env(True), check=False,
    )
    return res.returncode == 0


def git_damage(repo: Path) -> str | None:
    """Why the objects of a mirrored repository cannot be trusted, else None.

    Presence of the pinned commit says nothing about the bytes behind it: a corrupted
    loose object or pack still "exists". `git fsck --full --strict` re-hashes every
    object and walks the history, so a flipped byte or a missing parent is found here
    rather than as a broken checkout in the middle of an offline build. A bundle is
    unpacked into a scratch repository first (unbundling re-hashes its pack)."""
    env = git_env(True)
    if repo.suffix == ".bundle":
        with tempfile.TemporaryDirectory(prefix="sm70-bundle-") as tmp:
            init = _run_git(["init", "--quiet", "--bare", tmp], env)
            if init.returncode != 0:
                return _first_line(init.stderr) or "git init failed"
            res = _run_git(["--git-dir", tmp, "bundle", "unbundle", str(repo)], env)
            if res.returncode != 0:
                return "bundle unreadable: " + (_first_line(res.stderr) or "git bundle failed")
            return _fsck(Path(tmp), env)
    return _fsck(repo, env)


def _fsck(repo: Path, env: dict[str, str]) -> str | None:
    res = _run_git(["--git-dir", str(repo), "fsck", "--full", "--strict", "--no-progress",
                    "--no-dangling"], env)
    if res.returncode != 0:
        return "git fsck: " + (_first_line(res.stderr or res.stdout) or "failed")
    return None


def _run_git(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], capture_output=True, text=True, env=env,
                          check=False, errors="replace")


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0][:200] if lines else ""


@dataclass(frozen=True)
class Item:
    kind: str  # git | archive | wheel
    name: str
    path: str
    status: str  # ok | missing | mismatch | unverified
    detail: str = ""


def check_mirror(lock: Lock, mirror: Path, *, hashes: bool) -> list[Item]:
    """One row per pinned input. `hashes=False` checks presence only (fast, for the
    offline pre-flight); `hashes=True` also checks every sha256 and every git object
    (`mirror verify`)."""
    items: list[Item] = []
    for g in lock.git:
        p = git_path(mirror, g)
        if p is None:
            items.append(Item("git", g.name, f"git/{g.name}.git", "missing", "no repository"))
        elif not _has_commit(p, g.commit, g.tag):
            items.append(Item("git", g.name, str(p.relative_to(mirror)), "missing",
                              f"{g.ref} absent"))
        elif hashes and (damage := git_damage(p)) is not None:
            items.append(Item("git", g.name, str(p.relative_to(mirror)), "mismatch", damage))
        elif not g.commit:
            items.append(Item("git", g.name, str(p.relative_to(mirror)), "unverified",
                              f"tag {g.tag} only: {g.unverified}"))
        else:
            items.append(Item("git", g.name, str(p.relative_to(mirror)), "ok", g.commit[:12]))
    files: list[tuple[str, str, Path, str]] = [
        ("archive", a.name, archive_path(mirror, a), a.sha256) for a in lock.archives
    ] + [("wheel", w.filename, wheel_path(mirror, w), w.sha256) for w in lock.wheels]
    for kind, name, p, sha in files:
        rel = str(p.relative_to(mirror))
        if not p.is_file():
            items.append(Item(kind, name, rel, "missing", "no file"))
        elif not sha:
            items.append(Item(kind, name, rel, "unverified", "the lock has no sha256 for it"))
        elif hashes and (got := sha256_file(p)) != sha:
            items.append(Item(kind, name, rel, "mismatch", f"sha256 {got}, lock {sha}"))
        else:
            items.append(Item(kind, name, rel, "ok", "sha256 ok" if hashes else "present"))
    return items


def require_complete(lock: Lock, mirror: Path) -> None:
    """Offline pre-flight: fail listing EVERY missing item, before any work starts."""
    if not check_path(mirror, "mirror folder").is_dir():
        raise MirrorError(
            f"mirror folder {mirror} does not exist",
            hint="create one on a connected machine with `sm70ctl mirror create DIR`",
        )
    missing = [i for i in check_mirror(lock, mirror, hashes=False) if i.status == "missing"]
    if missing:
        lines = "".join(f"\n  - {i.kind} {i.name} ({i.path}: {i.detail})" for i in missing)
        raise MirrorError(
            f"offline build: the mirror {mirror} lacks {len(missing)} pinned item(s):{lines}",
            hint="refill it on a connected machine: `sm70ctl mirror create DIR`",
        )


class Locator:
    """Where each pinned input is read from."""

    def __init__(self, offline: bool, mirror: Path | None) -> None:
        if offline and mirror is None:
            raise MirrorError(
                "--offline needs a mirror",
                hint="pass --mirror DIR or set SM70_MIRROR_DIR",
            )
        self.offline = offline
        self.mirror = mirror

    def git(self, g: GitSource) -> str:
        if self.mirror is not None:
            p = git_path(self.mirror, g)
            if p is not None:
                return str(p)
        if self.offline:
            raise MirrorError(f"offline: the mirror has no repository for {g.name}")
        return g.url

    def _file(self, p: Path | None, url: str, what: str) -> tuple[str, str]:
        if p is not None and p.is_file():
            return ("file", str(p))
        if self.offline:
            raise MirrorError(f"offline: the mirror has no {what}")
        return ("url", url)

    def archive(self, a: Archive) -> tuple[str, str]:
        p = archive_path(self.mirror, a) if self.mirror else None
        return self._file(p, a.url, f"archive {a.filename}")

    def wheel(self, w: Wheel) -> tuple[str, str]:
        p = wheel_path(self.mirror, w) if self.mirror else None
        return self._file(p, w.url, f"wheel {w.filename}")


def fetch_file(loc: tuple[str, str], dest: Path, sha256: str, what: str, progress) -> Path:
    kind, where = loc
    if kind == "file":
        return copy_verified(Path(where), dest, sha256, what)
    return download(where, dest, sha256, what, progress)


def create_mirror(lock: Lock, mirror: Path, log=lambda m: None, progress=lambda f, n: None
                  ) -> list[Item]:
    """Fill `mirror` from upstream (connected machine). Idempotent: present, verified items
    are kept; git repositories are refreshed with a fetch. One at a time per folder: two
    would clone into the same temporary repository."""
    from sm70ctl.locking import FileLock

    with FileLock(mirror / ".mirror.lock", "sm70ctl mirror create",
                  alternative="mirror folder"):
        return _create_mirror(lock, mirror, log, progress)


def _create_mirror(lock: Lock, mirror: Path, log, progress) -> list[Item]:
    env = git_env(False)
    (mirror / "git").mkdir(parents=True, exist_ok=True)
    for g in lock.git:
        repo = mirror / "git" / f"{g.name}.git"
        if repo.is_dir():
            log(f"git fetch {g.name}")
            res = subprocess.run(["git", "--git-dir", str(repo), "fetch", "--quiet", "--tags",
                                  "origin"], capture_output=True, text=True, env=env, check=False)
        else:
            log(f"git clone --mirror {g.url}")
            tmp = repo.with_name(f".{repo.name}.tmp")
            rmtree_quiet(tmp)
            res = subprocess.run(["git", "clone", "--quiet", "--mirror", g.url, str(tmp)],
                                 capture_output=True, text=True, env=env, check=False)
            if res.returncode == 0:
                tmp.rename(repo)
        if res.returncode != 0:
            raise FetchError(f"mirror: git for {g.name} failed: {res.stderr.strip()}")
        if not _has_commit(repo, g.commit, g.tag):
            raise FetchError(f"mirror: {g.url} has no {g.ref} ({g.name})")
    for a in lock.archives:
        dest = archive_path(mirror, a)
        if not (dest.is_file() and sha256_file(dest) == a.sha256):
            log(f"download {a.filename}")
            download(a.url, dest, a.sha256, f"archive {a.name}", progress)
    for w in lock.wheels:
        dest = wheel_path(mirror, w)
        if dest.is_file() and (not w.sha256 or sha256_file(dest) == w.sha256):
            continue
        log(f"download {w.filename}")
        download(w.url, dest, w.sha256, f"wheel {w.name}", progress)
    items = check_mirror(lock, mirror, hashes=True)
    manifest = {
        "lock_sha256": lock.digest,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "items": [asdict(i) for i in items],
    }
    atomic_write_text(mirror / "MIRROR.json", json.dumps(manifest, indent=2) + "\n")
    return items
