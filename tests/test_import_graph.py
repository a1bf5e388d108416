"""Every module of the package imports, and no two modules import each other (even lazily).

The graph is built from the source with ``ast``: every ``import`` / ``from ... import`` of a
``torchrec_proactive`` module, at module level or inside a function, is an edge. A cycle
means two modules that cannot be read (or changed) one without the other; a lazy import
inside a function only hides it from Python, not from a reader.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = "torchrec_proactive"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        package = package.rsplit(".", 1)[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(module: str, path: Path) -> Set[str]:
    """The package's modules that ``module`` imports (``from pkg import sub`` names ``pkg.sub``)."""
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in MODULES:
                    out.add(target)
                elif base in MODULES:
                    out.add(base)
    out.discard(module)
    return out


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package():
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    assert f"{PACKAGE}.store.tiered_table" in MODULES and f"{PACKAGE}.bench.runner" in MODULES
    # a relative import, a lazy one inside a function, and `from pkg import submodule`
    assert f"{PACKAGE}.bench.scaling_study" in graph[f"{PACKAGE}.bench.runner"]
    assert f"{PACKAGE}.app.train" in graph[f"{PACKAGE}.app.entry"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_among_the_package_modules():
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    assert _cycles(graph) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports(module):
    importlib.import_module(module)
