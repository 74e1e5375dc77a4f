"""The app behind the capture sees the model-call span's context in the ``traceparent`` it reads from the
request (an engine that traces from the headers, as vLLM does, nests its span under the call), with the
caller's ``tracestate`` and ``baggage`` kept: through a real uvicorn, with an app that echoes the trace
headers it was handed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support import Telemetry, recorded_json, serve

from otel_capture import CaptureSettings, ModelCallCaptureMiddleware, ModelCallInstrumentor

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")


async def _echo_chat(request: Request) -> JSONResponse:
    """A chat answer that carries, in its id, the trace headers the app was handed (all of each)."""
    await request.body()
    seen = {name: request.headers.getlist(name) for name in TRACE_HEADERS}
    return JSONResponse({**json.loads(recorded_json("chat")), "id": json.dumps(seen)})


async def _echo_health(request: Request) -> JSONResponse:
    return JSONResponse({name: request.headers.getlist(name) for name in TRACE_HEADERS})


def _app() -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/chat/completions", _echo_chat, methods=["POST"]),
            Route("/health", _echo_health, methods=["GET"]),
        ]
    )


def _seen(response: httpx.Response) -> dict[str, list[str]]:
    assert response.status_code == 200, response.text
    seen: dict[str, list[str]] = json.loads(response.json()["id"])
    return seen


def _call_span(telemetry: Telemetry) -> Any:
    (span,) = [s for s in telemetry.spans.get_finished_spans() if s.name.startswith("chat")]
    return span


@pytest.fixture
def url(telemetry: Telemetry) -> Iterator[str]:
    app = ModelCallCaptureMiddleware(_app(), tracer_provider=telemetry.provider, settings=CaptureSettings())
    with serve(app) as base:
        yield base


def test_the_app_sees_the_call_spans_traceparent_with_tracestate_and_baggage_kept(
    url: str, telemetry: Telemetry
) -> None:
    response = httpx.post(
        f"{url}/ng-rollout/tp-1/v1/chat/completions",
        json={"model": "m", "messages": []},
        headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc,other=1", "baggage": "team=rl"},
    )
    span = _call_span(telemetry)
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID
    assert _seen(response) == {
        "traceparent": [f"00-{TRACE_ID}-{span.context.span_id:016x}-01"],  # one, the call's, not the caller's
        "tracestate": ["vendor=abc,other=1"],
        "baggage": ["team=rl"],
    }


def test_without_a_caller_trace_the_app_sees_the_new_trace_of_the_call(
    url: str, telemetry: Telemetry
) -> None:
    response = httpx.post(
        f"{url}/v1/chat/completions", json={"model": "m", "messages": []}, headers={"x-rollout-id": "tp-2"}
    )
    span = _call_span(telemetry)
    assert span.parent is None
    assert _seen(response) == {
        "traceparent": [
            f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-{span.context.trace_flags:02x}"
        ],
        "tracestate": [],
        "baggage": [],
    }


def test_requests_that_are_not_captured_keep_their_headers(url: str, telemetry: Telemetry) -> None:
    sent = {"traceparent": TRACEPARENT, "baggage": "team=rl"}
    health = httpx.get(f"{url}/health", headers=sent)
    assert health.json() == {"traceparent": [TRACEPARENT], "tracestate": [], "baggage": ["team=rl"]}
    uncorrelated = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}, headers=sent)
    assert _seen(uncorrelated) == {"traceparent": [TRACEPARENT], "tracestate": [], "baggage": ["team=rl"]}
    assert telemetry.spans.get_finished_spans() == ()


def test_zero_code_the_app_sees_the_call_span_under_the_server_span(telemetry: Telemetry) -> None:
    instrumentor = ModelCallInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.provider, settings=CaptureSettings())
    try:
        with serve(_app()) as base:
            response = httpx.post(
                f"{base}/ng-rollout/tp-3/v1/chat/completions",
                json={"model": "m", "messages": []},
                headers={"traceparent": TRACEPARENT, "baggage": "team=rl"},
            )
    finally:
        instrumentor.uninstrument()
    span = _call_span(telemetry)
    (server,) = [s for s in telemetry.spans.get_finished_spans() if s.name.startswith("POST")]
    assert span.parent is not None and span.parent.span_id == server.context.span_id
    assert format(server.parent.span_id, "016x") == PARENT_ID
    assert _seen(response) == {
        "traceparent": [f"00-{TRACE_ID}-{span.context.span_id:016x}-01"],
        "tracestate": [],
        "baggage": ["team=rl"],
    }
