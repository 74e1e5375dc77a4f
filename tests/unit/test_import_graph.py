"""The package's import graph, drawn from its source with ``ast``: no module imports itself back through
others (no circle), nothing imports a later floor (the layers below), and code outside a subpackage
imports it only through its face (its ``__init__``). Run this file to see the graph:
``python tests/unit/test_import_graph.py`` prints it by folder, then every module with what it imports.

Imports under ``if TYPE_CHECKING:`` count too (a circle for the type checker is a circle for the reader);
imports inside functions count (they are deferred, not absent). Importing a module of another subpackage
runs that subpackage's face first, so such an import is an edge to the face as well.

The rule for faces: the package's own code, the exporters and the demo import a subpackage only from its
face. Tests and benchmarks take from the face whatever it holds; they may import a module of the
subpackage for what the face does not hold (the internals they test or measure: ``_Deadlines``,
``STATE_DIR``, a module to patch)."""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "otel_capture"

# The floors, bottom first: a module imports only from its own floor or the ones before it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "flat bottom",
        tuple(
            f"otel_capture.{name}"
            for name in (
                "_errors",
                "_key_pattern",
                "_rollout_id",
                "_settings",
                "_asgi",
                "_notices",
                "_attributes",
                "_sdk_private",
                "_version",
            )
        ),
    ),
    ("_dialects", ("otel_capture._dialects",)),
    ("_records", ("otel_capture._records",)),
    ("_correlation", ("otel_capture._correlation",)),
    ("_store", ("otel_capture._store",)),
    ("_telemetry", ("otel_capture._telemetry",)),
    ("_capture", ("otel_capture._capture",)),
    ("_proxy", ("otel_capture._proxy",)),
    (
        "flat top",
        (
            "otel_capture._instrumentor",
            "otel_capture._attach",
            "otel_capture._health",
            "otel_capture.conformance",
            "otel_capture",
        ),
    ),
    ("_cli", ("otel_capture._cli", "otel_capture.__main__")),
)
# The subpackages with a face; outside code goes through it.
FACED = ("_correlation", "_store", "_telemetry", "_capture", "_proxy")
# Code outside the package that the face rule covers: the rule for the package itself, or for tests.
OUTSIDE_STRICT = ("exporters", "examples/demo")
OUTSIDE_TESTING = ("tests", "bench")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    return ".".join(parts[:keep] + ([node.module] if node.module else []))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom, modules: set[str]) -> set[str]:
    """What ``from X import a, b`` in ``module`` imports: ``X.a`` where that is a module of its own
    (``from . import _attributes``), else ``X`` (a name defined in it)."""
    base = _base(module, is_package, node)
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in modules else base)
    return found


def _subpackage(module: str) -> str | None:
    """The faced subpackage ``module`` belongs to (``otel_capture._store``), if any."""
    for name in FACED:
        package = f"otel_capture.{name}"
        if module == package or module.startswith(package + "."):
            return package
    return None


def _package_files() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Every module of ``otel_capture`` (exporters and the demo install inside it but live elsewhere and
    sit above it) with the ``otel_capture`` modules it imports, the faces its imports run included."""
    files = _package_files()
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
            for name in candidates:
                package = _subpackage(name)
                if package is not None and package != _subpackage(module):
                    targets.add(package)  # the face runs first
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


def layer_of(module: str) -> int:
    """The floor ``module`` stands on (an index into :data:`LAYERS`)."""
    best: tuple[int, int] | None = None  # (length of the matching prefix, floor)
    for floor, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "otel_capture" and module.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), floor)
    assert best is not None, f"{module} stands on no floor: add it to LAYERS"
    return best[1]


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "otel_capture._store.reading" in graph["otel_capture._store"]
    assert "otel_capture._records.codec" in graph["otel_capture._store.reading"]
    # an import of another subpackage's module runs that subpackage's face
    assert "otel_capture._correlation" in graph["otel_capture._telemetry.server_span"]


def test_the_import_graph_has_no_circle() -> None:
    assert _cycles(import_graph()) == []


def test_every_module_stands_on_a_floor_and_nothing_imports_a_later_floor() -> None:
    graph = import_graph()
    upward = {
        module: sorted(t for t in targets if layer_of(t) > layer_of(module))
        for module, targets in graph.items()
    }
    assert {m: t for m, t in upward.items() if t} == {}


def _outside_imports() -> Iterator[tuple[str, bool, str, list[str]]]:
    """Every import of a faced subpackage from outside it: (importer, under the strict rule, the module
    imported from, the names taken). ``import a.b.c`` takes no names."""
    files = _package_files()
    sources = [(m, p, True) for m, p in files.items()]
    for folder, strict in [(f, True) for f in OUTSIDE_STRICT] + [(f, False) for f in OUTSIDE_TESTING]:
        sources += [(_module_name(p), p, strict) for p in sorted((REPO / folder).rglob("*.py"))]
    for module, path, strict in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported = [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, path.name == "__init__.py", node)
                imported = [(base, [alias.name for alias in node.names])]
            else:
                continue
            for target, names in imported:
                package = _subpackage(target)
                if package is not None and package != _subpackage(module):
                    yield module, strict, target, names


def _face_breaches() -> set[tuple[str, str]]:
    files = _package_files()
    breaches = set()
    for module, strict, target, names in _outside_imports():
        package = _subpackage(target)
        assert package is not None
        if target == package:
            submodules = [n for n in names if f"{package}.{n}" in files]
            if strict and submodules:  # ``from otel_capture._store import writer``
                breaches |= {(module, f"{package}.{n}") for n in submodules}
            continue
        if strict:
            breaches.add((module, target))
        else:
            face = set(importlib.import_module(package).__all__)
            if set(names) & face:  # a name the face holds, taken from behind it
                breaches.add((module, target))
    return breaches


def test_outside_code_imports_each_subpackage_through_its_face() -> None:
    breaches = _face_breaches()
    assert sorted(breaches) == []


def test_each_face_exports_a_sorted_all_and_only_re_exports() -> None:
    def kind(name: str) -> tuple[int, str]:  # isort style, as ruff's RUF022 keeps it
        return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

    for name in FACED:
        face = importlib.import_module(f"otel_capture.{name}")
        assert face.__all__ == sorted(face.__all__, key=kind), name
        tree = ast.parse((PACKAGE / name / "__init__.py").read_text())
        kept = (ast.ImportFrom, ast.Expr, ast.Assign)  # imports, the docstring, __all__
        assert all(isinstance(node, kept) for node in tree.body), name
        assert all(getattr(face, n) is not None for n in face.__all__), name


def test_nothing_below_the_store_imports_the_store_or_anything_above_it() -> None:
    graph = import_graph()
    below = [m for m in graph if layer_of(m) < layer_of("otel_capture._store")]
    assert below and "otel_capture._correlation.ids" in below
    assert {
        m: sorted(t for t in graph[m] if layer_of(t) >= layer_of("otel_capture._store")) for m in below
    } == {m: [] for m in below}


def _folder(module: str) -> str:
    return LAYERS[layer_of(module)][0]


def print_graph() -> None:
    graph = import_graph()
    print("by folder, bottom first (each imports only its own floor and the floors printed before it):")
    for floor, (folder, _) in enumerate(LAYERS):
        members = sorted(m for m in graph if layer_of(m) == floor)
        targets = {_folder(t) for m in members for t in graph[m]} - {folder}
        order = [name for name, _ in LAYERS if name in targets]
        print(f"  {folder} ({len(members)} modules) -> {', '.join(order) or '-'}")
    print()
    for name, targets in sorted(graph.items()):
        print(name, "->", ", ".join(sorted(targets)) or "-")


if __name__ == "__main__":
    print_graph()
    sys.exit(0)
