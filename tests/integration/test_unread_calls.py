"""A model call nothing reads (no records' sink, no span processor that sees its span, no metric reader) is
passed through unparsed (``otel_capture._capture.passthrough``): the app and the client see what they see
when the call is recorded, byte for byte; a sink, a span processor or a metric reader that comes later
gets the calls from then on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import metric_points, recorded_json, recorded_streams, sse_chunks

from otel_capture import CaptureSettings, CaptureStore, ModelCallCaptureMiddleware, read_model_call_records
from otel_capture import _attributes as A
from otel_capture._capture import SCOPE_RESPONSE_COMPLETE
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

# the request as a server hands it over: in pieces, the last one ending the body
REQUEST = [b'{"model": "gpt-4o", ', b'"messages": [{"role": "user", ', b'"content": "hi"}]}']
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Replay:
    """A chat model app that notes what it was handed and answers ``chunks`` (an event stream when
    ``stream``), noting after each chunk whether the capture told it the stream had ended."""

    def __init__(self, chunks: list[bytes], *, stream: bool = False) -> None:
        self.chunks = chunks
        self.stream = stream
        self.received: list[dict[str, Any]] = []
        self.scopes: list[dict[str, Any]] = []
        self.complete_after: list[list[bool]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        while True:
            message = await receive()
            self.received.append(message)
            if not message.get("more_body", False):
                break
        content_type = b"text/event-stream" if self.stream else b"application/json"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]}
        )
        complete: list[bool] = []
        for number, chunk in enumerate(self.chunks, 1):
            await send({"type": "http.response.body", "body": chunk, "more_body": number < len(self.chunks)})
            complete.append(bool(scope.get(SCOPE_RESPONSE_COMPLETE)))
        self.complete_after.append(complete)


def _call(app: Any, rollout_id: str = "r-1") -> list[dict[str, Any]]:
    """One chat call straight into the ASGI ``app``; the messages the client got."""
    path = f"/ng-rollout/{rollout_id}/v1/chat/completions"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"x-weight-version", b"w7"),
            (b"traceparent", TRACEPARENT),
        ],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 5000),
    }
    pieces = [
        {"type": "http.request", "body": body, "more_body": n < len(REQUEST)}
        for n, body in enumerate(REQUEST, 1)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pieces:
            return pieces.pop(0)
        await asyncio.Event().wait()  # the client stays until the response ends
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def _unread_app(upstream: Replay) -> ModelCallCaptureMiddleware:
    return ModelCallCaptureMiddleware(
        upstream, tracer_provider=TracerProvider(), meter_provider=MeterProvider(), settings=CaptureSettings()
    )


def _recording_app(upstream: Replay, folder: Path) -> tuple[ModelCallCaptureMiddleware, TracerProvider]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(folder)))
    app = ModelCallCaptureMiddleware(
        upstream, tracer_provider=provider, meter_provider=MeterProvider(), settings=CaptureSettings()
    )
    return app, provider


_STREAM = next(raw for name, dialect, raw in recorded_streams() if dialect == "chat")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_call_nothing_reads_reaches_the_app_and_the_client_as_when_it_is_recorded(
    tmp_path: Path, stream: bool
) -> None:
    chunks = sse_chunks(_STREAM) if stream else [recorded_json("chat")[:40], recorded_json("chat")[40:]]
    unread, recorded = Replay(chunks, stream=stream), Replay(chunks, stream=stream)
    got = _call(_unread_app(unread))
    app, provider = _recording_app(recorded, tmp_path / "calls")
    got_recorded = _call(app)
    provider.shutdown()

    assert got == got_recorded  # message for message, byte for byte
    assert b"".join(m.get("body", b"") for m in got) == b"".join(chunks)
    assert unread.received == recorded.received  # the request's pieces as the server handed them
    assert b"".join(m["body"] for m in unread.received) == b"".join(REQUEST)
    # the stream's end told to a relaying app at the same event (contract D29)
    assert unread.complete_after == recorded.complete_after
    assert unread.complete_after[0][-1] is stream
    (seen,), (seen_recorded,) = unread.scopes, recorded.scopes
    assert seen["root_path"] == seen_recorded["root_path"] == "/ng-rollout/r-1"
    names = [name for name, _ in seen["headers"]]
    assert b"x-weight-version" not in names and names.count(b"traceparent") == 1
    traceparent = dict(seen["headers"])[b"traceparent"]
    assert (
        traceparent[:36] == TRACEPARENT[:36] and traceparent != TRACEPARENT
    )  # the caller's trace, a new span
    assert len(read_model_call_records(CaptureStore(tmp_path / "calls"), "r-1")) == 1


def test_a_records_exporter_added_after_the_first_call_records_the_calls_from_then_on(tmp_path: Path) -> None:
    provider = TracerProvider()
    app = ModelCallCaptureMiddleware(
        Replay([recorded_json("chat")]),
        tracer_provider=provider,
        meter_provider=MeterProvider(),
        settings=CaptureSettings(),
    )
    _call(app, "r-before")
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(tmp_path / "calls")))
    _call(app, "r-after")
    provider.shutdown()
    store = CaptureStore(tmp_path / "calls")
    assert read_model_call_records(store, "r-before") == []
    (record,) = read_model_call_records(store, "r-after")
    assert record.tokens_out is not None and record.tokens_out > 0


def test_a_span_processor_added_later_gets_spans_with_the_calls_attributes() -> None:
    provider = TracerProvider()
    app = ModelCallCaptureMiddleware(
        Replay([recorded_json("chat")]),
        tracer_provider=provider,
        meter_provider=MeterProvider(),
        settings=CaptureSettings(),
    )
    _call(app, "r-before")
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    _call(app, "r-spans")
    (span,) = spans.get_finished_spans()
    assert span.name == "chat gpt-4o"
    assert span.attributes is not None
    assert span.attributes[A.ROLLOUT_ID] == "r-spans"
    assert span.attributes[A.GEN_AI_REQUEST_MODEL] == "gpt-4o"
    assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] > 0
    assert span.parent is not None and format(span.parent.span_id, "016x") == TRACEPARENT[36:52].decode()


def test_with_a_metric_reader_alone_the_calls_are_metered() -> None:
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    app = ModelCallCaptureMiddleware(
        Replay([recorded_json("chat")]), tracer_provider=TracerProvider(), meter_provider=meters
    )
    _call(app)
    (point,) = metric_points(reader, A.METRIC_SERVER_REQUEST_DURATION)
    assert point.count == 1 and point.attributes[A.GEN_AI_REQUEST_MODEL] == "gpt-4o"
    meters.shutdown()
