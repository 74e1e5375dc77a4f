"""The middleware finds its record sink once, in its tracer provider, whatever processor wraps it."""

from __future__ import annotations

from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_capture import ModelCallCaptureMiddleware
from otel_capture._capture import CallSink
from otel_capture._capture.sink import find_sink
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter


async def _app(scope: object, receive: object, send: object) -> None:
    pass


def test_the_jsonl_exporter_is_found_behind_either_sdk_processor(tmp_path: Path) -> None:
    for processor in (SimpleSpanProcessor, BatchSpanProcessor):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))  # not a sink: skipped
        exporter = ModelCallJsonlExporter(tmp_path / processor.__name__)
        provider.add_span_processor(processor(exporter))
        assert isinstance(exporter, CallSink)
        assert find_sink(provider) is exporter
        assert ModelCallCaptureMiddleware(_app, tracer_provider=provider).sink is exporter
        provider.shutdown()


def test_without_an_exporter_there_is_no_sink_and_spans_only() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    assert find_sink(provider) is None
    assert find_sink(trace.NoOpTracerProvider()) is None
    assert ModelCallCaptureMiddleware(_app, tracer_provider=provider).sink is None


def test_a_sink_passed_in_code_wins(tmp_path: Path) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(tmp_path / "a")))
    mine = ModelCallJsonlExporter(tmp_path / "b")
    assert ModelCallCaptureMiddleware(_app, tracer_provider=provider, sink=mine).sink is mine
    provider.shutdown()
    mine.shutdown()
