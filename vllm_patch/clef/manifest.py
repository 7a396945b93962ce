"""`clef.json`, the manifest of an `SM70_CLEF_DIR` (pure: parsed JSON in, Manifest out).

Fields (all required, no others):
- `format` "sm70-clef", `version` 1;
- `rank` (a multiple of 8 up to 256, the op's limit) and `alpha` (provenance only: the
  stored B already carries alpha / rank);
- `layers` [40, 63], the first and last corrected decoder layer; `dtype` "float16";
- `base_model`: the base config's widths the correction was built for (`BASE_FIELDS`);
- `correction_files`: the safetensors files holding every layers.*.lora_A / lora_B;
- `head_file`: the safetensors file holding the head's tensors; `head`: its config;
- `files`: for every file above, {"bytes", "sha256"}.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.head import HeadConfig, parse_head_config
from vllm_patch.clef.layout import CLEF_LAYERS
from vllm_patch.clef.model_dims import ModelDims

MANIFEST = "clef.json"
FORMAT = "sm70-clef"
VERSION = 1
MAX_RANK = 256  # int8_gemm_lowrank's limit per correction
BASE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "linear_num_key_heads",
               "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
FIELDS = {"format", "version", "rank", "alpha", "layers", "dtype", "base_model",
          "correction_files", "head_file", "head", "files"}
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.safetensors$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class FileEntry:
    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    rank: int
    alpha: float
    correction_files: tuple[str, ...]
    head_file: str
    head: HeadConfig
    files: dict[str, FileEntry]


def base_model(d: ModelDims) -> dict[str, int]:
    """The `base_model` object a correction for model `d` carries."""
    return {k: getattr(d, k) for k in BASE_FIELDS}


def _file_name(v: Any, where: str) -> str:
    if not isinstance(v, str) or not _FILE_NAME.match(v) or ".." in v:
        raise ClefError(f"{MANIFEST}: {where} = {v!r} is not a plain *.safetensors file name "
                        "inside the folder")
    return v


def parse_manifest(raw: Any, d: ModelDims, rank: int | None = None) -> Manifest:
    """The manifest, checked against the base model `d` and the configured `rank`
    (SM70_CLEF_RANK; None skips that comparison)."""
    if not isinstance(raw, Mapping):
        raise ClefError(f"{MANIFEST}: not a JSON object")
    unknown, missing = sorted(set(raw) - FIELDS), sorted(FIELDS - set(raw))
    if unknown or missing:
        raise ClefError(f"{MANIFEST}: unknown fields {unknown}, missing fields {missing}")
    if raw["format"] != FORMAT or raw["version"] != VERSION:
        raise ClefError(f"{MANIFEST}: format {raw['format']!r} version {raw['version']!r}; "
                        f"this loader reads {FORMAT!r} version {VERSION}")
    r = raw["rank"]
    if isinstance(r, bool) or not isinstance(r, int) or not 8 <= r <= MAX_RANK or r % 8:
        raise ClefError(f"{MANIFEST}: rank = {r!r} is not a multiple of 8 from 8 to {MAX_RANK}")
    if rank is not None and r != rank:
        raise ClefError(f"{MANIFEST}: rank = {r}, but SM70_CLEF_RANK is {rank} (they must "
                        "match)")
    alpha = raw["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ClefError(f"{MANIFEST}: alpha = {alpha!r} is not a positive number")
    want_layers = [CLEF_LAYERS.start, CLEF_LAYERS.stop - 1]
    if raw["layers"] != want_layers:
        raise ClefError(f"{MANIFEST}: layers = {raw['layers']!r}; Clef corrects decoder "
                        f"layers {want_layers}")
    if raw["dtype"] != "float16":
        raise ClefError(f"{MANIFEST}: dtype = {raw['dtype']!r}; the correction is float16")
    base = raw["base_model"]
    if not isinstance(base, Mapping) or set(base) != set(BASE_FIELDS):
        raise ClefError(f"{MANIFEST}: base_model must have exactly {list(BASE_FIELDS)}")
    for key, want in base_model(d).items():
        if base[key] != want:
            raise ClefError(f"{MANIFEST}: base_model.{key} = {base[key]!r}, the model config "
                            f"has {want} (a correction for another base model)")
    corr = raw["correction_files"]
    if not isinstance(corr, list) or not corr:
        raise ClefError(f"{MANIFEST}: correction_files must be a non-empty list")
    names = [_file_name(v, f"correction_files[{i}]") for i, v in enumerate(corr)]
    head_file = _file_name(raw["head_file"], "head_file")
    if len({*names, head_file}) != len(names) + 1:
        raise ClefError(f"{MANIFEST}: a file is named twice in correction_files / head_file")
    files_raw = raw["files"]
    if not isinstance(files_raw, Mapping):
        raise ClefError(f"{MANIFEST}: files must be a JSON object")
    files: dict[str, FileEntry] = {}
    for name in [*names, head_file]:
        e = files_raw.get(name)
        if (not isinstance(e, Mapping) or set(e) != {"bytes", "sha256"}
                or isinstance(e["bytes"], bool) or not isinstance(e["bytes"], int)
                or e["bytes"] < 8 or not isinstance(e["sha256"], str)
                or not _SHA256.match(e["sha256"])):
            raise ClefError(f"{MANIFEST}: files[{name!r}] must be {{\"bytes\": size, "
                            "\"sha256\": 64 lower-case hex digits}")
        files[name] = FileEntry(name, e["bytes"], e["sha256"])
    extra = sorted(set(files_raw) - set(files))
    if extra:
        raise ClefError(f"{MANIFEST}: files lists {extra}, which no correction_files or "
                        "head_file names")
    head = parse_head_config(raw["head"], d.hidden_size, f"{MANIFEST}: head")
    return Manifest(r, float(alpha), tuple(names), head_file, head, files)
