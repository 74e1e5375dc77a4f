"""The distributions pyproject declares are the ones the package imports: every third-party module
imported under otel_capture/ and exporters/ comes from a declared distribution (core, or ``instruments``
for what the instrumentor imports only when it instruments), and every core dependency is imported."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match is not None
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _imported_modules() -> set[str]:
    """Every third-party module imported, as ``a.b`` (``from a import b`` names ``a.b`` too: ``b`` may be
    a module of its own, as in ``from opentelemetry import trace``)."""
    found: set[str] = set()
    for path in [*(REPO / "otel_capture").rglob("*.py"), *(REPO / "exporters").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {
        n for n in found if n.split(".")[0] not in (*sys.stdlib_module_names, "otel_capture", "__future__")
    }


def _distribution_of() -> dict[str, str]:
    """Each installed module path (``opentelemetry/util/http``) to the distribution that ships it."""
    owner: dict[str, str] = {}
    for dist in distributions():
        name = _name(dist.metadata["Name"])
        for file in dist.files or ():
            parts = Path(str(file)).with_suffix("").parts
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and not str(file).endswith((".pyc", ".dist-info")):
                owner.setdefault("/".join(parts), name)
    return owner


def _distributions_imported() -> dict[str, str]:
    owner = _distribution_of()
    result: dict[str, str] = {}
    for module in sorted(_imported_modules()):
        parts = module.split(".")
        for cut in range(len(parts), 0, -1):
            found = owner.get("/".join(parts[:cut]))
            if found is not None:
                result[module] = found
                break
        else:
            raise AssertionError(f"{module} is imported but no installed distribution ships it")
    return result


def test_what_is_imported_is_declared_and_what_is_declared_is_imported() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    # what the instrumentor instruments, imported only then (fastapi only when it is installed)
    lazy = {_name(r) for r in project["optional-dependencies"]["instruments"]} | {"fastapi"}
    imported = _distributions_imported()
    assert {m: d for m, d in imported.items() if d not in core | lazy} == {}
    assert sorted(core - set(imported.values())) == []
    assert "httpx" not in core and "opentelemetry-instrumentation-asgi" not in core


def test_the_package_imports_without_what_it_no_longer_declares() -> None:
    """httpx (the demo's and the tests' client) and contrib's ASGI instrumentation are not core: the package,
    its CLI, its exporter and its proxy import with both blocked."""
    import subprocess

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'httpx' or name.startswith('opentelemetry.instrumentation.asgi'):\n"
        "            raise ImportError('not installed: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import otel_capture, otel_capture._cli.main, otel_capture._proxy.app\n"
        "import otel_capture.exporters.model_call_jsonl\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'httpx'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
