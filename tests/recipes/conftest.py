"""Fixtures of the recipe tests: each recipe's tool in its own cached venv, the real tiny model, and the
capture proxy in front of it, as a user starts it (``otel-capture proxy``)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import start_cli_proxy
from tool_venvs import CaptureProxy, ToolUnavailable, tool_venv

from otel_capture import CaptureStore
from otel_capture.demo.tiny_model import TinyModel, start_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Iterator[TinyModel]:
    with start_tiny_model() as model:
        yield model


@pytest.fixture(scope="session")
def tool() -> Callable[[str, list[str]], Path]:
    """``tool(name, requirements)``: the tool's venv. Where it cannot be installed the test skips and says
    why; under ``CI=true`` it fails instead: CI must run the recipes."""

    def venv(name: str, requirements: list[str]) -> Path:
        try:
            return tool_venv(name, requirements)
        except ToolUnavailable as exc:
            if os.environ.get("CI", "").lower() in ("true", "1"):
                pytest.fail(f"{exc}; CI=true: the recipe tests must run here", pytrace=False)
            pytest.skip(str(exc))

    return venv


@pytest.fixture
def start_capture_proxy(tiny_model: TinyModel, tmp_path: Path) -> Iterator[Callable[..., CaptureProxy]]:
    """``start_capture_proxy(**env)``: ``otel-capture proxy --upstream <tiny model> --capture-dir <tmp>``,
    as a user starts it, with ``env`` added to its environment; stopped with SIGTERM at the test's end."""
    started: list[subprocess.Popen[str]] = []

    def start(**env: str) -> CaptureProxy:
        capture_dir = tmp_path / f"calls-{len(started)}"
        process, url = start_cli_proxy(tiny_model.base_url, "--capture-dir", str(capture_dir), env=env)
        started.append(process)
        return CaptureProxy(url, CaptureStore(capture_dir))

    yield start
    for process in started:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
