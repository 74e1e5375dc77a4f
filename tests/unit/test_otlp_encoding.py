"""The capture's OTLP encoder writes what the SDK's encoder writes, byte for byte, for every span shape the
SDK makes; what it does not write goes to the SDK's encoder; and it is put behind the SDK's own OTLP
exporters only, keeping their configuration."""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from otel_capture import CaptureSettings, ModelCallCaptureMiddleware
from otel_capture._telemetry import otlp


def _provider(
    resource: Resource | None = None, limits: SpanLimits | None = None
) -> tuple[TracerProvider, Any]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=resource or Resource.create({"service.name": "t"}), span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider, memory


def _assert_same_as_sdk(spans: Sequence[ReadableSpan]) -> None:
    ours = otlp.encode_spans(spans)
    theirs = sdk_encode_spans(spans)
    assert ExportTraceServiceRequest.FromString(ours) == theirs
    assert ours == theirs.SerializeToString()


def _capture_spans(status: int = 200) -> tuple[ReadableSpan, ...]:
    provider, memory = _provider()
    body = (
        b'{"id":"chatcmpl-1","object":"chat.completion","model":"m","system_fingerprint":"fp",'
        b'"choices":[{"index":0,"message":{"role":"assistant","content":"\xc3\xa9t\xc3\xa9"},'
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}'
    )

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body", False):
            pass
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    middleware = ModelCallCaptureMiddleware(
        app, tracer_provider=provider, settings=CaptureSettings.from_environ({})
    )
    request = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.5,"max_tokens":9}'

    async def call() -> None:  # a real ASGI client: httpx builds the scope and the messages
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            await client.post(
                "/ng-rollout/r-1/v1/chat/completions",
                content=request,
                headers={"content-type": "application/json"},
            )

    asyncio.run(call())
    spans = memory.get_finished_spans()
    assert spans and spans[0].attributes
    return spans


def test_a_model_call_span_is_encoded_byte_for_byte_as_the_sdk_does() -> None:
    spans = _capture_spans() + _capture_spans(status=500)
    assert len(spans[0].attributes or {}) > 10
    _assert_same_as_sdk(spans)
    _assert_same_as_sdk(spans * 300)  # lengths past one and two varint bytes


def test_every_span_field_and_attribute_type_is_encoded_as_the_sdk_does() -> None:
    provider, memory = _provider(limits=SpanLimits(max_span_attributes=40, max_event_attributes=1))
    other_provider, other_memory = _provider(
        Resource.create({"service.name": "other", "n": 3}, schema_url="https://opentelemetry.io/schemas/1.2")
    )
    plain = provider.get_tracer("plain")
    versioned = provider.get_tracer(
        "versioned", "1.0", schema_url="https://opentelemetry.io/schemas/1.1", attributes={"scope.flag": True}
    )
    remote = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "v1"), ("other", "x")]),
    )
    local = SpanContext(0x1, 0x2, is_remote=False)
    values: dict[str, Any] = {
        "str": "plain",
        "empty": "",
        "unicode": "été ✓ 𝄞",
        "long": "x" * 200,
        "longer": "y" * 20_000,
        "int": 7,
        "zero": 0,
        "negative": -5,
        "big": 2**62,
        "most negative": -(2**63),
        "float": 0.25,
        "float zero": 0.0,
        "negative zero": -0.0,
        "true": True,
        "false": False,
        "bytes": b"\x00\x01",
        "strings": ["a", "b"],
        "ints": (1, -2, 3),
        "floats": [0.5, 1.5],
        "bools": [True, False],
        "empty list": [],
    }
    parent = trace.set_span_in_context(NonRecordingSpan(remote))
    with plain.start_as_current_span("root", kind=SpanKind.SERVER, attributes=values) as root:
        root.add_event("event", {"a": 1, "b": "dropped by the limit"}, timestamp=123)
        root.add_event("bare")
        root.set_status(Status(StatusCode.ERROR, "it failed"))
        with versioned.start_as_current_span("child", kind=SpanKind.CLIENT) as child:
            child.set_status(Status(StatusCode.OK))
    for kind in (SpanKind.PRODUCER, SpanKind.CONSUMER, SpanKind.INTERNAL):
        span = plain.start_span(
            f"remote parent {kind.name}",
            context=parent,
            kind=kind,
            links=[Link(remote, {"link": "attr"}), Link(local)],
        )
        span.end(end_time=span.start_time)  # type: ignore[attr-defined]  # the SDK's span
    other_provider.get_tracer("other").start_span("", attributes={"n": 1}).end()
    spans = memory.get_finished_spans()
    mixed = [spans[0], other_memory.get_finished_spans()[0], *spans[1:], spans[0]]
    _assert_same_as_sdk(mixed)
    _assert_same_as_sdk([])


def test_values_python_calls_equal_are_encoded_each_as_itself_batch_after_batch() -> None:
    """The encoder keeps repeated key-value pairs encoded: values Python holds equal (``True == 1 == 1.0``,
    ``0.0 == -0.0``) under one key, in span, event and link attributes, still come out each as the SDK
    writes it, in the first batch and in every later one (from the kept pairs), and after the kept pairs
    overflow their bound and start again."""
    provider, memory = _provider()
    tracer = provider.get_tracer("t")
    link = SpanContext(0x1, 0x2, is_remote=False)
    equal_values: list[Any] = [True, 1, 1.0, False, 0, 0.0, -0.0, "1", "x" * 200, 2.5, -2.5]
    for value in equal_values:
        span = tracer.start_span("s", attributes={"v": value}, links=[Link(link, {"v": value})])
        span.add_event("e", {"v": value}, timestamp=5)
        span.end()
    spans = memory.get_finished_spans()
    for batch in (spans, spans[::-1], spans, spans[3:]):
        _assert_same_as_sdk(batch)
    for n in range(otlp._KEY_CACHE_MAX + 10):  # distinct pairs past the bound
        tracer.start_span("n", attributes={"n": n, "name": f"call-{n}", "v": equal_values[n % 11]}).end()
    many = list(memory.get_finished_spans()[len(spans) :])
    _assert_same_as_sdk(many)
    _assert_same_as_sdk(many[:50] + list(spans))


def test_equal_resources_of_distinct_objects_share_one_group_as_in_the_sdk() -> None:
    first, first_memory = _provider(Resource.create({"service.name": "same"}))
    second, second_memory = _provider(Resource.create({"service.name": "same"}))
    for provider in (first, second, first):
        provider.get_tracer("t").start_span("s").end()
    spans = [*first_memory.get_finished_spans(), *second_memory.get_finished_spans()]
    spans = [spans[0], spans[2], spans[1]]
    assert spans[0].resource is not spans[1].resource
    _assert_same_as_sdk(spans)


def test_what_only_the_sdk_encodes_goes_to_the_sdk_whole() -> None:
    provider, memory = _provider()
    provider.get_tracer("t").start_span("s", attributes={"map": {"k": "v"}, "n": 1}).end()  # type: ignore[dict-item]  # the SDK takes mappings
    spans = memory.get_finished_spans() + _capture_spans()
    with pytest.raises(otlp._Unsupported):
        otlp.encode_spans(spans)
    assert otlp._own_or_sdk(sdk_encode_spans)(spans) == sdk_encode_spans(spans)  # the SDK's own message
    translate = otlp._grpc_translate(sdk_encode_spans, ExportTraceServiceRequest)
    assert translate(None, spans) == sdk_encode_spans(spans)
    assert translate(None, spans[1:]) == sdk_encode_spans(spans[1:])  # ours, parsed


def test_a_batch_the_encoder_fails_on_goes_to_the_sdk_and_is_told_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    spans = _capture_spans()

    class Odd:
        def __getattr__(self, name: str) -> Any:
            return getattr(spans[0], name)

        @property
        def attributes(self) -> Any:
            return types.MappingProxyType(OddAttributes(spans[0].attributes or {}))

    class OddAttributes(dict):  # type: ignore[type-arg]  # a mapping whose copy() fails
        def copy(self) -> Any:
            raise RuntimeError("no copy")

    odd = [Odd(), *spans]
    otlp._told.clear()
    encode = otlp._own_or_sdk(sdk_encode_spans)
    with caplog.at_level(logging.WARNING, logger="otel_capture._telemetry.otlp"):
        assert encode(odd) == sdk_encode_spans(odd)
        assert encode(odd) == sdk_encode_spans(odd)
    assert caplog.text.count("the SDK's encodes instead") == 1


def test_the_sdk_otlp_exporters_a_capture_sees_encode_with_the_capture_and_keep_their_settings() -> None:
    http = HttpExporter(endpoint="http://127.0.0.1:9/v1/traces", headers={"x-key": "k"}, timeout=3)
    grpc = GrpcExporter(endpoint="http://127.0.0.1:9", insecure=True)

    class Own(HttpExporter):
        pass

    users = Own(endpoint="http://127.0.0.1:9/v1/traces")
    settings = dict(vars(http))
    provider = TracerProvider()
    for exporter in (http, grpc, users):
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    try:
        ModelCallCaptureMiddleware(lambda *a: None, tracer_provider=provider)._spans.unseen()
        assert isinstance(http, HttpExporter) and type(http) is not HttpExporter
        assert isinstance(grpc, GrpcExporter) and type(grpc) is not GrpcExporter
        assert type(users) is Own  # a subclass someone wrote is theirs
        assert vars(http) == settings  # the same object: endpoint, headers, timeout, session
        spans = _capture_spans()
        assert grpc._translate_data(spans) == sdk_encode_spans(spans)
        assert otlp.use_own_encoder(http) and not otlp.use_own_encoder(object())
    finally:
        provider.shutdown()


def test_the_http_exporter_sends_the_capture_encoding_to_its_endpoint() -> None:
    import http.server
    import threading

    bodies: list[bytes] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["content-length"])))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        exporter = HttpExporter(endpoint=f"http://127.0.0.1:{server.server_port}/v1/traces")
        assert otlp.use_own_encoder(exporter)
        spans = _capture_spans()
        assert exporter.export(spans).name == "SUCCESS"
        assert bodies == [sdk_encode_spans(spans).SerializeToString()]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
