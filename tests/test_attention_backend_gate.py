"""The SM70_PAGED gate: the plugin registers the attention backend, and the settings accept
SM70_ATTENTION_BACKEND=SM70_PAGED, only when `vllm_patch.attention` defines the class.

`vllm_patch.attention` is put in place for each case by prepending a temporary folder to
`vllm_patch.__path__`, so the lookup goes through the same `find_spec` as in production. The
registration cases use stand-ins for vLLM's registry module (vLLM 0.22.1 is not in the
test venv); what they check is our decision, not vLLM's registry.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import vllm_patch
from sm70ctl.settings import load_settings
from vllm_patch import plugin

MODULE = plugin.ATTENTION_MODULE


@pytest.fixture
def attention_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder that is `vllm_patch.attention` for the test (empty: write files into it)."""
    root = tmp_path / "overlay"
    folder = root / "attention"
    folder.mkdir(parents=True)
    monkeypatch.setattr(vllm_patch, "__path__", [str(root), *vllm_patch.__path__])
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield folder
    sys.modules.pop(MODULE, None)


def test_the_shipped_tree_defines_the_backend_and_settings_accept_sm70_paged() -> None:
    assert plugin.attention_backend_defined()
    assert load_settings({"SM70_ATTENTION_BACKEND": "SM70_PAGED"}).attention_backend == (
        "SM70_PAGED")


def test_a_readme_only_folder_is_not_a_backend(attention_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the overlay alone: a regular package later on the path would win over a namespace one
    monkeypatch.setattr(vllm_patch, "__path__", [str(attention_dir.parent)])
    (attention_dir / "README.md").write_text("the backend will live here\n")
    assert plugin.attention_backend_defined() is False
    assert plugin._register_attention_backend().startswith("absent (")


@pytest.mark.parametrize(("source", "defined"), [
    ("", False),
    ("Sm70PagedBackendX = 1\n", False),
    ("def helper():\n    class Sm70PagedBackend:\n        pass\n", False),  # not top level
    ("class Sm70PagedBackend:\n    pass\n", True),
    ("from .backend import Sm70PagedBackend\n", True),
    ("from .backend import Backend as Sm70PagedBackend\n", True),
    ("Sm70PagedBackend = make()\n", True),
    ("class Sm70PagedBackend(\n", False),  # a syntax error defines nothing
])
def test_defined_reads_the_top_level_bindings(attention_dir: Path, source: str,
                                              defined: bool) -> None:
    (attention_dir / "__init__.py").write_text(source)
    assert plugin.attention_backend_defined() is defined


def test_settings_accept_sm70_paged_once_the_class_exists(attention_dir: Path) -> None:
    (attention_dir / "__init__.py").write_text("class Sm70PagedBackend:\n    pass\n")
    assert load_settings({"SM70_ATTENTION_BACKEND": "SM70_PAGED"}).attention_backend == (
        "SM70_PAGED")


def _fake_vllm(monkeypatch: pytest.MonkeyPatch) -> tuple[type, list[tuple[object, str]]]:
    calls: list[tuple[object, str]] = []

    class AttentionBackend:
        pass

    class AttentionBackendEnum:
        SM70_PAGED = types.SimpleNamespace(name="SM70_PAGED")
        CUSTOM = types.SimpleNamespace(name="CUSTOM")

    backend = types.ModuleType("vllm.v1.attention.backend")
    backend.AttentionBackend = AttentionBackend  # type: ignore[attr-defined]
    registry = types.ModuleType("vllm.v1.attention.backends.registry")
    registry.AttentionBackendEnum = AttentionBackendEnum  # type: ignore[attr-defined]
    registry.register_backend = lambda slot, path: calls.append((slot, path))  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, backend.__name__, backend)
    monkeypatch.setitem(sys.modules, registry.__name__, registry)
    return AttentionBackend, calls


@pytest.mark.parametrize("source", [
    "Sm70PagedBackend = None\n",
    "class Sm70PagedBackend:\n    pass\n",  # a class, but not a vLLM AttentionBackend
    "import missing_module_h13\nclass Sm70PagedBackend:\n    pass\n",  # does not import
])
def test_a_name_without_a_backend_class_is_not_registered(
        attention_dir: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    _base, calls = _fake_vllm(monkeypatch)
    (attention_dir / "__init__.py").write_text(source)
    assert plugin.attention_backend_defined()
    assert plugin._register_attention_backend().startswith("absent (")
    assert calls == []


def test_a_real_backend_class_is_registered_under_sm70_paged(
        attention_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _base, calls = _fake_vllm(monkeypatch)
    (attention_dir / "__init__.py").write_text(
        "from vllm.v1.attention.backend import AttentionBackend\n"
        "class Sm70PagedBackend(AttentionBackend):\n    pass\n")
    assert plugin._register_attention_backend() == f"SM70_PAGED -> {plugin.ATTENTION_CLASS}"
    assert [(slot.name, path) for slot, path in calls] == [  # type: ignore[attr-defined]
        ("SM70_PAGED", plugin.ATTENTION_CLASS)]
