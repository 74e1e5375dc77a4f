"""With the records' exporter alone on the tracer provider, no span is built, only its context: the record
still continues the caller's trace, the app still sees the call's context, the metrics still have their
attributes, and a processor added later brings the spans back at once (``otel_capture._telemetry.spans``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry import baggage, trace
from opentelemetry.instrumentation.propagators import (
    TraceResponsePropagator,
    get_global_response_propagator,
    set_global_response_propagator,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from support import metric_points, read_body, recorded_json, serve, serve_lifespan

from otel_capture import CaptureSettings, CaptureStore, ModelCallCaptureMiddleware, read_model_call_records
from otel_capture import _attributes as A
from otel_capture._telemetry import LeanServerSpanMiddleware, SpanGate
from otel_capture._telemetry.provider import SinkOnlyProcessor
from otel_capture._telemetry.spans import ignores_spans
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


class ContextProbe:
    """A chat model app that notes the span context current while it serves each call."""

    def __init__(self) -> None:
        self.seen: list[trace.SpanContext] = []
        self.recording: list[bool] = []  # whether a span was built for the call (its current span records)
        self.baggage: list[dict[str, object]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        await read_body(receive)
        current = trace.get_current_span()
        self.seen.append(current.get_span_context())
        self.recording.append(current.is_recording())
        self.baggage.append(dict(baggage.get_all()))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": recorded_json("chat")})


@pytest.fixture
def records_only(tmp_path: Path) -> Iterator[tuple[TracerProvider, CaptureStore]]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(tmp_path / "calls")))
    yield provider, CaptureStore(tmp_path / "calls")
    provider.shutdown()


def _chat(url: str, rollout_id: str, headers: dict[str, str] | None = None) -> httpx.Response:
    response = httpx.post(
        f"{url}/ng-rollout/{rollout_id}/v1/chat/completions",
        json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
        headers=headers or {},
    )
    response.raise_for_status()
    return response


def test_with_the_records_exporter_alone_the_record_continues_the_callers_trace_and_the_app_sees_it(
    records_only: tuple[TracerProvider, CaptureStore],
) -> None:
    provider, store = records_only
    probe = ContextProbe()
    app = ModelCallCaptureMiddleware(probe, tracer_provider=provider, settings=CaptureSettings())
    assert SpanGate(provider).unseen()
    with serve(app) as url:
        _chat(url, "r-traced", {"traceparent": TRACEPARENT})
        _chat(url, "r-fresh")

    traced, fresh = (
        read_model_call_records(store, "r-traced")[0],
        read_model_call_records(store, "r-fresh")[0],
    )
    assert traced.trace_id == TRACE_ID  # the caller's trace, continued
    assert traced.span_id not in (None, PARENT_SPAN_ID, "0" * 16)
    assert fresh.trace_id not in (None, TRACE_ID, "0" * 32)  # a trace of its own
    # what the app saw current is the call's context: its outgoing calls carry it on in traceparent
    assert [(format(c.trace_id, "032x"), format(c.span_id, "016x")) for c in probe.seen] == [
        (traced.trace_id, traced.span_id),
        (fresh.trace_id, fresh.span_id),
    ]
    assert all(c.trace_flags.sampled and not c.is_remote for c in probe.seen)
    assert probe.recording == [False, False]  # no span was built, only its context


def test_the_providers_sampler_still_decides_the_flags_the_app_passes_on(tmp_path: Path) -> None:
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(tmp_path / "calls")))
    probe = ContextProbe()
    app = ModelCallCaptureMiddleware(probe, tracer_provider=provider, settings=CaptureSettings())
    with serve(app) as url:
        _chat(url, "r-off")
        _chat(url, "r-sampled-parent", {"traceparent": TRACEPARENT})
    provider.shutdown()
    assert [c.trace_flags.sampled for c in probe.seen] == [False, True]
    assert len(read_model_call_records(CaptureStore(tmp_path / "calls"), "r-off")) == 1  # recorded anyway


def test_a_processor_added_later_brings_the_spans_back_with_the_records_ids(
    records_only: tuple[TracerProvider, CaptureStore],
) -> None:
    provider, store = records_only
    probe = ContextProbe()
    app = ModelCallCaptureMiddleware(probe, tracer_provider=provider, settings=CaptureSettings())
    with serve(app) as url:
        _chat(url, "r-before")
        spans = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        _chat(url, "r-after", {"traceparent": TRACEPARENT})

    (span,) = spans.get_finished_spans()  # the call before the processor was added built none
    assert probe.recording == [False, True]
    (record,) = read_model_call_records(store, "r-after")
    assert (format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")) == (
        record.trace_id,
        record.span_id,
    )
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    assert span.name == "chat gpt-4o"
    assert span.attributes is not None
    assert span.attributes[A.ROLLOUT_ID] == "r-after"
    assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == record.tokens_out


def test_without_spans_the_metrics_keep_their_attributes(
    records_only: tuple[TracerProvider, CaptureStore],
) -> None:
    provider, store = records_only
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    app = ModelCallCaptureMiddleware(
        ContextProbe(), tracer_provider=provider, meter_provider=meters, settings=CaptureSettings()
    )
    with serve(app) as url:
        _chat(url, "r-metrics")
    points = metric_points(reader, A.METRIC_SERVER_REQUEST_DURATION)
    assert len(points) == 1 and points[0].count == 1
    assert points[0].attributes[A.GEN_AI_REQUEST_MODEL] == "gpt-4o"
    assert points[0].attributes[A.GEN_AI_RESPONSE_MODEL] == "gpt-4o-2024-08-06"
    assert len(read_model_call_records(store, "r-metrics")) == 1
    meters.shutdown()


def test_behind_the_lean_server_span_the_call_is_a_child_of_the_servers_context(
    records_only: tuple[TracerProvider, CaptureStore],
) -> None:
    """The zero-code stack with ``OTEL_TRACES_EXPORTER=model_call_jsonl``: neither span is built."""
    provider, store = records_only
    probe = ContextProbe()
    capture = ModelCallCaptureMiddleware(probe, tracer_provider=provider, settings=CaptureSettings())
    app = LeanServerSpanMiddleware(capture, tracer_provider=provider)
    with serve(app) as url:
        response = _chat(url, "r-zero-code", {"traceparent": TRACEPARENT})
    (record,) = read_model_call_records(store, "r-zero-code")
    assert record.trace_id == TRACE_ID
    assert [format(c.span_id, "016x") for c in probe.seen] == [record.span_id]
    assert probe.recording == [False]
    assert response.json()["id"]  # the answer went through untouched


@pytest.mark.parametrize(
    ("make", "ignored"),
    [
        (lambda e: SimpleSpanProcessor(e), True),
        (lambda e: BatchSpanProcessor(e), True),
        (lambda e: SinkOnlyProcessor(e), True),
        (lambda e: type("Custom", (SimpleSpanProcessor,), {})(e), False),  # a subclass may do anything
    ],
    ids=["simple", "batch", "sink-only", "subclass"],
)
def test_only_the_sdks_own_processors_around_the_records_exporter_ignore_spans(
    tmp_path: Path, make: Any, ignored: bool
) -> None:
    exporter = ModelCallJsonlExporter(tmp_path / "calls")
    processor = make(exporter)
    assert ignores_spans(processor) is ignored
    assert ignores_spans(SimpleSpanProcessor(InMemorySpanExporter())) is False
    processor.shutdown()


def test_a_provider_that_is_not_the_sdks_decides_for_itself() -> None:
    assert SpanGate(trace.NoOpTracerProvider()).unseen() is False
    assert SpanGate(TracerProvider()).unseen() is True  # no processor at all: nobody sees a span


def test_the_app_gets_the_callers_baggage_with_the_calls_context(
    records_only: tuple[TracerProvider, CaptureStore],
) -> None:
    provider, _ = records_only
    probe = ContextProbe()
    app = ModelCallCaptureMiddleware(probe, tracer_provider=provider, settings=CaptureSettings())
    with serve(app) as url:
        _chat(url, "r-bag", {"traceparent": TRACEPARENT, "baggage": "team=rl,stage=eval"})
    assert probe.baggage == [{"team": "rl", "stage": "eval"}]
    assert format(probe.seen[0].trace_id, "032x") == TRACE_ID


def test_when_nobody_sees_the_server_span_any_request_runs_in_the_callers_context(
    records_only: tuple[TracerProvider, CaptureStore],
) -> None:
    """No span of ours between: the app's own outgoing calls still continue the caller's trace."""
    provider, store = records_only
    probe = ContextProbe()
    app = LeanServerSpanMiddleware(
        ModelCallCaptureMiddleware(probe, tracer_provider=provider, settings=CaptureSettings()),
        tracer_provider=provider,
    )
    with serve(app) as url:
        health = httpx.get(f"{url}/health", headers={"traceparent": TRACEPARENT, "baggage": "team=rl"})
        _chat(url, "r-child", {"traceparent": TRACEPARENT})
        httpx.get(f"{url}/health")
    assert health.status_code == 200
    caller, call, untraced = probe.seen
    assert (format(caller.trace_id, "032x"), format(caller.span_id, "016x")) == (TRACE_ID, PARENT_SPAN_ID)
    assert caller.is_remote and probe.baggage[0] == {"team": "rl"}
    (record,) = read_model_call_records(store, "r-child")
    assert (format(call.trace_id, "032x"), format(call.span_id, "016x")) == (TRACE_ID, record.span_id)
    assert not untraced.is_valid  # no caller context, no span: nothing made up


def test_a_response_propagator_keeps_the_server_span_whose_context_it_sends_back(
    records_only: tuple[TracerProvider, CaptureStore],
) -> None:
    provider, _ = records_only
    probe = ContextProbe()
    app = LeanServerSpanMiddleware(probe, tracer_provider=provider)
    previous = get_global_response_propagator()  # type: ignore[no-untyped-call]
    set_global_response_propagator(TraceResponsePropagator())  # type: ignore[no-untyped-call]
    try:
        with serve(app) as url:
            response = httpx.get(f"{url}/health", headers={"traceparent": TRACEPARENT})
    finally:
        set_global_response_propagator(previous)  # type: ignore[no-untyped-call]
    (seen,) = probe.seen
    assert format(seen.trace_id, "032x") == TRACE_ID and format(seen.span_id, "016x") != PARENT_SPAN_ID
    assert response.headers["traceresponse"] == f"00-{TRACE_ID}-{format(seen.span_id, '016x')}-01"
