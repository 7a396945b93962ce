"""The lock's [[local]] sources (our own trees, pinned by content): where each one is, and
its hash now.

The kernel sources (`path = "csrc"`) are found and hashed by `vllm_patch.ops.sources`, the
one place that knows where csrc/ lives (the checkout's, else the copy a wheel ships as
vllm_patch/_csrc/) and the one hash rule; the loader, the lock and the build's compile step
all use it. Any other local tree is relative to the project root. A folder that is missing
or holds no file is an error, never a hash: the hash of nothing must not reach the lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sm70ctl.build.lock import LocalSource, Lock, LockError, tree_hash
from sm70ctl.errors import Sm70Error

CSRC_PATH = "csrc"  # the [[local]] path of the kernel sources


def kernel_sources_dir() -> Path:
    """csrc/ as the ops loader finds it; a one-line error when neither copy is there."""
    from vllm_patch.ops.sources import OpsSourceError, csrc_dir

    try:
        return csrc_dir()
    except OpsSourceError as exc:
        raise Sm70Error(str(exc), hint="reinstall sm70ctl from a wheel built with "
                        "`pip wheel .` in a checkout (it ships csrc/), or run from the "
                        "checkout") from None


def kernel_sources_hash(csrc: Path) -> str:
    """The content hash of a csrc tree, by the loader's rule."""
    from vllm_patch.ops.sources import OpsSourceError, source_hash

    try:
        return source_hash(csrc)
    except OpsSourceError as exc:
        raise Sm70Error(str(exc), hint="the kernel sources must be present to hash or "
                        "build them; nothing was written") from None


def local_dir(src: LocalSource, root: Path, csrc: Path) -> Path:
    """Where a [[local]] source is: `csrc` for the kernel sources, else under `root`."""
    return csrc if src.path == CSRC_PATH else root / src.path


def local_hash(src: LocalSource, root: Path, csrc: Path) -> str:
    """The source's content hash now; LockError naming the entry when it has no files."""
    where = local_dir(src, root, csrc)
    if src.path == CSRC_PATH:
        if tuple(src.globs) != ("**/*",):
            raise LockError(f"[[local]] {src.name}: globs {list(src.globs)!r}: the kernel "
                            "sources are hashed whole (leave globs out)")
        return kernel_sources_hash(where)
    if not where.is_dir() or not any(p.is_file() for g in src.globs for p in where.glob(g)):
        raise LockError(f"[[local]] {src.name}: {where} is missing or has no files matching "
                        f"{list(src.globs)!r}; refusing to hash nothing")
    return tree_hash(where, src.globs)


def local_state(lock: Lock, root: Path, csrc: Path) -> list[dict[str, Any]]:
    """Each [[local]] source: where it is, the hash the lock records, the hash now."""
    rows = []
    for src in lock.local:
        now = local_hash(src, root, csrc)
        rows.append({"name": src.name, "path": str(local_dir(src, root, csrc)),
                     "locked": src.hash, "now": now, "drift": now != src.hash})
    return rows
