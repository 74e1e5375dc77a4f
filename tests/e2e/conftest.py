"""End-to-end fixtures: the real tiny model server (llama.cpp + Gemma 3 270M), started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from otel_capture.demo.tiny_model import TinyModel, start_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Iterator[TinyModel]:
    with start_tiny_model() as model:
        yield model
