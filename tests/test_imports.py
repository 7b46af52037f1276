"""The import graph of lmforge/ is acyclic and follows the layer table of docs/ARCHITECTURE.md.

The graph is read from the source with `ast` (nothing is imported, so a cycle hidden behind a
function-level import counts as much as one at module level):

- `import a.b.c` is an edge to a.b.c; `from a.b import c` is an edge to a.b.c when that is a
  module, else to a.b (the name comes from the package's __init__); relative imports are resolved
  against the importing module's package.
- Imports anywhere in the file count: module level, inside functions and methods, under
  `if TYPE_CHECKING:` (a type-only import still couples the two modules).
- Only edges between modules of lmforge/ are kept. Imports by computed name
  (importlib.import_module(name)) are not seen.

A cycle is reported as the strongly connected component it lies in plus one concrete loop
through it, e.g. `lmforge.a -> lmforge.b -> lmforge.a`.

The layers are read from the table in docs/ARCHITECTURE.md (so the document and the rule cannot
drift apart): a package imports only packages of lower layers, plus the few same-layer uses that
table's notes name (SIDEWAYS).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lmforge"
ARCHITECTURE = ROOT.parent / "docs" / "ARCHITECTURE.md"

# Cycles outside lmforge/model/ that are still to be removed, each as the set of modules of one
# strongly connected component. The test fails if a cycle appears that is not inside one of these
# (no new cycle can creep in), and if one of these has changed (fixed or shrunk): then update or
# delete its entry, so the list only ever shrinks to empty.
KNOWN_CYCLES: list[frozenset[str]] = []

# Same-layer imports the layer table allows (importer, imported), as its notes say.
SIDEWAYS = {
    ("data", "tokenizer"), ("fileio", "errors"), ("lm", "chat_completion"), ("interop", "infer"),
}  # fmt: skip
# Entry points above every layer: `python -m lmforge` runs the CLI; the package root re-exports
# LM and ModelConfig lazily.
ENTRY_POINTS = {"__main__": 99, "": 99}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under `root` (a package dir)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` statement reads from."""
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _known_prefix(name: str, modules: dict[str, Path]) -> str | None:
    """`name` itself if it is one of `modules`, else its longest dotted prefix that is."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `module` (source at `path`) imports, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_known_prefix(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else _known_prefix(base, modules))
    found.discard(None)
    found.discard(module)  # an __init__'s `from . import name` (name not a module): no edge
    return found  # type: ignore[return-value]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the lmforge modules it imports."""
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Components of more than one module (Tarjan, iterative): each holds at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    components.append(frozenset(members))
    return components


def a_loop(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """One shortest import loop through the component's first module (breadth-first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    loop = [node]
                    while loop[-1] != start:
                        loop.append(parents[loop[-1]])
                    return [start, *reversed(loop[:-1]), start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def describe(graph: dict[str, set[str]], components: list[frozenset[str]]) -> str:
    """One line per component: a concrete loop, then every module in the component."""
    lines = []
    for comp in sorted(components, key=min):
        lines.append(f"{' -> '.join(a_loop(graph, comp))}   (component: {', '.join(sorted(comp))})")
    return "\n".join(lines)


# ---- the graph builder itself ------------------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_graph_sees_relative_submodule_and_function_level_imports(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import thing\n",
        "pkg/a.py": "from . import b\nthing = 1\n",
        "pkg/b.py": "def f():\n    from .sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import pkg.a\nfrom ..sub import d\nfrom pkg import thing\n",
        "pkg/sub/d.py": "import typing\nif typing.TYPE_CHECKING:\n    from ..b import f\n",
    })  # fmt: skip
    graph = import_graph(pkg)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.c"},
        "pkg.sub": set(),
        "pkg.sub.c": {"pkg.a", "pkg.sub.d", "pkg"},
        "pkg.sub.d": {"pkg.b"},
    }
    components = strongly_connected(graph)
    assert components == [frozenset({"pkg", "pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.d"})]
    assert a_loop(graph, components[0]) == ["pkg", "pkg.a", "pkg.b", "pkg.sub.c", "pkg"]


def test_graph_without_cycles_has_no_components(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "import os\n",
        "pkg/mid.py": "from pkg.low import x\nfrom pkg import low\n",
        "pkg/top.py": "from .mid import y\nimport pkg.low\n",
    })  # fmt: skip
    graph = import_graph(pkg)
    assert graph["pkg.top"] == {"pkg.mid", "pkg.low"} and graph["pkg.mid"] == {"pkg.low"}
    assert strongly_connected(graph) == []


# ---- lmforge ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_new_import_cycles(graph):
    components = strongly_connected(graph)
    new = [c for c in components if not any(c <= known for known in KNOWN_CYCLES)]
    assert not new, "import cycles in lmforge/:\n" + describe(graph, new)


def test_known_cycles_are_still_there(graph):
    """KNOWN_CYCLES shrinks as cycles are removed: an entry that no longer matches a component
    exactly must be updated or deleted."""
    components = set(strongly_connected(graph))
    stale = [sorted(known) for known in KNOWN_CYCLES if known not in components]
    assert not stale, f"update KNOWN_CYCLES, these are fixed or changed: {stale}"


def layer_table(path: Path = ARCHITECTURE) -> dict[str, int]:
    """Top-level package or module of lmforge/ -> its layer, from the markdown table whose rows
    read `| <layer> | `pkg/`, `mod.py` | ... |`."""
    layers = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if row:
            for name in re.findall(r"`([\w.]+?)(?:/|\.py)?`", row.group(2)):
                layers[name] = int(row.group(1))
    return layers


def top_package(module: str) -> str:
    """lmforge.infer.engine -> 'infer'; lmforge -> ''."""
    return module.split(".")[1] if "." in module else ""


def test_layer_table_is_read_and_covers_every_package():
    layers = layer_table()
    assert layers["cli"] == 7 and layers["model"] == 1 and layers["errors"] == 0, layers
    tops = {top_package(m) for m in module_files()} - set(ENTRY_POINTS)
    missing = sorted(tops - set(layers))
    assert not missing, f"docs/ARCHITECTURE.md's layer table does not list: {missing}"


def test_layer_check_flags_upward_and_sideways_imports():
    layers = {"low": 0, "mid": 1, "side": 1, "top": 2}
    graph = {
        "lmforge.top.a": {"lmforge.mid.b"},
        "lmforge.mid.b": {"lmforge.top.a", "lmforge.side", "lmforge.low", "lmforge.mid.c"},
    }
    assert layer_violations(graph, layers, set()) == [
        "lmforge.mid.b (layer 1) -> lmforge.side (layer 1)",
        "lmforge.mid.b (layer 1) -> lmforge.top.a (layer 2)",
    ]
    assert layer_violations(graph, layers, {("mid", "side")}) == [
        "lmforge.mid.b (layer 1) -> lmforge.top.a (layer 2)"
    ]


def layer_violations(
    graph: dict[str, set[str]], layers: dict[str, int], sideways: set[tuple[str, str]]
) -> list[str]:
    """Edges from a package to one of the same or a higher layer (other than `sideways`)."""
    levels = {**layers, **ENTRY_POINTS}
    found = []
    for module, targets in graph.items():
        for target in targets:
            src, dst = top_package(module), top_package(target)
            if src == dst or (src, dst) in sideways:
                continue
            if levels[dst] >= levels[src]:
                found.append(f"{module} (layer {levels[src]}) -> {target} (layer {levels[dst]})")
    return sorted(found)


def test_every_import_points_down_the_layer_table(graph):
    bad = layer_violations(graph, layer_table(), SIDEWAYS)
    assert not bad, "imports against docs/ARCHITECTURE.md's layers:\n" + "\n".join(bad)
