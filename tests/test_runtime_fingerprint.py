"""Fingerprint components, hashing, and the warm/cold verdict (pure parts exhaustively)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sm70ctl.runtime.fingerprint import (
    cuda_compiler,
    diff_components,
    fingerprint,
    inherited_compile_env,
    probe_components,
    serving_versions,
    tree_digest,
)
from sm70ctl.runtime.manifest import (
    DONE,
    FAILED,
    NOT_NEEDED,
    SKIPPED,
    Manifest,
    Step,
    assess,
    read_manifest,
    write_manifest,
)
from sm70ctl.settings import load_settings


def test_tree_digest_tracks_content_and_names(tmp_path: Path) -> None:
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "a.cuh").write_text("x")
    d1 = tree_digest(tmp_path)
    (tmp_path / "k" / "__pycache__").mkdir()
    (tmp_path / "k" / "__pycache__" / "m.pyc").write_bytes(b"junk")
    assert tree_digest(tmp_path) == d1  # bytecode is not source
    (tmp_path / "k" / "a.cuh").write_text("y")
    d2 = tree_digest(tmp_path)
    assert d2 != d1
    (tmp_path / "k" / "a.cuh").rename(tmp_path / "k" / "b.cuh")
    assert tree_digest(tmp_path) not in (d1, d2)
    assert tree_digest(tmp_path / "none") == "absent"


def test_fingerprint_is_order_independent_and_sensitive() -> None:
    a = {"torch": "2.13.0", "vllm": "vllm 0.32.0", "SM70_GDN_CHUNK_SIZE": "64"}
    b = dict(reversed(list(a.items())))
    assert fingerprint(a) == fingerprint(b)
    assert len(fingerprint(a)) == 16
    assert fingerprint({**a, "torch": "2.14.0"}) != fingerprint(a)


def test_diff_names_each_change() -> None:
    old = {"torch": "2.13.0", "kernels": "aa", "gone": "1"}
    new = {"torch": "2.14.0", "kernels": "aa", "added": "2"}
    assert diff_components(old, new) == ["added: new (2)", "gone: gone (was 1)",
                                         "torch: 2.13.0 -> 2.14.0"]
    assert diff_components(old, old) == []


def test_serving_versions_from_a_real_interpreter() -> None:
    v = serving_versions(Path(sys.executable))
    assert v["python"] == sys.version.split()[0]
    assert v["torch"] == "absent"  # the tool's own environment has no torch
    assert serving_versions(Path("/nonexistent/python"))["serving_python"].startswith("missing")


def test_cuda_compiler(tmp_path: Path) -> None:
    (tmp_path / "version.json").write_text(json.dumps({"cuda": {"version": "12.8.1"}}))
    assert cuda_compiler(tmp_path, "absent") == "cuda 12.8.1"
    assert cuda_compiler(None, "12.8.93") == "nvrtc 12.8.93"
    assert cuda_compiler(None, "absent") == "none"
    assert cuda_compiler(tmp_path / "empty", "x").startswith("unknown")


def test_components_hold_compile_key_settings_only() -> None:
    base = load_settings(environ={"SM70_SERVE_PYTHON": sys.executable})
    comps = probe_components(base, "cuda")
    for key in ("kernels", "vllm_patch", "compiler", "python", "torch", "vllm", "device",
                "SM70_GDN_CHUNK_SIZE", "SM70_CUDA_ARCH_LIST"):
        assert key in comps
    assert "SM70_PORT" not in comps
    same = probe_components(load_settings(environ={"SM70_SERVE_PYTHON": sys.executable,
                                                   "SM70_PORT": "9000"}), "cuda")
    assert fingerprint(same) == fingerprint(comps)  # the port compiles nothing
    other = probe_components(load_settings(environ={"SM70_SERVE_PYTHON": sys.executable,
                                                    "SM70_GDN_CHUNK_SIZE": "32"}), "cuda")
    assert diff_components(comps, other) == ["SM70_GDN_CHUNK_SIZE: 64 -> 32"]
    assert fingerprint(probe_components(base, "cpu")) != fingerprint(comps)


def test_inherited_compile_env() -> None:
    environ = {"VLLM_USE_V1": "1", "VLLM_CACHE_ROOT": "/x", "PATH": "/bin", "TRITON_X": "2",
               "TORCHINDUCTOR_FREEZING": "1", "HOME": "/root"}
    assert inherited_compile_env(environ, {"VLLM_CACHE_ROOT"}) == {
        "env:VLLM_USE_V1": "1", "env:TRITON_X": "2", "env:TORCHINDUCTOR_FREEZING": "1"}
    s = load_settings(environ={"SM70_SERVE_PYTHON": sys.executable})
    comps = probe_components(s, "cuda", environ={"VLLM_CACHE_ROOT": "/elsewhere",
                                                 "VLLM_LOGGING_LEVEL": "DEBUG"})
    assert not [k for k in comps if k.startswith("env:")]  # serve sets those itself


def manifest(fp: str, warm: bool, steps: list[Step], created: float = 1.0, **comps: str):
    return Manifest(fingerprint=fp, components=dict(comps), device="cuda", steps=steps,
                    warm=warm, created=created)


def test_assess_warm() -> None:
    m = manifest("f", True, [Step("kernels", DONE), Step("vllm", DONE), Step("verify", DONE)])
    v = assess("f", {}, m, [])
    assert v.warm and "verified" in v.reason
    m = manifest("f", True, [Step("vllm", NOT_NEEDED)])
    assert assess("f", {}, m, []).reason == "nothing to compile for these settings"


def test_assess_cold_after_skipped_or_failed_steps() -> None:
    m = manifest("f", False, [Step("kernels", SKIPPED, "no V100 here"),
                              Step("vllm", FAILED, "exit 1"), Step("verify", SKIPPED)])
    v = assess("f", {}, m, [])
    assert not v.warm
    assert "kernels skipped (no V100 here)" in v.reason and "vllm failed (exit 1)" in v.reason


def test_assess_cold_names_what_changed() -> None:
    older = manifest("old", True, [], 1.0, torch="2.12.0", kernels="a")
    latest = manifest("new", True, [], 2.0, torch="2.13.0", kernels="a")
    v = assess("cur", {"torch": "2.14.0", "kernels": "a"}, None, [latest, older])
    assert not v.warm
    assert v.changed == ("torch: 2.13.0 -> 2.14.0",)
    assert "(new)" in v.reason and "torch: 2.13.0 -> 2.14.0" in v.reason
    many = {f"c{i}": "2" for i in range(8)}
    v = assess("cur", many, None, [manifest("x", True, [], 1.0, **{k: "1" for k in many})])
    assert "(+3 more)" in v.reason
    assert "empty cache" in assess("cur", {}, None, []).reason


def test_manifest_round_trip_and_atomic_write(tmp_path: Path) -> None:
    m = manifest("f", True, [Step("vllm", DONE, "ok", 12.5)], torch="2.13.0")
    path = write_manifest(tmp_path / "f", m)
    assert read_manifest(tmp_path / "f") == m
    assert [p.name for p in (tmp_path / "f").iterdir()] == [path.name]  # no temp files left
    path.write_text("{not json")
    assert read_manifest(tmp_path / "f") is None
    assert read_manifest(tmp_path / "missing") is None


def test_kernel_sources_matter_on_cuda_only(tmp_path: Path) -> None:
    (tmp_path / "csrc").mkdir()
    src = tmp_path / "csrc" / "k.cuh"
    src.write_text("v1")
    s = load_settings(environ={"SM70_SERVE_PYTHON": sys.executable})
    before = {d: fingerprint(probe_components(s, d, repo_root=tmp_path)) for d in ("cuda", "cpu")}
    src.write_text("v2")
    after = {d: fingerprint(probe_components(s, d, repo_root=tmp_path)) for d in ("cuda", "cpu")}
    assert after["cuda"] != before["cuda"]
    assert after["cpu"] == before["cpu"]
