"""End-to-end fixtures, each started once per session: the real tiny model server (llama.cpp + Gemma 3
270M) and a real Jaeger."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from jaeger_backend import Jaeger, JaegerUnavailable, jaeger_binary, running_jaeger

from otel_capture.demo.tiny_model import TinyModel, start_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Iterator[TinyModel]:
    with start_tiny_model() as model:
        yield model


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    """A real Jaeger v2 (built from its Go module on first use, then cached), started once per session.
    Where it cannot be built (no Go), the tests that use it skip and say why; under ``CI=true`` they fail
    instead: CI must run them."""
    try:
        binary = jaeger_binary()
    except JaegerUnavailable as exc:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(f"{exc}; CI=true: the Jaeger tests must run here", pytrace=False)
        pytest.skip(str(exc))
    with running_jaeger(tmp_path_factory.mktemp("jaeger"), binary) as backend:
        yield backend
