"""What tracing backends see, through a real uvicorn server and the official SDKs: GenAI semconv
attributes, opt-in content, the parent of the model-call span, the gen_ai.server.* metrics, and the
instrumentor on Starlette/FastAPI apps built after it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fastapi
import httpx
import openai
import pytest
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route
from support import RECORDED, ReplayModelServer, Reply, Telemetry, recorded_json, serve, sse_chunks

from otel_capture import CaptureSettings, ModelCallCaptureMiddleware, ModelCallInstrumentor
from otel_capture import _attributes as A

CHAT_SSE = (RECORDED / "openai-python/chat_completions_sse/parse_nothing.e2aad469b71d.sse").read_bytes()


@pytest.fixture
def metric_reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


def _app(
    replay: ReplayModelServer, telemetry: Telemetry, reader: InMemoryMetricReader, **settings: Any
) -> Any:
    return ModelCallCaptureMiddleware(
        replay,
        tracer_provider=telemetry.provider,
        meter_provider=MeterProvider(metric_readers=[reader]),
        settings=CaptureSettings(**settings),
    )


def _histograms(reader: InMemoryMetricReader) -> dict[str, Any]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: metric.data.data_points
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    }


def test_streamed_call_span_and_server_metrics(
    replay_server: ReplayModelServer, telemetry: Telemetry, metric_reader: InMemoryMetricReader
) -> None:
    replay_server.replies["chat"] = Reply(content_type="text/event-stream", chunks=sse_chunks(CHAT_SSE))
    replay_server.chunk_delay = 0.002
    with serve(_app(replay_server, telemetry, metric_reader)) as url:
        client = openai.OpenAI(base_url=f"{url}/ng-rollout/m-1/v1", api_key="k", max_retries=0)
        list(
            client.chat.completions.create(
                model="gpt-4o",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                temperature=0.2,
                max_tokens=50,
                seed=3,
            )
        )
        client.close()
    (span,) = telemetry.spans.get_finished_spans()
    attributes = span.attributes
    assert span.name == "chat gpt-4o" and span.kind == SpanKind.INTERNAL
    assert attributes[A.GEN_AI_REQUEST_STREAM] is True
    assert attributes[A.OPENAI_API_TYPE] == "chat_completions"
    assert attributes[A.GEN_AI_REQUEST_TEMPERATURE] == 0.2 and attributes[A.GEN_AI_REQUEST_MAX_TOKENS] == 50
    assert attributes[A.GEN_AI_REQUEST_SEED] == 3
    assert attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 30
    assert attributes[A.SERVER_ADDRESS] == "127.0.0.1" and attributes[A.SERVER_PORT] == int(
        url.rsplit(":", 1)[1]
    )
    duration = (span.end_time - span.start_time) / 1e9
    assert 0 < attributes[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] < duration
    assert A.GEN_AI_INPUT_MESSAGES not in attributes  # content is opt-in

    points = _histograms(metric_reader)
    (duration_point,) = points[A.METRIC_SERVER_REQUEST_DURATION]
    assert duration_point.count == 1 and tuple(duration_point.explicit_bounds) == A.BUCKETS_REQUEST_DURATION
    assert dict(duration_point.attributes) == {
        A.GEN_AI_OPERATION_NAME: "chat",
        A.GEN_AI_PROVIDER_NAME: "openai",
        A.GEN_AI_REQUEST_MODEL: "gpt-4o",
        A.GEN_AI_RESPONSE_MODEL: "gpt-4o-2024-08-06",
        A.SERVER_ADDRESS: "127.0.0.1",
        A.SERVER_PORT: attributes[A.SERVER_PORT],
    }
    (ttft,) = points[A.METRIC_SERVER_TIME_TO_FIRST_TOKEN]
    assert tuple(ttft.explicit_bounds) == A.BUCKETS_TIME_TO_FIRST_TOKEN
    assert ttft.sum == pytest.approx(attributes[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK], abs=0.01)
    (tpot,) = points[A.METRIC_SERVER_TIME_PER_OUTPUT_TOKEN]
    assert tuple(tpot.explicit_bounds) == A.BUCKETS_TIME_PER_OUTPUT_TOKEN
    assert tpot.sum == pytest.approx((duration_point.sum - ttft.sum) / 29, rel=0.05)


def test_message_content_only_when_asked_and_valid_json_when_cut(
    replay_server: ReplayModelServer, telemetry: Telemetry, metric_reader: InMemoryMetricReader
) -> None:
    app = _app(replay_server, telemetry, metric_reader, capture_content="span_only", content_max_length=120)
    with serve(app) as url:
        httpx.post(
            f"{url}/ng-rollout/c-1/v1/chat/completions",
            json={
                "model": "gpt-4o",
                "messages": [{"role": "user", "content": "tell me " + "very " * 200 + "much"}],
            },
        )
    (span,) = telemetry.spans.get_finished_spans()
    sent = json.loads(span.attributes[A.GEN_AI_INPUT_MESSAGES])
    assert len(span.attributes[A.GEN_AI_INPUT_MESSAGES]) <= 120
    assert sent[0]["role"] == "user" and sent[0]["parts"][0]["content"].startswith("tell me very")
    output = json.loads(span.attributes[A.GEN_AI_OUTPUT_MESSAGES])
    assert output[0]["role"] == "assistant" and output[0]["finish_reason"] == "stop"
    # the record keeps the whole request whatever the span got
    assert "much" in telemetry.store.root.joinpath("c-1.capture.jsonl").read_text()


def test_span_continues_the_callers_traceparent_without_a_server_span(
    replay_server: ReplayModelServer, telemetry: Telemetry, metric_reader: InMemoryMetricReader
) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with serve(_app(replay_server, telemetry, metric_reader)) as url:
        httpx.post(
            f"{url}/v1/messages",
            json={"model": "claude", "max_tokens": 5, "messages": []},
            headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "baggage": "rollout.id=tp-1"},
        )
    (span,) = telemetry.spans.get_finished_spans()
    assert format(span.context.trace_id, "032x") == trace_id
    assert span.parent is not None and format(span.parent.span_id, "016x") == parent_id
    assert span.attributes[A.ROLLOUT_ID] == "tp-1"
    assert span.attributes[A.GEN_AI_PROVIDER_NAME] == "anthropic"
    assert A.OPENAI_API_TYPE not in span.attributes


def test_error_type_and_status(
    replay_server: ReplayModelServer, telemetry: Telemetry, metric_reader: InMemoryMetricReader
) -> None:
    replay_server.replies["responses"] = Reply(status=503, chunks=[b'{"error": {"message": "overloaded"}}'])
    with serve(_app(replay_server, telemetry, metric_reader)) as url:
        assert (
            httpx.post(f"{url}/ng-rollout/e-1/v1/responses", json={"model": "m", "input": "x"}).status_code
            == 503
        )
    (span,) = telemetry.spans.get_finished_spans()
    assert span.attributes[A.ERROR_TYPE] == "upstream_error" and span.status.status_code == StatusCode.ERROR
    (point,) = _histograms(metric_reader)[A.METRIC_SERVER_REQUEST_DURATION]
    assert point.attributes[A.ERROR_TYPE] == "upstream_error"
    assert A.METRIC_SERVER_TIME_TO_FIRST_TOKEN not in _histograms(metric_reader)


# -- the instrumentor --------------------------------------------------------------------------------


async def _chat(request: Request) -> JSONResponse:
    await request.body()
    return JSONResponse(json.loads(recorded_json("chat")))


@pytest.fixture
def instrumented(telemetry: Telemetry) -> Iterator[None]:
    instrumentor = ModelCallInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.provider, settings=CaptureSettings())
    yield
    instrumentor.uninstrument()


def _one_call(url: str, path: str) -> None:
    response = httpx.post(
        f"{url}{path}", json={"model": "gpt-4o", "messages": []}, headers={"baggage": "rollout.id=i-1"}
    )
    assert response.json()["id"] == json.loads(recorded_json("chat"))["id"]


def _assert_one_capture_below_one_server_span(telemetry: Telemetry) -> None:
    """Checked once the server has stopped: the HTTP server span ends after the client has its response."""
    spans = telemetry.spans.get_finished_spans()
    (model,) = [s for s in spans if s.name == "chat gpt-4o"]
    (server,) = [s for s in spans if s.kind == SpanKind.SERVER]
    assert model.parent is not None and model.parent.span_id == server.context.span_id
    assert not [s for s in spans if s.name.endswith(("http send", "http receive"))]
    assert len(telemetry.store.rollout_ids()) == 1


def test_instrumentor_captures_a_starlette_app_and_its_mounted_sub_app_once(
    instrumented: None, telemetry: Telemetry
) -> None:
    inner = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])])
    app = Starlette(routes=[Mount("/inner", inner), Route("/v1/chat/completions", _chat, methods=["POST"])])
    with serve(app) as url:
        _one_call(url, "/inner/v1/chat/completions")
    _assert_one_capture_below_one_server_span(telemetry)


def test_instrumentor_with_fastapi_instrumentation_adds_no_second_server_span(
    instrumented: None, telemetry: Telemetry
) -> None:
    app = fastapi.FastAPI()
    app.add_api_route("/v1/chat/completions", _chat, methods=["POST"])
    FastAPIInstrumentor.instrument_app(
        app, tracer_provider=telemetry.provider, exclude_spans=["receive", "send"]
    )
    try:
        with serve(app) as url:
            _one_call(url, "/v1/chat/completions")
        _assert_one_capture_below_one_server_span(telemetry)
    finally:
        FastAPIInstrumentor.uninstrument_app(app)


def test_uninstrumented_apps_are_left_alone(telemetry: Telemetry) -> None:
    instrumentor = ModelCallInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.provider)
    instrumentor.uninstrument()
    app = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])])
    with serve(app) as url:
        httpx.post(f"{url}/v1/chat/completions", json={}, headers={"baggage": "rollout.id=u-1"})
    assert telemetry.spans.get_finished_spans() == ()


class _ReadAtStart(SpanProcessor):
    """A user's processor that reads each span at its start (as one copying attributes to a log would)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.seen.append(dict(span.attributes or {}))


class _ByRollout(Sampler):
    """A user's sampler that decides on a start attribute: calls of rollout ``keep-*`` only."""

    def should_sample(self, parent_context: Any, trace_id: int, name: str, *args: Any, **kw: Any) -> Any:
        attributes = kw.get("attributes", args[1] if len(args) > 1 else None) or {}
        keep = str(attributes.get(A.ROLLOUT_ID, "")).startswith("keep-")
        return SamplingResult(Decision.RECORD_AND_SAMPLE if keep else Decision.DROP, attributes)

    def get_description(self) -> str:
        return "by rollout"


def test_a_processor_and_a_sampler_see_the_start_attributes(
    replay_server: ReplayModelServer, telemetry: Telemetry, metric_reader: InMemoryMetricReader
) -> None:
    """The start attributes are stored without the SDK's per-value check only where nobody reads a span at
    its start; a user's processor and a user's sampler see them there, as the semconv says."""
    reader = _ReadAtStart()
    telemetry.provider.add_span_processor(reader)
    with serve(_app(replay_server, telemetry, metric_reader)) as url:
        httpx.post(f"{url}/ng-rollout/r-1/v1/chat/completions", json={"model": "gpt-4o", "messages": []})
    (span,) = telemetry.spans.get_finished_spans()
    assert reader.seen[0][A.ROLLOUT_ID] == "r-1" and reader.seen[0][A.GEN_AI_REQUEST_MODEL] == "gpt-4o"
    assert span.attributes[A.HTTP_RESPONSE_STATUS_CODE] == 200  # and the end attributes after them

    sampled = TracerProvider(sampler=_ByRollout())
    spans = InMemorySpanExporter()
    sampled.add_span_processor(SimpleSpanProcessor(spans))
    app = ModelCallCaptureMiddleware(replay_server, tracer_provider=sampled, settings=CaptureSettings())
    with serve(app) as url:
        for rollout in ("drop-1", "keep-1"):
            httpx.post(f"{url}/ng-rollout/{rollout}/v1/chat/completions", json={"model": "m", "messages": []})
    assert [s.attributes[A.ROLLOUT_ID] for s in spans.get_finished_spans()] == ["keep-1"]
