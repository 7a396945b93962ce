"""The settings-only compile-cache key and where each compiler keeps its cache in an entry.

The full key (`runtime.fingerprint`) adds sources, compilers and library versions; the
entries themselves and their manifests are `runtime.manifest`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sm70ctl.settings.typed import SettingsView


def compile_key_items(settings: SettingsView) -> dict[str, str]:
    """Every setting marked compile_key in the schema, in its environment spelling."""
    from sm70ctl.settings.schema import load_schema

    return {
        v.name: settings.env_text(v.name)
        for v in load_schema().variables
        if v.compile_key
    }


def compile_fingerprint(settings: SettingsView) -> str:
    """Short hash of the kernel-shaping settings: names the compile-cache folder."""
    text = json.dumps(sorted(compile_key_items(settings).items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compile_cache_dir(settings: SettingsView) -> Path:
    """The default cache entry, keyed on settings alone; serve and warmup pass the entry
    `sm70ctl warmup` fingerprints (sources, compilers, library versions too)."""
    return Path(settings.cache_dir) / compile_fingerprint(settings)


# Where each compiler keeps its cache inside one cache entry (`sm70ctl warmup` fills them;
# SM70_KERNELS_BUILD_DIR is read by our kernel loader in the server process).
CACHE_SUBDIRS = {
    "VLLM_CACHE_ROOT": "vllm",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "SM70_KERNELS_BUILD_DIR": "kernels",
}


def cache_env(entry: Path) -> dict[str, str]:
    """The variables that point vLLM, Triton, TorchInductor and our kernel loader at one
    cache entry."""
    return {var: str(Path(entry) / sub) for var, sub in CACHE_SUBDIRS.items()}
