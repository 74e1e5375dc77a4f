"""The HTTP server span zero-code mode adds (``LeanServerSpanMiddleware``), as a tracing backend and a
metrics backend see it, through a real uvicorn: the stable HTTP semantic conventions and nothing else,
the caller's trace and baggage continued, errors, excluded URLs, its one metric, header capture with
credentials redacted, and the response propagator. See otel_capture/_telemetry/server_span.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import baggage
from opentelemetry.instrumentation.propagators import TraceResponsePropagator, set_global_response_propagator
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support import (
    RECORDED,
    ReplayModelServer,
    Reply,
    Telemetry,
    metric_points,
    recorded_json,
    serve,
    sse_chunks,
)

from otel_capture import CaptureSettings, ModelCallCaptureMiddleware, ModelCallInstrumentor
from otel_capture import _attributes as A
from otel_capture._telemetry import LeanServerSpanMiddleware

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CHAT_SSE = (RECORDED / "openai-python/chat_completions_sse/parse_nothing.e2aad469b71d.sse").read_bytes()


@pytest.fixture
def instrumented(telemetry: Telemetry) -> Iterator[None]:
    instrumentor = ModelCallInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.provider, settings=CaptureSettings())
    yield
    instrumentor.uninstrument()


async def _chat(request: Request) -> JSONResponse:
    await request.body()
    return JSONResponse(json.loads(recorded_json("chat")))


def _server_span(telemetry: Telemetry) -> Any:
    (server,) = [s for s in telemetry.spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    return server


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_model_call_has_one_server_span_with_the_stable_http_attributes_only(
    instrumented: None, telemetry: Telemetry
) -> None:
    app = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])])
    with serve(app) as url:
        response = httpx.post(
            f"{url}/ng-rollout/s-1/v1/chat/completions?api_key=sk-leak-check&api-version=2024-10-21",
            json={"model": "gpt-4o", "messages": []},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "user-agent": "agent/1.0"},
        )
    assert response.status_code == 200
    server = _server_span(telemetry)
    (model,) = [s for s in telemetry.spans.get_finished_spans() if s.name == "chat gpt-4o"]
    assert server.name == "POST /v1/chat/completions"  # the route, never the rollout
    assert dict(server.attributes) == {
        A.HTTP_REQUEST_METHOD: "POST",
        A.URL_SCHEME: "http",
        A.URL_PATH: "/ng-rollout/s-1/v1/chat/completions",
        A.URL_QUERY: "api_key=REDACTED&api-version=REDACTED",  # which parameters, never their values
        A.HTTP_ROUTE: "/v1/chat/completions",
        A.NETWORK_PROTOCOL_VERSION: "1.1",
        A.SERVER_ADDRESS: "127.0.0.1",
        A.SERVER_PORT: _port(url),
        A.CLIENT_ADDRESS: "127.0.0.1",
        A.USER_AGENT_ORIGINAL: "agent/1.0",
        A.HTTP_RESPONSE_STATUS_CODE: 200,
    }
    assert server.status.status_code == StatusCode.UNSET
    # the caller's trace continues: caller -> HTTP server span -> model-call span
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT_ID
    assert model.parent is not None and model.parent.span_id == server.context.span_id
    assert server.start_time <= model.start_time and model.end_time <= server.end_time


def test_the_app_sees_the_callers_baggage_and_a_503_marks_the_span_failed(telemetry: Telemetry) -> None:
    seen: list[object] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.append(baggage.get_baggage("tenant"))
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"overloaded"})

    with serve(LeanServerSpanMiddleware(app, tracer_provider=telemetry.provider)) as url:
        assert httpx.get(f"{url}/v1/models", headers={"baggage": "tenant=t-7"}).status_code == 503
    assert seen == ["t-7"]
    server = _server_span(telemetry)
    assert server.name == "GET /v1/models" and A.HTTP_ROUTE not in server.attributes
    assert server.attributes[A.HTTP_RESPONSE_STATUS_CODE] == 503 and server.attributes[A.ERROR_TYPE] == "503"
    assert server.status.status_code == StatusCode.ERROR


def test_an_app_that_raises_before_answering_has_its_exception_on_the_span(telemetry: Telemetry) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            raise RuntimeError("the model crashed")

    with serve(LeanServerSpanMiddleware(app, tracer_provider=telemetry.provider)) as url:
        assert httpx.post(f"{url}/v1/chat/completions", json={}).status_code == 500  # uvicorn's answer
    server = _server_span(telemetry)
    assert server.attributes[A.ERROR_TYPE] == "RuntimeError"
    assert server.status.status_code == StatusCode.ERROR and "the model crashed" in (
        server.status.description or ""
    )
    assert [e.name for e in server.events] == ["exception"]


def test_excluded_urls_have_no_span(replay_server: ReplayModelServer, telemetry: Telemetry) -> None:
    app = LeanServerSpanMiddleware(
        replay_server, tracer_provider=telemetry.provider, excluded_urls="health,metrics$"
    )
    with serve(app) as url:
        httpx.get(f"{url}/health")
        httpx.get(f"{url}/metrics")
        httpx.post(f"{url}/v1/chat/completions", json={"model": "m"})
    assert [s.name for s in telemetry.spans.get_finished_spans()] == ["POST /v1/chat/completions"]


def test_a_streamed_call_span_covers_the_whole_stream_and_its_metric_is_recorded_once(
    replay_server: ReplayModelServer, telemetry: Telemetry
) -> None:
    replay_server.replies["chat"] = Reply(content_type="text/event-stream", chunks=sse_chunks(CHAT_SSE))
    replay_server.chunk_delay = 0.002
    reader = InMemoryMetricReader()
    capture = ModelCallCaptureMiddleware(
        replay_server, tracer_provider=telemetry.provider, settings=CaptureSettings()
    )
    app = LeanServerSpanMiddleware(
        capture, tracer_provider=telemetry.provider, meter_provider=MeterProvider([reader])
    )
    with (
        serve(app) as url,
        httpx.stream(
            "POST", f"{url}/ng-rollout/st-1/v1/chat/completions", json={"model": "gpt-4o", "stream": True}
        ) as response,
    ):
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    server = _server_span(telemetry)
    (model,) = [s for s in telemetry.spans.get_finished_spans() if s.kind == SpanKind.INTERNAL]
    assert events[-1] == "data: [DONE]"
    assert model.parent is not None and model.parent.span_id == server.context.span_id
    assert server.start_time <= model.start_time and model.end_time <= server.end_time
    (point,) = metric_points(reader, A.METRIC_HTTP_SERVER_REQUEST_DURATION)
    assert point.count == 1 and tuple(point.explicit_bounds) == A.BUCKETS_HTTP_SERVER_REQUEST_DURATION
    assert dict(point.attributes) == {  # low cardinality: no path, no rollout, no address
        A.HTTP_REQUEST_METHOD: "POST",
        A.URL_SCHEME: "http",
        A.NETWORK_PROTOCOL_VERSION: "1.1",
        A.HTTP_ROUTE: "/v1/chat/completions",
        A.HTTP_RESPONSE_STATUS_CODE: 200,
    }
    assert point.sum == pytest.approx((server.end_time - server.start_time) / 1e9, abs=0.01)


def test_a_metric_reader_added_while_serving_gets_the_duration(
    replay_server: ReplayModelServer, telemetry: Telemetry
) -> None:
    """Without a reader nothing is recorded (the distro's provider under OTEL_METRICS_EXPORTER=none); a
    reader added later gets every request from then on."""
    meters = MeterProvider()
    app = LeanServerSpanMiddleware(replay_server, tracer_provider=telemetry.provider, meter_provider=meters)
    reader = InMemoryMetricReader()
    with serve(app) as url:
        httpx.post(f"{url}/v1/chat/completions", json={"model": "m"})
        # the server ends the span (the duration recorded just before) once the body has gone out, so the
        # client can have its answer first: the reader is added once the first request has ended
        deadline = time.monotonic() + 10
        while not telemetry.spans.get_finished_spans() and time.monotonic() < deadline:
            time.sleep(0.01)  # a bounded wait for the server's end of the first request
        assert len(telemetry.spans.get_finished_spans()) == 1
        meters.add_metric_reader(reader)
        httpx.post(f"{url}/v1/chat/completions", json={"model": "m"})
    (point,) = metric_points(reader, A.METRIC_HTTP_SERVER_REQUEST_DURATION)
    assert point.count == 1
    assert len(telemetry.spans.get_finished_spans()) == 2


def test_headers_only_when_asked_and_credentials_always_redacted(telemetry: Telemetry) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"set-cookie", b"session=sk-leak-check-out"), (b"x-answer", b"resp-visible")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    sent = {
        "authorization": "Bearer sk-leak-check-1",
        "x-internal-token": "sk-leak-check-2",
        "x-note": "visible",
    }
    plain = LeanServerSpanMiddleware(app, tracer_provider=telemetry.provider)
    asked = LeanServerSpanMiddleware(
        app,
        tracer_provider=telemetry.provider,
        capture_request_headers=[".*"],
        capture_response_headers=["x-.*", "set-cookie"],
        sanitize_headers=["x-internal-token"],
    )
    with serve(plain) as plain_url, serve(asked) as asked_url:
        httpx.get(plain_url, headers=sent)
        httpx.get(asked_url, headers=sent)
    without, with_headers = (dict(s.attributes) for s in telemetry.spans.get_finished_spans())
    assert not any(key.startswith(("http.request.header.", "http.response.header.")) for key in without)
    assert with_headers["http.request.header.x-note"] == ("visible",)
    assert with_headers["http.request.header.authorization"] == ("[REDACTED]",)
    assert with_headers["http.request.header.x-internal-token"] == ("[REDACTED]",)
    assert with_headers["http.response.header.x-answer"] == ("resp-visible",)
    assert with_headers["http.response.header.set-cookie"] == ("[REDACTED]",)
    assert not any("sk-leak-check" in str(value) for value in with_headers.values())


def test_zero_code_captures_the_headers_the_variables_ask_for_credentials_redacted(
    instrumented: None, telemetry: Telemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST", "x-note,authorization")
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_RESPONSE", "content-type")
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS", "x-note")
    app = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])])
    with serve(app) as url:  # the stack (and the variables) are read at the first request
        response = httpx.post(
            f"{url}/ng-rollout/h-1/v1/chat/completions",
            json={"model": "gpt-4o", "messages": []},
            headers={"authorization": "Bearer sk-leak-check-1", "x-note": "sk-leak-check-2", "x-other": "o"},
        )
    assert response.status_code == 200
    attributes = dict(_server_span(telemetry).attributes)
    assert attributes["http.request.header.authorization"] == ("[REDACTED]",)
    assert attributes["http.request.header.x-note"] == ("[REDACTED]",)
    assert attributes["http.response.header.content-type"] == ("application/json",)
    assert "http.request.header.x-other" not in attributes  # only what the variable names
    assert not any("sk-leak-check" in str(value) for value in attributes.values())


def test_a_configured_response_propagator_tells_the_client_its_trace(
    replay_server: ReplayModelServer, telemetry: Telemetry
) -> None:
    set_global_response_propagator(TraceResponsePropagator())
    try:
        with serve(LeanServerSpanMiddleware(replay_server, tracer_provider=telemetry.provider)) as url:
            response = httpx.post(f"{url}/v1/chat/completions", json={"model": "m"})
    finally:
        set_global_response_propagator(None)
    context = _server_span(telemetry).context
    flags = int(context.trace_flags)
    assert (
        response.headers["traceresponse"] == f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"
    )
