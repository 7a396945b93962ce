"""The GPU mutation check (tests/gpu/mutants.py) stays applicable without a GPU: each
mutation still finds its source text in csrc/ (exactly as often as it expects), changes the
file, and names tests and parameters that exist; its selection plugin keeps exactly the
named items."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import mutants  # noqa: E402

from vllm_patch.ops import sources  # noqa: E402


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=[m.name for m in mutants.MUTANTS])
def test_mutation_applies_to_the_current_kernels(mutant, tmp_path: Path) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(sources.csrc_dir(), csrc)
    mutants.apply_edits(csrc, mutant.edits)
    for e in mutant.edits:
        assert (csrc / e.path).read_text() != (sources.csrc_dir() / e.path).read_text()
    assert sources.source_hash(csrc) != sources.source_hash()


def test_a_mutation_that_no_longer_matches_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.cuh").write_text("x = 1;\n")
    with pytest.raises(SystemExit, match="matched 0 times"):
        mutants.apply_edits(tmp_path, (mutants.Edit("a.cuh", r"y = 1;", "y = 2;", 1),))


def _signatures(path: Path) -> dict[str, set[str]]:
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            out[node.name] = {a.arg for a in node.args.args}
    return out


def test_every_named_test_and_parameter_exists() -> None:
    for m in mutants.MUTANTS:
        assert m.expect_fail, m.name
        for path, func, params in (*m.expect_fail, *m.expect_pass):
            sigs = _signatures(ROOT / path)
            assert func in sigs, (m.name, path, func)
            assert set(params) <= sigs[func], (m.name, func, set(params) - sigs[func])


def test_selection_keeps_the_named_items_and_records_outcomes(tmp_path: Path) -> None:
    (tmp_path / "test_dummy.py").write_text(
        "import pytest\n"
        "@pytest.fixture(params=['native', 'sm70'])\n"
        "def arch(request):\n    return request.param\n"
        "@pytest.mark.parametrize('ctxs,qn', [([37], 1), ([37], 4), ([9], 1)])\n"
        "def test_a(ctxs, qn, arch):\n    assert qn != 1 or ctxs != [37]\n"
        "def test_b():\n    pass\n")
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import mutants, pytest; "
        "p = mutants.Select([('test_dummy.py', 'test_a', {'ctxs': [37], 'qn': 1}), "
        "('test_dummy.py', 'test_b', {})]); "
        "pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[2]], plugins=[p]); "
        "print('RESULT', json.dumps([p.spec_of, p.outcome]))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests" / "gpu"),
                          str(tmp_path / "test_dummy.py")], capture_output=True, text=True,
                         timeout=120, check=True, cwd=tmp_path).stdout
    spec_of, outcome = __import__("json").loads(out.split("RESULT ", 1)[1])
    assert spec_of == {"test_dummy.py::test_a[native-ctxs0-1]": 0,
                       "test_dummy.py::test_a[sm70-ctxs0-1]": 0, "test_dummy.py::test_b": 1}
    assert set(outcome.values()) == {"failed", "passed"}
    assert outcome["test_dummy.py::test_b"] == "passed"
