"""The import rules of docs/ARCHITECTURE.md, read from the source with `ast`.

Every `import` and `from ... import` counts, function-local ones and those under
TYPE_CHECKING included (a local import is still a dependency, only a later one). Strings
handed to importlib are not seen; the lazy names of sm70ctl/settings/__init__.py point
inside their own package.

Rules:
- every sm70ctl package or top-level module has a place in LAYERS (a new one must be
  placed, here and in the doc);
- nothing imports a unit of a higher layer;
- no cycle between units (siblings of one layer may import each other one way only);
- serve and warmup never import each other (both use runtime);
- vllm_patch (the plugin, in vLLM's processes) never imports sm70ctl;
- importing the CLI imports neither torch nor vllm (nor pydantic: `env check` stays fast).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Bottom to top. A unit is `vllm_patch`, the `sm70ctl` package itself (its __init__), or
# sm70ctl's first-level module or package (`sm70ctl.runtime` stands for all of runtime/).
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("plugin", frozenset({"vllm_patch"})),
    ("foundation", frozenset({
        "sm70ctl", "sm70ctl.errors", "sm70ctl.fsutil", "sm70ctl.locking", "sm70ctl.output",
        "sm70ctl.options", "sm70ctl.readers", "sm70ctl.secrets", "sm70ctl.kernels",
    })),
    ("settings and devices", frozenset({"sm70ctl.settings", "sm70ctl.devices"})),
    ("features", frozenset({
        "sm70ctl.plan", "sm70ctl.build", "sm70ctl.weights", "sm70ctl.doctor",
    })),
    ("runtime", frozenset({"sm70ctl.runtime"})),
    ("processes", frozenset({"sm70ctl.serve", "sm70ctl.warmup"})),
    ("cli", frozenset({"sm70ctl.cli", "sm70ctl.__main__"})),
)
NEVER = (("sm70ctl.serve", "sm70ctl.warmup"), ("sm70ctl.warmup", "sm70ctl.serve"))
ROOTS = ("sm70ctl", "vllm_patch")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool) -> tuple[set[str], set[str]]:
    """What `source` imports, as absolute dotted names (relative ones resolved): the modules
    it surely imports, and the names `from a import b` brings in (a.b: a module or not)."""
    modules: set[str] = set()
    maybe: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            modules.add(name)
            maybe.update(f"{name}.{alias.name}" for alias in node.names if alias.name != "*")
    return modules, maybe


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "vllm_patch":
        return "vllm_patch"
    if parts[0] != "sm70ctl":
        return None
    return ".".join(parts[:2])


def collect(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, for every .py under ROOTS."""
    found: dict[str, tuple[set[str], set[str]]] = {}
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            name = module_name(path, root)
            found[name] = imported_modules(path.read_text(encoding="utf-8"), name,
                                           path.name == "__init__.py")
    # `from a import b` imports the module a.b only when the tree has one
    return {a: {m for m in modules | {b for b in maybe if b in found} if unit_of(m)}
            for a, (modules, maybe) in found.items()}


def unit_edges(edges: Mapping[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the modules where it happens."""
    out: dict[tuple[str, str], list[str]] = {}
    for a, bs in edges.items():
        ua = unit_of(a)
        for b in bs:
            ub = unit_of(b)
            if ua and ub and ua != ub and not (ua.startswith(ub + ".")):
                out.setdefault((ua, ub), []).append(f"{a} imports {b}")
    return out


def layer_of(unit: str) -> int | None:
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    return None


def violations(edges: Mapping[str, set[str]]) -> list[str]:
    problems: list[str] = []
    units = {unit_of(m) for m in edges} - {None}
    for unit in sorted(u for u in units if layer_of(u) is None):
        problems.append(f"{unit} has no layer: place it in LAYERS and docs/ARCHITECTURE.md")
    by_pair = unit_edges(edges)
    for (ua, ub), where in sorted(by_pair.items()):
        la, lb = layer_of(ua), layer_of(ub)
        if la is not None and lb is not None and lb > la:
            problems.append(f"upward import: {where[0]} ({LAYERS[la][0]} -> {LAYERS[lb][0]})")
        if (ua, ub) in NEVER:
            problems.append(f"{where[0]}: {ua} and {ub} never import each other")
        if ua == "vllm_patch" and ub.startswith("sm70ctl"):
            problems.append(f"{where[0]}: the plugin never imports sm70ctl")
    graph: dict[str, set[str]] = {}
    for ua, ub in by_pair:
        graph.setdefault(ua, set()).add(ub)
    for cycle in cycles(graph):
        problems.append("import cycle between packages: " + ", ".join(cycle))
    return problems


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The units that import each other in a cycle: each strongly connected group of more
    than one unit (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


# --- the tree as it is -------------------------------------------------------------------
def test_the_tree_keeps_the_import_rules() -> None:
    assert violations(collect(REPO)) == []


def test_every_layer_unit_exists() -> None:
    """A unit listed in LAYERS that no longer exists is a stale rule (and a stale doc)."""
    units = {unit_of(m) for m in collect(REPO)}
    for _, members in LAYERS:
        for unit in members:
            assert unit in units, f"{unit} is in LAYERS but not in the tree"


def test_the_doc_lists_the_same_layers() -> None:
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for name, members in LAYERS:
        assert f"**{name}**" in doc, f"docs/ARCHITECTURE.md does not name the layer {name}"
        for unit in members:
            shown = unit.replace(".", "/") if unit.startswith("sm70ctl.") else unit
            assert f"`{shown}" in doc, f"docs/ARCHITECTURE.md does not place {unit}"


def test_every_package_has_an_init() -> None:
    """A folder of modules without __init__.py is a namespace package, which the wheel's
    package finder leaves out."""
    missing = sorted(str(d.relative_to(REPO)) for top in ROOTS for d in (REPO / top).rglob("*")
                     if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").exists())
    assert missing == []


def test_the_cli_imports_no_torch_vllm_or_pydantic() -> None:
    code = ("import sys; import sm70ctl.cli as c; c._wire(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'vllm', 'pydantic', 'pydantic_settings')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# --- the checker catches what it should (synthetic trees) -------------------------------
def _tree(tmp_path: Path, files: Mapping[str, str]) -> dict[str, set[str]]:
    base = {
        "sm70ctl/__init__.py": "",
        "sm70ctl/errors.py": "",
        "sm70ctl/serve/__init__.py": "",
        "sm70ctl/warmup/__init__.py": "",
        "sm70ctl/runtime/__init__.py": "",
        "sm70ctl/settings/__init__.py": "",
        "vllm_patch/__init__.py": "",
    }
    for rel, text in {**base, **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return collect(tmp_path)


def test_clean_synthetic_tree(tmp_path: Path) -> None:
    edges = _tree(tmp_path, {
        "sm70ctl/serve/command.py": "from sm70ctl.runtime import x\nfrom . import helper\n",
        "sm70ctl/serve/helper.py": "from ..errors import Sm70Error\n",
        "sm70ctl/runtime/x.py": "from sm70ctl.settings import typed\nimport vllm_patch\n",
    })
    assert edges["sm70ctl.serve.helper"] == {"sm70ctl.errors"}
    assert violations(edges) == []


@pytest.mark.parametrize(("files", "expect"), [
    # a function-local import counts
    ({"sm70ctl/warmup/runner.py": "def f():\n    from sm70ctl.serve import lock\n"},
     "never import each other"),
    ({"sm70ctl/serve/command.py": "import sm70ctl.warmup.runner\n"}, "never import each other"),
    ({"sm70ctl/settings/model.py": "from sm70ctl.runtime import environment\n"},
     "upward import: sm70ctl.settings.model imports sm70ctl.runtime"),
    ({"sm70ctl/errors.py": "from .settings import load\n"}, "upward import"),
    ({"vllm_patch/plugin.py": "def f():\n    import sm70ctl.errors\n"},
     "the plugin never imports sm70ctl"),
    ({"sm70ctl/gadget.py": ""}, "sm70ctl.gadget has no layer"),
    ({"sm70ctl/serve/a.py": "import sm70ctl.settings\n",
      "sm70ctl/runtime/b.py": "import sm70ctl.settings\n",
      "sm70ctl/settings/c.py": "from sm70ctl.errors import x\n",
      "sm70ctl/errors.py": "import sm70ctl.fsutil\n",
      "sm70ctl/fsutil.py": "import sm70ctl.errors\n"},
     "import cycle between packages: sm70ctl.errors, sm70ctl.fsutil"),
])
def test_the_checker_catches(tmp_path: Path, files: Mapping[str, str], expect: str) -> None:
    found = violations(_tree(tmp_path, files))
    assert any(expect in p for p in found), found
