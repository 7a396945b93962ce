"""The vllm_patch series: well formed, documented in SERIES.md, and applying to the pinned
vLLM release's real sources (downloaded by .ci/setup.d/30-vllm-sources.sh)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from sm70ctl.build.lock import load_lock
from sm70ctl.build.patches import (
    PatchError,
    apply_series,
    describe_failure,
    hunks,
    list_series,
    series_dir,
)
from sm70ctl.build.sources import unpack_archive
from sm70ctl.fsutil import sha256_file

ROOT = Path(__file__).resolve().parent.parent
SERIES_MD = ROOT / "vllm_patch" / "patches" / "SERIES.md"
FIELDS = ("Targets", "Why", "How", "Upstream", "Remove when")


def test_series_is_nonempty_and_well_named() -> None:
    series = list_series(series_dir())
    assert series, "the series must hold at least the CMake arch-list patch"
    assert [p.name for p in series] == sorted(p.name for p in series)
    assert any("cmake" in p.name for p in series)


def test_every_patch_is_documented_in_series_md() -> None:
    text = SERIES_MD.read_text()
    for p in list_series(series_dir()):
        m = re.search(rf"^## {re.escape(p.name)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
        assert m, f"SERIES.md has no section for {p.name}"
        for field in FIELDS:
            assert re.search(rf"^- \*\*{field}\*\*: \S", m.group(1), re.M), (p.name, field)
    documented = set(re.findall(r"^## (\d{4}-\S+\.patch)$", text, re.M))
    assert documented == {p.name for p in list_series(series_dir())}


def test_hunk_parsing_and_failure_description() -> None:
    patch = (series_dir() / list_series(series_dir())[0].name).read_text()
    hs = hunks(patch)
    assert hs and hs[0][0] == "CMakeLists.txt"
    _file, start, header = hs[0]
    msg = describe_failure(patch, f"error: patch failed: CMakeLists.txt:{start}\n")
    assert msg == f"hunk #1 of CMakeLists.txt ({header}) does not match the source"
    assert "does not exist" in describe_failure(patch, "error: nope.txt: No such file or directory")


def _sdist() -> Path | None:
    a = load_lock().archive("vllm")
    p = ROOT / "build" / "ci" / a.filename
    return p if p.is_file() else None


def _require(problem: str | None) -> None:
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The pinned sdist unpacked twice: as released, and with the whole series applied."""
    sdist = _sdist()
    _require(None if sdist else "pinned vLLM sdist absent: run .ci/setup.d/30-vllm-sources.sh")
    assert sdist is not None
    a = load_lock().archive("vllm")
    assert sha256_file(sdist) == a.sha256
    top = tmp_path_factory.mktemp("vllm")
    pristine, src = top / "pristine", top / "src"
    for d in (pristine, src):
        d.mkdir()
        unpack_archive(sdist, d, a.strip)
    applied = apply_series(src, list_series(series_dir()))
    assert applied == [p.name for p in list_series(series_dir())]
    return pristine, src


def test_series_applies_to_the_pinned_vllm_release(trees: tuple[Path, Path]) -> None:
    src = trees[1]
    cmake = (src / "CMakeLists.txt").read_text()
    # The CUDA >= 12.8 branch now keeps 7.0; the CUDA 13 branch (which cannot) does not.
    branch = cmake.split("VERSION_GREATER_EQUAL 12.8)", 1)[1].split("else()", 1)[0]
    assert re.search(r'set\(CUDA_SUPPORTED_ARCHS "7\.0;7\.5;', branch)
    cuda13 = cmake.split("VERSION_GREATER_EQUAL 13.0)", 1)[1].split("elseif", 1)[0]
    assert '"7.0' not in cuda13
    # The attention enum names our backend, at the class path the plugin registers.
    from vllm_patch.plugin import ATTENTION_CLASS

    registry = src / "vllm" / "v1" / "attention" / "backends" / "registry.py"
    text = registry.read_text()
    compile(text, str(registry), "exec")
    assert f'    SM70_PAGED = "{ATTENTION_CLASS}"' in text
    assert text.index("SM70_PAGED =") < text.index("CUSTOM = None")
    # Applying twice must fail loudly (the series is not silently re-applied).
    with pytest.raises(PatchError, match="does not apply"):
        apply_series(src, list_series(series_dir()))


HUMMING = Path("vllm/model_executor/layers/quantization/humming.py")
SERVE_PYTHON = ROOT / ".serve-venv" / "bin" / "python"
VLLM_TREE = ROOT / "build" / "ci" / "vllm-0.22.1-py"
VLLM_DEPS = ROOT / "build" / "ci" / "vllm-0.22.1-deps"


def _humming_probe(path: Path) -> dict[str, object]:
    """tests/vllm_humming_probe.py on one humming.py, in the serving venv with vLLM 0.22.1."""
    if not SERVE_PYTHON.is_file():
        _require(f"{SERVE_PYTHON} is missing (run .ci/setup.d/20-serve-env.sh)")
    if not (VLLM_TREE / "vllm" / "__init__.py").is_file() or not VLLM_DEPS.is_dir():
        _require(f"{VLLM_TREE} is missing (run .ci/setup.d/35-vllm-0.22.1-py.sh)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join(
        str(p) for p in (VLLM_TREE, VLLM_DEPS, ROOT / "tests" / "vllm_probe_site")
    )
    res = subprocess.run(
        [str(SERVE_PYTHON), str(ROOT / "tests" / "vllm_humming_probe.py"), str(path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=path.parent,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_patched_humming_module_imports_without_humming(trees: tuple[Path, Path]) -> None:
    """Patch 0003: on CUDA without humming-kernels, the released module fails to import
    (the V100 blocker: every quantized checkpoint imports it), the patched one imports, its
    probe leaves a GPTQ checkpoint to the next method, and only building it is refused."""
    pristine, src = trees
    patched = _humming_probe(src / HUMMING)
    assert patched["humming_found"] is False, "the serving venv must not have humming"
    assert "import_error" not in patched, patched
    assert patched["probe_gptq"] is None
    assert str(patched["build_error"]).startswith("ImportError: quantization 'humming' needs "
                                                  "the humming-kernels package")
    released = _humming_probe(pristine / HUMMING)
    assert released.get("import_error") == "ModuleNotFoundError: No module named 'humming'"
