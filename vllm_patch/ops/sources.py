"""Where our CUDA sources are, what compiles them, and their content hash (no torch import).

The checkout's `csrc/` (beside the `vllm_patch` package) is the source of truth; a wheel ships
the same tree as `vllm_patch/_csrc/`. `source_hash()` follows the rule `sm70ctl build` locks
(sha256 over each file's relative POSIX path and the sha256 of its bytes, sorted by path,
`__pycache__` left out), so a library's recorded hash and the lock's `csrc` entry compare
directly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # vllm_patch/
CHECKOUT_CSRC = PACKAGE_DIR.parent / "csrc"
PACKAGED_CSRC = PACKAGE_DIR / "_csrc"
BINDINGS = "torch_bindings"  # the folder holding the translation units
UNIT_SUFFIXES = (".cu", ".cpp")


class OpsSourceError(RuntimeError):
    """The kernel sources are missing or unusable; the message names the folder and the fix."""


def _usable(root: Path) -> bool:
    return (root / BINDINGS).is_dir()


def csrc_dir() -> Path:
    """The checkout's csrc/ when it is there, else the packaged copy; an error if neither."""
    for root in (CHECKOUT_CSRC, PACKAGED_CSRC):
        if _usable(root):
            return root
    raise OpsSourceError(
        f"no kernel sources: neither {CHECKOUT_CSRC} nor {PACKAGED_CSRC} has a {BINDINGS}/ "
        "folder (reinstall sm70ctl from a wheel that ships vllm_patch/_csrc, or run from a "
        "checkout)"
    )


def translation_units(csrc: Path | None = None) -> list[Path]:
    """The extension's translation units: every .cu and .cpp directly in torch_bindings/."""
    root = csrc if csrc is not None else csrc_dir()
    units = sorted(
        p for p in (root / BINDINGS).iterdir() if p.is_file() and p.suffix in UNIT_SUFFIXES
    ) if (root / BINDINGS).is_dir() else []
    if not units:
        raise OpsSourceError(f"no .cu or .cpp files in {root / BINDINGS}")
    return units


def include_dirs(csrc: Path | None = None) -> list[Path]:
    """The include folder: csrc/ itself (headers are included as "gemv/gptq_gemv.cuh")."""
    return [csrc if csrc is not None else csrc_dir()]


def source_hash(csrc: Path | None = None) -> str:
    """sha256 over the csrc tree (the lock's rule); an error for a missing or empty folder."""
    root = csrc if csrc is not None else csrc_dir()
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts),
        key=lambda p: p.relative_to(root).as_posix(),
    ) if root.is_dir() else []
    if not files:
        raise OpsSourceError(f"cannot hash the kernel sources: {root} is missing or empty")
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()
