"""The warmup manifest: structure checked, and a warm verdict only while its caches exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sm70ctl.errors import Sm70Error
from sm70ctl.runtime.manifest import (
    DONE,
    FAILED,
    MANIFEST,
    Manifest,
    Step,
    assess,
    load_manifest,
    read_manifest,
    write_manifest,
)

FP = "0123456789abcdef"


def _warm_entry(tmp_path: Path) -> Path:
    entry = tmp_path / FP
    for sub, n in (("vllm", 3), ("triton", 2)):
        (entry / sub).mkdir(parents=True)
        for i in range(n):
            (entry / sub / f"f{i}").write_bytes(b"x" * (i + 1))
    m = Manifest(fingerprint=FP, components={"torch": "2.9"}, device="cuda",
                 steps=[Step("kernels", DONE), Step("vllm", DONE), Step("verify", DONE)],
                 warm=True, created=1.0)
    write_manifest(entry, m)
    return entry


def _verdict(entry: Path):
    m = load_manifest(entry)
    return assess(FP, {"torch": "2.9"}, m, [])


def test_round_trip_records_inventory(tmp_path: Path) -> None:
    entry = _warm_entry(tmp_path)
    m = load_manifest(entry)
    assert m is not None and m.warm
    assert m.inventory == {"triton": {"files": 2, "bytes": 3}, "vllm": {"files": 3, "bytes": 6}}
    assert _verdict(entry).warm


def test_gone_cache_folder_is_cold(tmp_path: Path) -> None:
    entry = _warm_entry(tmp_path)
    for p in (entry / "vllm").iterdir():
        p.unlink()
    (entry / "vllm").rmdir()
    v = _verdict(entry)
    assert not v.warm and "vllm/ is gone" in v.reason


def test_emptied_cache_folder_is_cold_more_files_fine(tmp_path: Path) -> None:
    entry = _warm_entry(tmp_path)
    (entry / "triton" / "new").write_text("a server compiled a new shape")
    assert _verdict(entry).warm
    (entry / "vllm" / "f0").unlink()
    v = _verdict(entry)
    assert not v.warm and "vllm/ holds 2 of the 3 files" in v.reason


def _good() -> dict:
    return {"fingerprint": FP, "components": {"a": "b"}, "device": "cuda", "warm": True,
            "steps": [{"name": "vllm", "status": "done", "detail": "", "seconds": 1.0}],
            "created": 1.0, "version": 1}


@pytest.mark.parametrize("change,rule", [
    ({"steps": [1, "x"]}, "steps[0]: expected a table, got an integer"),
    ({"steps": [{"name": "vllm", "status": "bogus"}]}, "steps[0].status: 'bogus' is not one"),
    ({"steps": [{"name": "", "status": "done"}]}, "steps[0].name: empty string"),
    ({"steps": [{"name": "vllm", "status": "done", "seconds": "x"}]}, "seconds: expected a"),
    ({"steps": [{"name": "vllm", "status": FAILED}]}, "warm: warm, but its steps"),
    ({"steps": []}, "warm: warm, but its steps"),
    ({"warm": "false"}, "warm: expected true or false"),
    ({"fingerprint": None}, "fingerprint: expected a string, got null"),
    ({"components": {"a": 1}}, "components.a: expected a string"),
    ({"stray": 1}, "stray: unknown key"),
    ({"device": "tpu"}, "device: 'tpu' is not one of"),
    ({"inventory": {"etc": {"files": 1, "bytes": 1}}}, "inventory.etc: not a cache folder"),
])
def test_malformed_manifest_named(tmp_path: Path, change: dict, rule: str) -> None:
    entry = tmp_path / FP
    entry.mkdir()
    (entry / MANIFEST).write_text(json.dumps({**_good(), **change}))
    with pytest.raises(Sm70Error) as info:
        load_manifest(entry)
    assert f"warmup manifest {entry / MANIFEST}: " in info.value.message
    assert rule in info.value.message
    assert read_manifest(entry) is None  # cold, never warm


@pytest.mark.parametrize("content", [b"[" * 50_000, b"\x00\xff\x00", b""])
def test_unparseable_manifest(tmp_path: Path, content: bytes) -> None:
    entry = tmp_path / FP
    entry.mkdir()
    (entry / MANIFEST).write_bytes(content)
    with pytest.raises(Sm70Error):
        load_manifest(entry)


def test_manifest_that_is_a_folder(tmp_path: Path) -> None:
    (tmp_path / FP / MANIFEST).mkdir(parents=True)
    with pytest.raises(Sm70Error, match="is a folder"):
        load_manifest(tmp_path / FP)
