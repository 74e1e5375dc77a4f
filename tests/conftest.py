"""Shared fixtures: a tracer provider with both the in-memory exporter and the real JSONL exporter, the
replaying model server, and every SDK client a test makes closed when it ends."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import ReplayModelServer, Telemetry

from otel_capture import CaptureStore
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter


@pytest.fixture(autouse=True)
def close_sdk_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test that makes ``openai.OpenAI(...)`` or ``anthropic.Anthropic(...)`` without ``with`` leaves its
    connection pool to the garbage collector, whose ``ResourceWarning`` (an error here) then fails whichever
    later test the collection happens in. Each client a test makes is closed when the test ends."""
    made: weakref.WeakSet[Any] = weakref.WeakSet()
    for cls in (openai.OpenAI, anthropic.Anthropic):
        original = cls.__init__

        def tracked(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            __original(self, *args, **kwargs)
            made.add(self)

        monkeypatch.setattr(cls, "__init__", tracked)
    yield
    for client in list(made):
        client.close()


@pytest.fixture(autouse=True, scope="session")
def local_reserve_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The node-local loss reserves writers make when a capture directory cannot take a loss (default under
    ``~/.local/state``) go to the session's temporary directory, never the home directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_CAPTURE_LOCAL_RESERVE_DIR", str(tmp_path_factory.mktemp("local-reserve")))
        yield


@pytest.fixture
def telemetry(tmp_path: Path) -> Iterator[Telemetry]:
    capture_dir = tmp_path / "calls"
    provider = TracerProvider()
    spans = InMemorySpanExporter()
    jsonl = ModelCallJsonlExporter(capture_dir)
    provider.add_span_processor(SimpleSpanProcessor(spans))
    provider.add_span_processor(SimpleSpanProcessor(jsonl))
    yield Telemetry(provider, spans, jsonl, CaptureStore(capture_dir))
    provider.shutdown()


@pytest.fixture
def replay_server() -> ReplayModelServer:
    return ReplayModelServer()
