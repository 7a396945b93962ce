"""Check a whole `SM70_CLEF_DIR` before anything is loaded onto a GPU.

`check_tensors` decides (pure: manifest and parsed headers in); `validate_clef_dir` is the
edge that reads the folder: the manifest, each file's size and sha256, each header. Every
refusal is one ClefError naming the file, the tensor and the rule.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.head import head_tensors
from vllm_patch.clef.layout import CLEF_LAYERS, Correction, corrections, fused_slices
from vllm_patch.clef.manifest import MANIFEST, Manifest, parse_manifest
from vllm_patch.clef.model_dims import ModelDims, model_dims
from vllm_patch.clef.safetensors_header import TensorInfo, read_header
from vllm_patch.clef.sharding import shard

MAX_MANIFEST_BYTES = 1 << 20
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class LoadedCorrection:
    correction: Correction
    file: str
    a: TensorInfo
    b: TensorInfo


@dataclass(frozen=True)
class ClefDir:
    """A checked folder: where every tensor is, ready for the GPU loader."""

    path: Path
    manifest: Manifest
    corrections: tuple[LoadedCorrection, ...]
    head: dict[str, TensorInfo]


def _index(files: Iterable[str], headers: Mapping[str, Mapping[str, TensorInfo]]
           ) -> dict[str, tuple[str, TensorInfo]]:
    out: dict[str, tuple[str, TensorInfo]] = {}
    for f in files:
        for name, t in headers[f].items():
            if name in out:
                raise ClefError(f"{f}: tensor {name!r} is also in {out[name][0]}")
            out[name] = (f, t)
    return out


def _check_shape(file: str, t: TensorInfo, want: tuple[int, ...], rank: int | None,
                 rank_axis: int | None) -> None:
    where = f"{file}: tensor {t.name!r}"
    if t.dtype != "F16":
        raise ClefError(f"{where}: dtype {t.dtype}; Clef's tensors are F16")
    if t.shape == want:
        return
    if (rank is not None and rank_axis is not None and len(t.shape) == 2
            and t.shape[1 - rank_axis] == want[1 - rank_axis]):
        raise ClefError(f"{where}: shape {t.shape} has rank {t.shape[rank_axis]}, "
                        f"clef.json says rank {rank}")
    raise ClefError(f"{where}: shape {t.shape}, the model config needs {want}")


def check_tensors(m: Manifest, headers: Mapping[str, Mapping[str, TensorInfo]],
                  d: ModelDims, tp_sizes: Iterable[int] = (1, 2)
                  ) -> tuple[tuple[LoadedCorrection, ...], dict[str, TensorInfo]]:
    """Every expected A and B present once, F16, of the model config's shape, shardable at
    each tensor-parallel size in `tp_sizes`; the head's tensors exactly as its config says."""
    expected = corrections(d)
    found = _index(m.correction_files, headers)
    known = {n for c in expected for n in (c.a_name, c.b_name)}
    for name, (f, _) in sorted(found.items()):
        if name in known:
            continue
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) not in CLEF_LAYERS:
            raise ClefError(f"{f}: tensor {name!r} is in layer {layer.group(1)}, outside the "
                            f"corrected layers {CLEF_LAYERS.start}-{CLEF_LAYERS.stop - 1}")
        raise ClefError(f"{f}: tensor {name!r} is not a correction Clef defines "
                        "(layers.N.MODULE.lora_A / lora_B of a corrected linear)")
    loaded: list[LoadedCorrection] = []
    for (_layer, fused), group in fused_slices(expected).items():
        for c in group:
            for name in (c.a_name, c.b_name):
                if name not in found:
                    what = (f"{fused} needs all {len(group)} slices: "
                            + ", ".join(g.module.rsplit('.', 1)[-1] for g in group)
                            if len(group) > 1 else "every corrected linear needs A and B")
                    raise ClefError(f"{MANIFEST}: tensor {name!r} is in none of "
                                    f"correction_files ({what})")
            fa, a = found[c.a_name]
            fb, b = found[c.b_name]
            _check_shape(fa, a, c.a_shape(m.rank), m.rank, 0)
            _check_shape(fb, b, c.b_shape(m.rank), m.rank, 1)
            for tp in tp_sizes:
                for r in range(tp):
                    shard(c, tp, r)
            loaded.append(LoadedCorrection(c, fa, a, b))
    head = dict(headers[m.head_file])
    want = head_tensors(m.head)
    for name, t in sorted(head.items()):
        if name not in want:
            raise ClefError(f"{m.head_file}: tensor {name!r} is not part of the "
                            f"{len(want)}-tensor head its config describes")
        _check_shape(m.head_file, t, want[name], None, None)
    missing = sorted(set(want) - set(head))
    if missing:
        raise ClefError(f"{m.head_file}: head tensor {missing[0]!r} is missing "
                        f"({len(missing)} missing in all)")
    return tuple(loaded), head


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(folder: Path) -> Any:
    path = folder / MANIFEST
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise ClefError(f"{MANIFEST}: {size:,} bytes, more than {MAX_MANIFEST_BYTES:,}")
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ClefError(f"{folder}: has no {MANIFEST} (is SM70_CLEF_DIR a Clef folder?)"
                        ) from None
    except ClefError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        # a deeply nested document overflows the parser's recursion: refused like bad JSON
        raise ClefError(f"{MANIFEST}: cannot be read as JSON ({type(exc).__name__})"
                        ) from None


def validate_clef_dir(folder: Path, model_config: Mapping[str, Any], rank: int | None = None,
                      tp_sizes: Iterable[int] = (1, 2), check_hashes: bool = True) -> ClefDir:
    """The checked contents of `folder` for the base model of `model_config`."""
    d = model_dims(model_config)
    m = parse_manifest(read_manifest(folder), d, rank)
    headers: dict[str, dict[str, TensorInfo]] = {}
    for name, entry in m.files.items():
        path = folder / name
        if not path.is_file():
            raise ClefError(f"{name}: listed in {MANIFEST} but not in {folder}")
        size = path.stat().st_size
        if size != entry.bytes:
            raise ClefError(f"{name}: {size:,} bytes, {MANIFEST} says {entry.bytes:,}")
        if check_hashes and sha256_file(path) != entry.sha256:
            raise ClefError(f"{name}: sha256 differs from {MANIFEST} (damaged or replaced)")
        headers[name] = read_header(path)[0]
    loaded, head = check_tensors(m, headers, d, tp_sizes)
    return ClefDir(folder, m, loaded, head)
