"""The package's import graph, drawn from its source with ``ast``: no module imports itself back through
others (no circle), and no module below the store reaches up into it. Run this file to see the graph:
``python tests/unit/test_import_graph.py`` prints every module with what it imports.

Imports under ``if TYPE_CHECKING:`` count too (a circle for the type checker is a circle for the reader);
imports inside functions count (they are deferred, not absent)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "otel_capture"

# The floors that must not look up: nothing in them imports the store, or a module that imports it.
BELOW_THE_STORE = ("otel_capture._records", "otel_capture._dialects", "otel_capture._correlation.ids")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom, modules: set[str]) -> set[str]:
    """What ``from X import a, b`` in ``module`` imports: ``X.a`` where that is a module of its own
    (``from . import _attributes``), else ``X`` (a name defined in it)."""
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in modules else base)
    return found


def import_graph() -> dict[str, set[str]]:
    """Every module of ``otel_capture`` (exporters and the demo install inside it but live elsewhere and
    sit above it) with the ``otel_capture`` modules it imports."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                candidates = {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                candidates = _resolve(module, path.name == "__init__.py", node, set(files))
            else:
                continue
            targets |= {name for name in candidates if name in files and name != module}
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "otel_capture._store.reading" in graph["otel_capture._store"]
    assert "otel_capture._records.codec" in graph["otel_capture._store.reading"]


def test_the_import_graph_has_no_circle() -> None:
    assert _cycles(import_graph()) == []


def _reaching(graph: dict[str, set[str]], package: str) -> set[str]:
    """The modules of ``package`` and every module that imports one, directly or through others."""
    found = {m for m in graph if m == package or m.startswith(package + ".")}
    grew = True
    while grew:
        more = {m for m, targets in graph.items() if targets & found} - found
        found |= more
        grew = bool(more)
    return found


def test_nothing_below_the_store_imports_the_store_or_anything_above_it() -> None:
    graph = import_graph()
    store_and_above = _reaching(graph, "otel_capture._store")
    below = [m for m in graph if m.startswith(BELOW_THE_STORE)]
    assert below and "otel_capture._attach" in store_and_above
    assert {m: sorted(graph[m] & store_and_above) for m in below if graph[m] & store_and_above} == {}


if __name__ == "__main__":
    for name, targets in sorted(import_graph().items()):
        print(name, "->", ", ".join(sorted(targets)) or "-")
    sys.exit(0)
