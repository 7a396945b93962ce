"""Read and check a `.safetensors` file's header without torch (pure Python, bounded).

The file format: 8 bytes, the little-endian length n of a UTF-8 JSON header; the header
maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets from the
end of the header), plus an optional "__metadata__" map of strings; the data follows.
We check what a loader would trip on later, so a damaged file is refused with its name:
the header fits in the file, every tensor's byte count equals its shape times its dtype's
size, and the tensors tile the data area exactly (no gap, no overlap, nothing after).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_patch.clef.errors import ClefError

# the safetensors library refuses headers above 100 MB; ours are a few hundred KB
MAX_HEADER_BYTES = 100_000_000
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset from the start of the file
    end: int


def _entry(file: str, name: str, raw: Any, base: int) -> TensorInfo:
    where = f"{file}: tensor {name!r}"
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise ClefError(f"{where}: header entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ClefError(f"{where}: dtype {dtype!r} is not a safetensors dtype")
    if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ClefError(f"{where}: shape {shape!r} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(
            isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]):
        raise ClefError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != want:
        raise ClefError(f"{where}: holds {offsets[1] - offsets[0]:,} bytes, its shape "
                        f"{tuple(shape)} of {dtype} needs {want:,}")
    return TensorInfo(name, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def parse_header(data: bytes, file_size: int, file: str) -> tuple[dict[str, TensorInfo],
                                                                   dict[str, str]]:
    """The tensors and metadata of a file of `file_size` bytes whose first bytes are `data`
    (at least 8 + the header length). `file` names it in errors."""
    if file_size < 8 or len(data) < 8:
        raise ClefError(f"{file}: {file_size} bytes, too short for a safetensors file")
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise ClefError(f"{file}: header length {n:,} does not fit a {file_size:,}-byte file "
                        f"(limit {MAX_HEADER_BYTES:,})")
    if len(data) < 8 + n:
        raise ClefError(f"{file}: header truncated")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ClefError(f"{file}: header is not UTF-8 JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ClefError(f"{file}: header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ClefError(f"{file}: __metadata__ must map strings to strings")
    base = 8 + n
    tensors = {name: _entry(file, name, raw, base) for name, raw in header.items()}
    pos = base
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            rule = "overlaps the one before" if t.begin < pos else "leaves a gap before it"
            raise ClefError(f"{file}: tensor {t.name!r} {rule} (data starts at byte "
                            f"{t.begin:,}, expected {pos:,})")
        pos = t.end
    if pos != file_size:
        raise ClefError(f"{file}: tensors end at byte {pos:,} of {file_size:,} (the file is "
                        "truncated or carries trailing bytes)")
    return tensors, meta


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """`parse_header` of a file on disk (reads only the header)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            rest = f.read(min(n, MAX_HEADER_BYTES, max(0, size - 8)))
    except OSError as exc:
        raise ClefError(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    return parse_header(head + rest, size, path.name)


def encode(tensors: list[tuple[str, str, tuple[int, ...], bytes]],
           metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file from (name, dtype, shape, raw little-endian bytes), tensors laid
    out in the given order; the header is padded with spaces to 8 bytes as the library
    writes it. For test fixtures (the real files come from the safetensors library)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos,
                                                                              pos + len(raw)]}
        pos += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(t[3] for t in tensors)
