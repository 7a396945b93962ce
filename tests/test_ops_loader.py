"""vllm_patch.ops without torch: where the sources are, their hash (the lock's rule), the
library key and which prebuilt file the loader would take."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sm70ctl.build.lock import tree_hash
from vllm_patch.ops import build, loader, sources

ROOT = Path(__file__).resolve().parent.parent
IDENTITY = {"os": "linux-x86_64", "torch": "2.9.1+cu128", "cuda": "12.8",
            "python": "cpython-312", "source_hash": "ab" * 32}


def test_checkout_sources_are_found_and_listed() -> None:
    assert sources.csrc_dir() == ROOT / "csrc"
    units = sources.translation_units()
    assert units and all(p.parent == ROOT / "csrc" / "torch_bindings" for p in units)
    assert {p.suffix for p in units} <= {".cu", ".cpp"}
    assert sources.include_dirs() == [ROOT / "csrc"]


def test_packaged_copy_is_the_fallback_and_neither_is_an_error(tmp_path: Path,
                                                              monkeypatch) -> None:
    packaged = tmp_path / "_csrc"
    (packaged / "torch_bindings").mkdir(parents=True)
    (packaged / "torch_bindings" / "ops.cu").write_text("// unit\n")
    (packaged / "torch_bindings" / "notes.txt").write_text("not a unit\n")
    monkeypatch.setattr(sources, "CHECKOUT_CSRC", tmp_path / "absent")
    monkeypatch.setattr(sources, "PACKAGED_CSRC", packaged)
    assert sources.csrc_dir() == packaged
    assert [p.name for p in sources.translation_units()] == ["ops.cu"]
    monkeypatch.setattr(sources, "PACKAGED_CSRC", tmp_path / "also-absent")
    with pytest.raises(sources.OpsSourceError, match="no kernel sources"):
        sources.csrc_dir()


def test_source_hash_is_the_lock_rule_and_follows_content_and_names(tmp_path: Path) -> None:
    assert sources.source_hash() == tree_hash(ROOT / "csrc")
    root = tmp_path / "csrc"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.cuh").write_text("int x;\n")
    (root / "y.cu").write_text("int y;\n")
    first = sources.source_hash(root)
    assert first == tree_hash(root)
    (root / "y.cu").write_text("int y; \n")
    second = sources.source_hash(root)
    (root / "y.cu").rename(root / "z.cu")
    assert len({first, second, sources.source_hash(root)}) == 3
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    assert sources.source_hash(root) == tree_hash(root)


@pytest.mark.parametrize("missing", [False, True])
def test_source_hash_refuses_an_empty_or_missing_folder(tmp_path: Path, missing: bool) -> None:
    root = tmp_path / "csrc"
    if not missing:
        root.mkdir()
    with pytest.raises(sources.OpsSourceError, match="missing or empty"):
        sources.source_hash(root)


def test_library_key_changes_with_every_identity_field() -> None:
    base = build.library_key(IDENTITY)
    assert len(base) == 16 and base == build.library_key(dict(IDENTITY))
    for field in build.IDENTITY_FIELDS:
        assert build.library_key({**IDENTITY, field: IDENTITY[field] + "x"}) != base, field
    with pytest.raises(ValueError, match="cuda"):
        build.library_key({**IDENTITY, "cuda": ""})


def test_prebuilt_is_picked_by_key_in_directory_order(tmp_path: Path) -> None:
    env_dir, packaged = tmp_path / "env", tmp_path / "pkg"
    env_dir.mkdir()
    packaged.mkdir()
    key = build.library_key(IDENTITY)
    other = build.library_key({**IDENTITY, "torch": "2.10.0"})
    (env_dir / f"{build.library_name(other)}.so").write_bytes(b"")
    assert loader.pick_prebuilt([env_dir, packaged], key) is None
    (packaged / f"{build.library_name(key)}.so").write_bytes(b"")
    assert loader.pick_prebuilt([env_dir, packaged], key) == packaged / f"sm70_ops_{key}.so"
    (env_dir / f"{build.library_name(key)}.so").write_bytes(b"")
    assert loader.pick_prebuilt([env_dir, packaged], key) == env_dir / f"sm70_ops_{key}.so"
    assert len(loader.candidates([env_dir, packaged])) == 3


def test_search_and_cache_folders_follow_the_environment(tmp_path: Path) -> None:
    assert loader.prebuilt_dirs({}) == [loader.PACKAGED_LIB_DIR]
    assert loader.prebuilt_dirs({"SM70_OPS_LIB_DIR": str(tmp_path)}) == [
        tmp_path, loader.PACKAGED_LIB_DIR]
    assert loader.cache_dir({"SM70_KERNELS_BUILD_DIR": str(tmp_path)}) == tmp_path
    assert loader.cache_dir({}).parts[-2:] == ("sm70ctl", "ops")
    assert loader.cache_slot("k", "7.0") != loader.cache_slot("k", "9.0")
    assert loader.cache_slot("k", "") == "sm70_ops_k-visible"


def test_plugin_path_without_a_library_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from vllm_patch.ops import loader; "
        "loader.PACKAGED_LIB_DIR = __import__('pathlib').Path(sys.argv[1]); "
        "print(loader.load_prebuilt()); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=60, check=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}).stdout
    assert out.split() == ["absent", "(not", "built:", "run", "`sm70ctl", "build`)", "False"]


FAKE_TORCH = r"""
import json, sys, types
from pathlib import Path
calls = []
torch = types.ModuleType("torch")
torch.__version__ = "2.9.1+cu128"
torch.version = types.SimpleNamespace(cuda="12.8")
torch.ops = types.SimpleNamespace(load_library=calls.append, sm70=types.SimpleNamespace())
sys.modules["torch"] = torch
from vllm_patch.ops import build, loader, sources
lib_dir = Path(sys.argv[1])
loader.PACKAGED_LIB_DIR = lib_dir
key = build.library_key(build.runtime_identity())
seen = []
(lib_dir / "sm70_ops_0123456789abcdef.so").write_bytes(b"")
seen.append([loader.load_prebuilt(), len(calls)])
(lib_dir / f"{build.library_name(key)}.so").write_bytes(b"")
seen.append([loader.load_prebuilt(), len(calls)])
seen.append([loader.load_prebuilt(), len(calls)])
loader._loaded = None
sources.CHECKOUT_CSRC = sources.PACKAGED_CSRC = lib_dir / "no-csrc"
seen.append([loader.load_prebuilt(), len(calls)])
print(json.dumps({"seen": seen, "calls": calls, "key": key}))
"""


def test_prebuilt_is_loaded_only_when_it_matches_this_runtime(tmp_path: Path) -> None:
    """load_prebuilt with a stand-in torch: a library for another runtime is not loaded, the
    matching one is (once), and without sources to check against nothing is."""
    out = subprocess.run([sys.executable, "-c", FAKE_TORCH, str(tmp_path)], capture_output=True,
                         text=True, timeout=60, check=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}).stdout
    data = __import__("json").loads(out)
    lib = str(tmp_path / f"sm70_ops_{data['key']}.so")
    (no_match, n0), (loaded, n1), (again, n2), (unusable, n3) = data["seen"]
    assert no_match.startswith("no match") and n0 == 0
    assert loaded == f"loaded {lib}" and n1 == 1 and data["calls"] == [lib]
    assert again == loaded and n2 == 1
    assert unusable.startswith("unusable (no kernel sources") and n3 == 1
