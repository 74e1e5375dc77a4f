"""End-to-end fixtures: the real tiny model server (llama.cpp + Gemma 3 270M) and a real Jaeger, each
started once per session, and per test the capture proxy in front of the tiny model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from jaeger_backend import Jaeger, JaegerUnavailable, jaeger_binary, running_jaeger

from otel_capture import CaptureStore, start_proxy
from otel_capture.demo.tiny_model import TinyModel, start_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Iterator[TinyModel]:
    with start_tiny_model() as model:
        yield model


@pytest.fixture
def proxied(tiny_model: TinyModel, tmp_path: Path) -> Iterator[tuple[str, CaptureStore]]:
    """``start_proxy`` in front of the tiny model, writing to the test's own capture directory: the proxy's
    URL and the store that reads that directory."""
    store = CaptureStore(tmp_path / "calls")
    with start_proxy(tiny_model.base_url, str(store.root)) as proxy:
        yield proxy.url, store


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
