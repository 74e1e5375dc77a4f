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


def test_the_types_of_the_public_sink_parameter_and_the_writer_stats_are_exported() -> None:
    import dataclasses
    import inspect

    from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

    for name in ("CallSink", "FinishedCall", "LoopWaiter", "WriterStats", "CaptureError"):
        assert name in otel_capture.__all__
    sink = inspect.signature(otel_capture.ModelCallCaptureMiddleware).parameters["sink"]
    assert "CallSink" in str(sink.annotation)
    exporter = ModelCallJsonlExporter(settings=otel_capture.WriterSettings())  # no directory: logs only
    assert isinstance(exporter, otel_capture.CallSink)
    assert type(exporter.stats) is otel_capture.WriterStats
    fields = [f.name for f in dataclasses.fields(otel_capture.FinishedCall)]
    assert fields == ["rollout_id", "model_call_id", "line", "tokens_line", "waiter", "weight"]


def test_every_error_the_package_defines_sits_under_capture_error() -> None:
    import ast
    import importlib

    import otel_capture._errors

    defined = []
    for path in sorted((REPO / "otel_capture").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.ClassDef)
                and node.name.endswith("Error")
                and not node.name.startswith("_")
            ):
                defined.append(getattr(importlib.import_module(module), node.name))
    assert len(defined) >= 9
    assert [cls.__name__ for cls in defined if not issubclass(cls, otel_capture.CaptureError)] == []
    tree = otel_capture._errors.__doc__ or ""
    assert all(cls.__name__ in tree for cls in defined)  # drawn, every one, in the root's docstring
    exported = [getattr(otel_capture, n) for n in otel_capture.__all__]
    errors = [e for e in exported if isinstance(e, type) and issubclass(e, BaseException)]
    assert errors and all(issubclass(e, otel_capture.CaptureError) for e in errors)


def test_the_build_ships_every_subpackage_and_py_typed() -> None:
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    core = {
        ".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "otel_capture").rglob("__init__.py")
    }
    assert core <= set(setuptools["packages"])  # an unlisted subpackage is missing from the wheel
    assert "py.typed" in setuptools["package-data"]["otel_capture"]
    assert (REPO / "otel_capture" / "py.typed").is_file()


def test_the_wheel_the_docs_install_is_the_one_pip_wheel_builds() -> None:
    """README and docs/vllm.md name the wheel file; tests/integration/test_install.py builds and installs it."""
    from otel_capture._version import __version__

    wheel = f"dist/otel_capture-{__version__}-py3-none-any.whl[auto]"
    for doc in ("README.md", "docs/vllm.md"):
        text = (REPO / doc).read_text()
        assert wheel in text, doc
        assert "pip wheel --no-deps -w dist /path/to/otel-capture" in text, doc
        assert "pip install '/path/to/otel-capture[auto]'" in text, doc


def test_the_readme_says_what_the_full_test_command_starts_and_the_quick_run() -> None:
    text = (REPO / "README.md").read_text()
    intro = text.split("## What it does", 1)[0]
    assert "python -m pytest tests/unit" in intro
    for piece in ("Jaeger", "Phoenix", "GlusterFS", "vLLM", "LiteLLM", "verifiers", "inspect-ai", "14 min"):
        assert piece in intro, piece
