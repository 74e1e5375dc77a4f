"""Shared fixtures: a tracer provider with both the in-memory exporter and the real JSONL exporter, and
the replaying model server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import ReplayModelServer, Telemetry

from otel_capture import CaptureStore
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter


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
