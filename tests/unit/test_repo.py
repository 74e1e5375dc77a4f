"""The README's promises about the repository itself."""

from __future__ import annotations

from pathlib import Path

import pytest

import otel_capture

REPO = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    demo, tests = _readme_commands()[:2]
    assert "otel-capture demo" in demo
    assert "pytest" in tests
    assert tests in (REPO / ".ci" / "run").read_text()


def test_public_api_is_sorted_and_importable() -> None:
    # isort style, as ruff's RUF022 keeps it: CONSTANTS, then Classes, then functions
    def kind(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

    assert otel_capture.__all__ == sorted(otel_capture.__all__, key=kind)
    for name in otel_capture.__all__:
        assert getattr(otel_capture, name) is not None


def test_the_build_ships_every_subpackage_and_py_typed() -> None:
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    core = {
        ".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "otel_capture").rglob("__init__.py")
    }
    assert core <= set(setuptools["packages"])  # an unlisted subpackage is missing from the wheel
    assert "py.typed" in setuptools["package-data"]["otel_capture"]
    assert (REPO / "otel_capture" / "py.typed").is_file()
