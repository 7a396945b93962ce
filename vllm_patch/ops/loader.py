"""The one loader of our compiled ops: a matching prebuilt library, else a locked build.

`load_ops()` registers `torch.ops.sm70.*` in this process, once:
1. ops already registered (another caller loaded them) -> nothing to do;
2. a prebuilt `sm70_ops_<key>.so` for this runtime (`build.library_key`: OS, torch, CUDA,
   Python, source hash) in `$SM70_OPS_LIB_DIR` or `vllm_patch/_lib/` (where `sm70ctl build`
   installs it) -> loaded;
3. otherwise it is built with torch.utils.cpp_extension into the cache folder
   (`$SM70_KERNELS_BUILD_DIR`, which `sm70ctl serve`/`warmup` set per fingerprint, else
   ~/.cache/sm70ctl/ops), holding an exclusive `fcntl.flock` so that the processes vLLM starts
   at once build it one time and the others load the result.

`load_prebuilt()` is the plugin's cheap variant: it never builds and imports torch only when a
candidate library file exists.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_patch.ops import build, sources

LIB_DIR_ENV = "SM70_OPS_LIB_DIR"
CACHE_DIR_ENV = "SM70_KERNELS_BUILD_DIR"
PACKAGED_LIB_DIR = sources.PACKAGE_DIR / "_lib"
ARCH_ENV = "TORCH_CUDA_ARCH_LIST"

_lock = threading.Lock()
_loaded: str | None = None


class OpsLoadError(RuntimeError):
    """The ops could not be loaded or built; the message says why and where the log is."""


def prebuilt_dirs(environ: dict[str, str] | None = None) -> list[Path]:
    """Where prebuilt libraries are looked for, in order."""
    env = os.environ if environ is None else environ
    dirs = [Path(env[LIB_DIR_ENV]).expanduser()] if env.get(LIB_DIR_ENV) else []
    return [*dirs, PACKAGED_LIB_DIR]


def cache_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    base = env.get(CACHE_DIR_ENV) or str(Path.home() / ".cache" / "sm70ctl" / "ops")
    return Path(base).expanduser()


def candidates(dirs: list[Path]) -> list[Path]:
    """Every sm70_ops_*.so in dirs (whatever runtime it was built for)."""
    return [p for d in dirs if d.is_dir() for p in sorted(d.glob(f"{build.LIBRARY_PREFIX}*.so"))]


def pick_prebuilt(dirs: list[Path], key: str) -> Path | None:
    """The first library named for `key` (pure apart from the existence checks)."""
    for d in dirs:
        lib = d / f"{build.library_name(key)}.so"
        if lib.is_file():
            return lib
    return None


def cache_slot(key: str, arch_list: str) -> str:
    """The cache's folder name: the library key plus the archs it was compiled for (a cache
    built for 9.0 must not answer a 7.0 build)."""
    arch = "".join(c if c.isalnum() else "_" for c in arch_list) or "visible"
    return f"{build.library_name(key)}-{arch}"


def _registered() -> bool:
    import torch

    return hasattr(torch.ops.sm70, "gptq_gemv")


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def load_prebuilt() -> str:
    """Load a matching prebuilt library if there is one; never builds. Returns what it did."""
    global _loaded
    with _lock:
        if _loaded:
            return _loaded
        dirs = prebuilt_dirs()
        found = candidates(dirs)
        if not found:
            return "absent (not built: run `sm70ctl build`)"
        import torch

        try:
            key = build.library_key(build.runtime_identity())
        except sources.OpsSourceError as exc:  # a library, but no sources to check it by
            return f"unusable ({exc})"
        lib = pick_prebuilt(dirs, key)
        if lib is None:
            names = ", ".join(str(p) for p in found)
            return f"no match (none of {names} is {build.library_name(key)}.so for this runtime)"
        if not _registered():
            torch.ops.load_library(str(lib))
        _loaded = f"loaded {lib}"
        return _loaded


def load_ops(verbose: bool = False) -> str:
    """Register torch.ops.sm70.* in this process (prebuilt or built); idempotent."""
    global _loaded
    if _loaded:  # the common case, every op call: no lock
        return _loaded
    with _lock:
        if _loaded:
            return _loaded
        import torch

        if _registered():
            _loaded = "already registered"
            return _loaded
        key = build.library_key(build.runtime_identity())
        lib = pick_prebuilt(prebuilt_dirs(), key)
        if lib is None:
            lib = _built(key, verbose)
        else:
            torch.ops.load_library(str(lib))
        _loaded = f"loaded {lib}"
        return _loaded


def _built(key: str, verbose: bool) -> Path:
    """The cached library for `key`, built first under the lock if it is not there."""
    import torch

    slot = cache_dir() / cache_slot(key, os.environ.get(ARCH_ENV, ""))
    lib = slot / f"{build.library_name(key)}.so"
    with _flock(slot.with_suffix(".lock")):
        if lib.is_file():
            torch.ops.load_library(str(lib))
            return lib
        try:
            built = build.build_library(slot, verbose=verbose)
        except (RuntimeError, OSError) as exc:
            first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
            raise OpsLoadError(
                f"building the sm70 ops in {slot} failed: {first[0]} (set verbose=True or see "
                f"{slot / (build.library_name(key) + '.obj')} for the compiler output)"
            ) from exc
        return built
