"""Writes Clef folders for tests, and the real-shape spec of Qwen3.8-27B's Clef folder.

Pure Python (no torch, numpy or safetensors): the tensors are random fp16 packed with
`struct`, the files written with `vllm_patch.clef.safetensors_header.encode`.

- `write_clef_dir(dest)`: a small valid folder for TINY_CONFIG (64 layers, tiny widths,
  rank 8), the correction split over two files; `mutate` edits the manifest or the tensor
  list before writing, so a test can build each malformed variant.
- `real_spec(config)`: what a converter must produce for the real model: the manifest
  (sizes, no hashes: those come with the real weights) and every tensor's name and shape.

Command line: `python tests/clef_fixture.py DEST [--rank R]` writes a tiny folder;
`python tests/clef_fixture.py --spec [CONFIG]` prints the real-shape spec as JSON
(CONFIG defaults to the packaged Qwen3.8-27B config.json).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_patch.clef.head import REFERENCE_HEAD, head_tensors, parse_head_config  # noqa: E402
from vllm_patch.clef.layout import CLEF_LAYERS, corrections  # noqa: E402
from vllm_patch.clef.manifest import FORMAT, MANIFEST, VERSION, base_model  # noqa: E402
from vllm_patch.clef.model_dims import FULL, LINEAR, model_dims  # noqa: E402
from vllm_patch.clef.safetensors_header import encode  # noqa: E402

REAL_CONFIG = ROOT / "sm70ctl" / "data" / "qwen3.8-27b" / "config.json"
# 64 layers (Clef's layer rule needs them), every 4th full attention as in Qwen3.8-27B;
# one KV head so TP=2 exercises vLLM's KV-head replication
TINY_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 64,
    "layer_types": [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(64)],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "attn_output_gate": True,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
TINY_HEAD: dict[str, Any] = {**REFERENCE_HEAD, "input_size": 32, "width": 64, "blocks": 1,
                             "attention_heads": 4, "mlp_size": 96}
Tensors = list[tuple[str, str, tuple[int, ...], bytes]]


def fp16_bytes(shape: tuple[int, ...], rng: random.Random, scale: float = 0.02) -> bytes:
    n = math.prod(shape)
    return struct.pack(f"<{n}e", *(rng.gauss(0.0, scale) for _ in range(n)))


def correction_tensors(config: dict[str, Any], rank: int, seed: int = 0) -> Tensors:
    rng = random.Random(seed)
    out: Tensors = []
    for c in corrections(model_dims(config)):
        out.append((c.a_name, "F16", c.a_shape(rank), fp16_bytes(c.a_shape(rank), rng)))
        out.append((c.b_name, "F16", c.b_shape(rank), fp16_bytes(c.b_shape(rank), rng)))
    return out


def head_tensor_list(config: dict[str, Any], head: dict[str, Any], seed: int = 1) -> Tensors:
    rng = random.Random(seed)
    cfg = parse_head_config(head, model_dims(config).hidden_size)
    return [(n, "F16", s, fp16_bytes(s, rng)) for n, s in head_tensors(cfg).items()]


def manifest(config: dict[str, Any], rank: int, head: dict[str, Any],
             files: dict[str, bytes], correction_files: list[str], head_file: str
             ) -> dict[str, Any]:
    return {
        "format": FORMAT, "version": VERSION, "rank": rank, "alpha": rank,
        "layers": [CLEF_LAYERS.start, CLEF_LAYERS.stop - 1], "dtype": "float16",
        "base_model": base_model(model_dims(config)),
        "correction_files": correction_files, "head_file": head_file, "head": head,
        "files": {n: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                  for n, b in files.items()},
    }


def write_clef_dir(dest: Path, config: dict[str, Any] | None = None, rank: int = 8,
                   head: dict[str, Any] | None = None,
                   mutate: Callable[[dict[str, Any], Tensors, Tensors], None] | None = None
                   ) -> Path:
    """A Clef folder at `dest`; `mutate(manifest, correction_tensors, head_tensors)` may
    edit the lists before the files are encoded and the manifest after (its `files`
    entries are recomputed unless mutate set them)."""
    config = config or TINY_CONFIG
    head = dict(head or TINY_HEAD)
    corr = correction_tensors(config, rank)
    heads = head_tensor_list(config, head)
    names = ["correction-00001-of-00002.safetensors", "correction-00002-of-00002.safetensors"]
    m = manifest(config, rank, head, {}, names, "head.safetensors")
    if mutate is not None:
        mutate(m, corr, heads)
    half = len(corr) // 2
    blobs = {names[0]: encode(corr[:half]), names[1]: encode(corr[half:]),
             "head.safetensors": encode(heads)}
    if not m["files"]:
        m["files"] = manifest(config, rank, head, blobs, names, "head.safetensors")["files"]
    dest.mkdir(parents=True, exist_ok=True)
    for name, blob in blobs.items():
        (dest / name).write_bytes(blob)
    (dest / MANIFEST).write_text(json.dumps(m, indent=1), encoding="utf-8")
    return dest


def real_spec(config: dict[str, Any], rank: int = 256,
              head: dict[str, Any] | None = None) -> dict[str, Any]:
    """The folder a converter writes for `config`: the manifest without hashes, and every
    tensor (name, shape, F16, the file it goes in)."""
    d = model_dims(config)
    head = dict(head or REFERENCE_HEAD)
    cfg = parse_head_config(head, d.hidden_size)
    tensors: dict[str, dict[str, Any]] = {}
    for c in corrections(d):
        for name, shape in ((c.a_name, c.a_shape(rank)), (c.b_name, c.b_shape(rank))):
            tensors[name] = {"shape": list(shape), "dtype": "F16",
                             "file": "correction.safetensors"}
    for name, shape in head_tensors(cfg).items():
        tensors[name] = {"shape": list(shape), "dtype": "F16", "file": "head.safetensors"}
    m = manifest(config, rank, head, {}, ["correction.safetensors"], "head.safetensors")
    m["files"] = {f: {"tensor_bytes": sum(2 * math.prod(t["shape"]) for t in tensors.values()
                                          if t["file"] == f), "sha256": "<of the file>"}
                  for f in ("correction.safetensors", "head.safetensors")}
    return {"manifest": m, "tensors": tensors}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--spec":
        path = Path(argv[1]) if len(argv) > 1 else REAL_CONFIG
        print(json.dumps(real_spec(json.loads(path.read_text())), indent=1))
        return 0
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    rank = int(argv[2]) if len(argv) > 2 and argv[1] == "--rank" else 8
    print(write_clef_dir(Path(argv[0]), rank=rank))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
