"""No import cycles among zofed's modules, deferred imports included.

Every module under ``src/zofed`` is parsed with ``ast`` and every ``import``/``from ... import`` anywhere in
the file counts: at module level, inside functions and methods (the deferred imports that used to hide
cycles), inside ``try`` blocks, and inside ``if TYPE_CHECKING:`` blocks. TYPE_CHECKING imports count too:
a name one layer needs only for an annotation still says which layer depends on which, and a cycle hidden
behind ``TYPE_CHECKING`` is the same tangle a deferred import hides, so none is exempt.

Resolution: ``import zofed.a.b`` and ``from zofed.a import b`` (``b`` a submodule) import ``zofed.a.b``;
``from zofed.a import name`` imports ``zofed.a``; relative imports resolve against the importing module's
package. Importing ``zofed.a.b`` also runs ``zofed/__init__.py`` and ``zofed/a/__init__.py``, but those
edges are left out: counting them would make every package ``__init__`` that re-exports one of its own
submodules a cycle (``zofed.a`` -> ``zofed.a.b`` -> ``zofed.a``), which is how packages work, not a tangle
between layers. A package ``__init__``'s own imports count like any module's.

The test fails listing every strongly connected component of more than one module (and any module that
imports itself), each with the edges inside it and the line numbers they come from.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "zofed"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, source: str, is_package: bool, modules: Iterable[str]) -> list[tuple[str, int]]:
    """Every zofed module that module `name` (whose text is `source`) imports, with the line of the import."""
    modules = set(modules)
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                # `import zofed.a.b` binds zofed but runs zofed.a.b: the deepest zofed module named
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    found.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:
                    found.append((sub, node.lineno))
                elif source in modules:
                    found.append((source, node.lineno))
    return found


def import_graph() -> dict[str, dict[str, list[int]]]:
    """module -> {imported module -> [lines]}, package-__init__ edges from a module's own ancestors left out."""
    modules = _modules()
    graph: dict[str, dict[str, list[int]]] = {name: defaultdict(list) for name in modules}
    for name, path in modules.items():
        for target, line in _imports(name, path.read_text(), _is_package(path), modules):
            if target != name and name.startswith(target + "."):
                continue  # an ancestor package's __init__: runs on any import of `name`, see the docstring
            if line not in graph[name][target]:
                graph[name][target].append(line)
    return graph


def _strongly_connected(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def find_cycles() -> list[str]:
    graph = import_graph()
    reports = []
    for component in _strongly_connected(graph):
        members = set(component)
        if len(component) == 1 and component[0] not in graph[component[0]]:
            continue
        edges = [
            f"    {source} -> {target} (line {', '.join(map(str, lines))})"
            for source in component
            for target, lines in sorted(graph[source].items())
            if target in members
        ]
        reports.append(f"{len(component)} modules: {', '.join(component)}\n" + "\n".join(edges))
    return reports


def test_the_walker_counts_deferred_type_checking_and_relative_imports():
    modules = ["zofed.a", "zofed.a.b", "zofed.a.c", "zofed.d", "zofed.e", "zofed.f"]
    source = """
from typing import TYPE_CHECKING
import numpy
from zofed.a import c, helper
from . import b
from ..d import thing
if TYPE_CHECKING:
    from zofed.e import Type
def later():
    import zofed.f
"""
    found = _imports("zofed.a.b", source, False, modules)
    assert sorted(found) == [("zofed.a", 4), ("zofed.a.b", 5), ("zofed.a.c", 4), ("zofed.d", 6), ("zofed.e", 8),
                             ("zofed.f", 10)]
    # a package __init__'s relative imports resolve against the package itself
    assert _imports("zofed.a", "from .c import x\nfrom .. import d", True, modules) == [("zofed.a.c", 1),
                                                                                           ("zofed.d", 2)]
    cyclic = {"x": {"y": [1]}, "y": {"z": [2]}, "z": {"x": [3]}, "w": {"w": [4]}, "v": {"x": [5]}}
    assert sorted(_strongly_connected(cyclic)) == [["v"], ["w"], ["x", "y", "z"]]


def test_the_graph_holds_every_module_and_the_deferred_imports():
    graph = import_graph()
    assert len(graph) > 50
    # cli.py imports its commands' modules inside the command functions
    assert any(name.startswith("zofed.run.") for name in graph["zofed.cli"])


def test_no_import_cycles():
    cycles = find_cycles()
    assert not cycles, "import cycles (deferred imports included):\n" + "\n".join(cycles)


@pytest.mark.parametrize("package", ["zofed.fl", "zofed.data", "zofed.zo"])
def test_lower_layers_never_import_the_run_layer(package):
    """run/ builds fl/'s objects (and data/'s, zo/'s) from a config; the layers below it (the rounds, roles,
    methods, data and ZO engine) know nothing of the config or of the backends and commands above them."""
    above = ("zofed.run", "zofed.sim", "zofed.flower", "zofed.cli")
    graph = import_graph()
    wrong = [f"{source} -> {target} (line {', '.join(map(str, lines))})"
             for source in sorted(graph) if source.startswith(package + ".")
             for target, lines in sorted(graph[source].items())
             if any(target == layer or target.startswith(layer + ".") for layer in above)]
    assert not wrong, f"{package} imports a layer above it:\n" + "\n".join(wrong)
