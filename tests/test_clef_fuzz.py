"""Hostile input reaches Clef's readers only as one-line refusals: damaged safetensors
headers, manifests with any JSON in any field, scoring requests of any JSON shape never
raise anything but ClefError / RequestError (no TypeError, RecursionError, traceback)."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any

from clef_fixture import TINY_CONFIG, write_clef_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_patch.clef.errors import ClefError
from vllm_patch.clef.manifest import parse_manifest
from vllm_patch.clef.model_dims import model_dims
from vllm_patch.clef.routing import RequestError
from vllm_patch.clef.safetensors_header import encode, parse_header
from vllm_patch.clef.scoring import Limits, validate_request
from vllm_patch.clef.validate import read_manifest

BLOB = encode([("a", "F16", (2, 3), b"\1" * 12), ("b", "F16", (4,), b"\2" * 8)])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                              max_size=4),
    max_leaves=12)
DIMS = model_dims(TINY_CONFIG)


@given(st.lists(st.tuples(st.integers(0, len(BLOB) - 1), st.integers(0, 255)), max_size=6),
       st.integers(0, len(BLOB)))
@settings(max_examples=300, deadline=None)
def test_damaged_safetensors_bytes(edits: list[tuple[int, int]], cut: int) -> None:
    raw = bytearray(BLOB)
    for i, v in edits:
        raw[i] = v
    data = bytes(raw[:cut])
    with contextlib.suppress(ClefError):
        parse_header(data, len(data), "x.safetensors")


ENTRY = st.fixed_dictionaries({"dtype": st.sampled_from(["F16", "I8"]) | JSON,
                               "shape": st.lists(st.integers(-2, 4), max_size=3) | JSON,
                               "data_offsets": st.lists(st.integers(-2, 30), max_size=3)
                               | JSON})


@given(st.dictionaries(st.sampled_from(["a", "b", "__metadata__"]), ENTRY | JSON, max_size=3))
@settings(max_examples=300, deadline=None)
def test_any_json_header(header: dict[str, Any]) -> None:
    text = json.dumps(header).encode()
    data = len(text).to_bytes(8, "little") + text + b"\0" * 20
    with contextlib.suppress(ClefError):
        parse_header(data, len(data), "x.safetensors")


def test_deeply_nested_json(tmp_path: Path) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    data = len(deep).to_bytes(8, "little") + deep
    try:
        parse_header(data, len(data), "x.safetensors")
    except ClefError as e:
        assert "header is not" in str(e)
    (tmp_path / "clef.json").write_bytes(deep[:1000_000])
    try:
        read_manifest(tmp_path)
    except ClefError as e:
        assert "clef.json" in str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_manifest_with_any_value_anywhere(data: st.DataObject) -> None:
    base = json.loads((_folder() / "clef.json").read_text())
    m = copy.deepcopy(base)
    key = data.draw(st.sampled_from(sorted(m)))
    if isinstance(m[key], dict) and data.draw(st.booleans()):
        sub = data.draw(st.sampled_from(sorted(m[key]) or ["x"]))
        m[key][sub] = data.draw(JSON)
    else:
        m[key] = data.draw(JSON)
    with contextlib.suppress(ClefError):
        parse_manifest(m, DIMS, 8)


_CACHE: list[Path] = []


def _folder() -> Path:
    if not _CACHE:
        import tempfile
        _CACHE.append(write_clef_dir(Path(tempfile.mkdtemp(prefix="clef-fuzz-"))))
    return _CACHE[0]


GOOD = {"model": "m", "input": "x", "questions": [
    {"id": "q", "kind": "choice", "text": "t", "options": ["a", "b"]},
    {"id": "s", "kind": "score", "text": "t", "range": {"min": 1, "max": 3}}]}


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_scoring_request_of_any_shape(data: st.DataObject) -> None:
    body = copy.deepcopy(GOOD)
    where = data.draw(st.sampled_from(["top", "question", "range", "options"]))
    value = data.draw(JSON)
    if where == "top":
        body[data.draw(st.sampled_from(["model", "input", "questions", "x"]))] = value
    elif where == "question":
        body["questions"][0][data.draw(st.sampled_from(["id", "kind", "text", "options"]))] = value
    elif where == "range":
        body["questions"][1]["range"] = value
    else:
        body["questions"][0]["options"].append(value)
    with contextlib.suppress(RequestError):
        validate_request(body, Limits())
