"""What real gateways and stacks do to a call, end to end on 127.0.0.1: a model app that redirects slashes and
serves paths without ``/v1`` (as llama.cpp does), a gateway-like hop that forwards only ``x-*`` headers, and
two capture layers writing to one directory. See ``docs/gateways.md``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import fastapi
import httpx
import openai
import pytest
import starlette.applications
import starlette.requests
import starlette.responses
import starlette.routing
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.trace import SpanKind
from otlp_receiver import OtlpReceiver
from support import Telemetry, read_body, recorded_json, serve, start_cli_proxy
from zero_code import instrumented_model_server

from otel_capture import (
    CaptureSettings,
    CaptureStore,
    ModelCallCaptureMiddleware,
    ModelCallInstrumentor,
    instrument_http_client,
    read_model_call_records,
    rollout_context,
    rollout_headers,
    start_proxy,
)
from otel_capture import _attributes as A
from otel_capture._store import read_uncorrelated
from otel_capture._store.inflight import InflightMarkers
from otel_capture._telemetry.metrics import UNCORRELATED_CALLS

SERVER, CLIENT = 2, 3  # OTLP Span.SpanKind SPAN_KIND_SERVER, SPAN_KIND_CLIENT
CHAT_ID = json.loads(recorded_json("chat"))["id"]


@dataclass
class ModelApp:
    """A FastAPI model server that serves each dialect with and without ``/v1`` (llama.cpp does) and keeps
    what reached it."""

    app: fastapi.FastAPI
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (route path, headers)


def _model_app() -> ModelApp:
    app = fastapi.FastAPI()
    model = ModelApp(app)

    async def answer(request: fastapi.Request) -> Any:
        await request.body()
        route = request.scope["path"].removeprefix(request.scope.get("root_path", ""))
        model.seen.append((route, dict(request.headers)))
        dialect = {"chat/completions": "chat", "responses": "responses", "messages": "messages"}
        body = recorded_json(next(d for suffix, d in dialect.items() if route.endswith(suffix)))
        return fastapi.Response(body, media_type="application/json")

    for path in ("/chat/completions", "/responses", "/messages"):
        app.add_api_route(path, answer, methods=["POST"], name=path.strip("/"))
        app.add_api_route("/v1" + path, answer, methods=["POST"], name="v1 " + path.strip("/"))

    @app.get("/v1/links")
    async def links(request: fastapi.Request) -> dict[str, str]:
        return {"chat": str(request.url_for("v1 chat/completions"))}

    return model


def _gateway(target: str) -> Any:
    """A gateway-like hop (an ASGI app): forwards method, path, query and body to ``target`` with only its
    ``x-*`` headers and the content type, as many API gateways do; the URL prefix and ``baggage`` are lost
    unless the agent put them in the target."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        headers = [(k, v) for k, v in scope["headers"] if k.startswith(b"x-") or k == b"content-type"]
        url = target + scope["path"] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
        async with httpx.AsyncClient() as client:
            response = await client.request(scope["method"], url, headers=headers, content=body)
        out = [(b"content-type", response.headers.get("content-type", "application/json").encode())]
        await send({"type": "http.response.start", "status": response.status_code, "headers": out})
        await send({"type": "http.response.body", "body": response.content})

    return app


def _chat(base_url: str, **kwargs: Any) -> Any:
    client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, **kwargs)
    with client:
        return client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


# -- 1. redirects keep the rollout ---------------------------------------------------------------------


@pytest.fixture
def instrumented(telemetry: Telemetry) -> Iterator[None]:
    instrumentor = ModelCallInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.provider, settings=CaptureSettings())
    yield
    instrumentor.uninstrument()


def test_a_slash_redirect_keeps_the_rollout_prefix_and_only_the_call_that_follows_is_recorded(
    instrumented: None, telemetry: Telemetry
) -> None:
    model = _model_app()
    with serve(model.app) as url, httpx.Client(follow_redirects=True) as client:
        response = client.post(f"{url}/ng-rollout/redir-1/v1/chat/completions/", json={"model": "gpt-4o"})
        links = client.get(f"{url}/ng-rollout/redir-1/v1/links").json()
    (redirect,) = response.history
    assert redirect.status_code == 307
    assert redirect.headers["location"] == f"{url}/ng-rollout/redir-1/v1/chat/completions"
    assert response.status_code == 200 and response.json()["id"] == CHAT_ID
    assert links["chat"] == f"{url}/ng-rollout/redir-1/v1/chat/completions"  # url_for keeps it too
    (record,) = read_model_call_records(telemetry.store, "redir-1")
    assert record.status_code == 200 and record.response == json.loads(recorded_json("chat"))
    assert [path for path, _ in model.seen] == ["/v1/chat/completions"]
    # the HTTP server spans are named by the route, never by the rollout
    servers = [s.name for s in telemetry.spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert servers == ["POST /v1/chat/completions/", "POST /v1/chat/completions", "GET /v1/links"]


def _slash_redirecting_upstream(
    base_path: str, capture_dir: Path, rollout_id: str
) -> tuple[Any, list[tuple[str, dict[str, str]]], list[set[str]]]:
    """A Starlette model server (mounted at ``base_path``) whose router redirects slashes, as Starlette and
    FastAPI do by default; it keeps every request that reached it, and takes 200 ms to redirect, long past
    the writer's marker delay, noting meanwhile which calls of ``rollout_id`` the capture has in flight."""

    async def chat(request: starlette.requests.Request) -> starlette.responses.Response:
        await request.body()
        return starlette.responses.Response(recorded_json("chat"), media_type="application/json")

    inner = starlette.applications.Starlette(
        routes=[starlette.routing.Route("/v1/chat/completions", chat, methods=["POST"])]
    )
    app = inner
    if base_path:
        app = starlette.applications.Starlette(routes=[starlette.routing.Mount(base_path, app=inner)])
    seen: list[tuple[str, dict[str, str]]] = []
    in_flight: list[set[str]] = []

    async def upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append((scope["path"], {k.decode(): v.decode() for k, v in scope["headers"]}))
            if scope["path"].endswith("/"):
                await asyncio.sleep(0.2)
                in_flight.append(InflightMarkers.pending(capture_dir, rollout_id))
        await app(scope, receive, send)

    return upstream, seen, in_flight


@pytest.mark.parametrize(("base_path", "by_header"), [("", False), ("/base", False), ("", True)])
def test_behind_the_proxy_an_upstream_slash_redirect_comes_back_through_it_and_only_the_real_call_is_recorded(
    tmp_path: Path, base_path: str, by_header: bool
) -> None:
    """agent (following redirects) → ``otel-capture proxy`` → Starlette app that redirects slashes: the
    ``307`` leads back to the proxy with the rollout prefix (or, correlated by the ``x-rollout-id`` header,
    without one: the client sends the header again), the redirect is not the model call (the call it began
    is ended, no record, no incomplete mark), and the call that follows is recorded."""
    capture_dir = tmp_path / "calls"
    upstream_app, seen, in_flight = _slash_redirecting_upstream(base_path, capture_dir, "redir-p")
    request = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    with serve(upstream_app) as upstream:
        process, proxy_url = start_cli_proxy(upstream + base_path, "--capture-dir", str(capture_dir))
        try:
            prefix, headers = ("", rollout_headers("redir-p")) if by_header else ("/ng-rollout/redir-p", {})
            with httpx.Client(follow_redirects=True, headers=headers) as client:
                response = client.post(f"{proxy_url}{prefix}/v1/chat/completions/", json=request)
            store = CaptureStore(capture_dir)
            inflight_file = capture_dir / ".otel-capture" / "inflight" / "redir-p.calls"
            left_in_flight = inflight_file.exists()
            snapshot = store.freeze_now("redir-p")  # while the proxy still runs
        finally:
            process.terminate()
            process.communicate(timeout=30)
    (redirect,) = response.history
    assert redirect.status_code == 307
    assert redirect.headers["location"] == f"{proxy_url}{prefix}/v1/chat/completions"
    assert response.status_code == 200 and response.json()["id"] == CHAT_ID
    # both requests reached the upstream from the proxy (which marks what it records), none from the client
    assert [path for path, _ in seen] == [
        f"{base_path}/v1/chat/completions/",
        f"{base_path}/v1/chat/completions",
    ]
    assert [h.get("x-otel-capture") for _, h in seen] == ["captured"] * 2
    assert not [h for _, h in seen if "x-rollout-id" in h]
    assert len(in_flight) == 1 and len(in_flight[0]) == 1  # the redirect's call had begun, marker written
    (record,) = snapshot.records
    assert record.status_code == 200 and record.request == request
    assert record.response == json.loads(recorded_json("chat"))
    assert not snapshot.incomplete and snapshot.incomplete_calls == ()  # freeze: nothing in flight
    assert not left_in_flight and not (capture_dir / "redir-p.capture.incomplete").exists()
    assert process.returncode == 0


def test_a_redirect_from_an_endpoint_that_read_the_request_is_not_recorded_and_not_left_in_flight(
    telemetry: Telemetry,
) -> None:
    """In-process: an endpoint that reads the body and then redirects (a gateway sending the call on) has
    begun the call; the redirect is traced, not recorded, and the call ends, so a freeze never reports it."""
    app = fastapi.FastAPI()
    in_flight: list[set[str]] = []

    @app.post("/chat/completions")  # a model path: the call is captured, and begins when the body is read
    async def moved(request: fastapi.Request) -> fastapi.responses.RedirectResponse:
        await request.body()
        await asyncio.sleep(0.2)  # past the writer's marker delay: its "+" marker is on disk
        in_flight.append(InflightMarkers.pending(telemetry.store.root, "moved-1"))
        return fastapi.responses.RedirectResponse(request.url_for("v1 chat"), status_code=307)

    @app.post("/v1/chat/completions", name="v1 chat")
    async def chat(request: fastapi.Request) -> fastapi.Response:
        await request.body()
        return fastapi.Response(recorded_json("chat"), media_type="application/json")

    with (
        serve(ModelCallCaptureMiddleware(app, tracer_provider=telemetry.provider)) as url,
        httpx.Client(follow_redirects=True) as client,
    ):
        response = client.post(f"{url}/ng-rollout/moved-1/chat/completions", json={"model": "gpt-4o"})
    assert [r.status_code for r in response.history] == [307]
    assert response.status_code == 200 and response.json()["id"] == CHAT_ID
    assert telemetry.jsonl.force_flush()
    assert len(in_flight) == 1 and len(in_flight[0]) == 1  # the call had begun, its marker written
    assert InflightMarkers.pending(telemetry.store.root, "moved-1") == set()
    snapshot = telemetry.store.freeze_now("moved-1")
    (record,) = snapshot.records
    assert record.status_code == 200 and not snapshot.incomplete
    statuses = [
        s.attributes.get(A.HTTP_RESPONSE_STATUS_CODE)
        for s in telemetry.spans.get_finished_spans()
        if s.name == "chat gpt-4o"
    ]
    assert statuses == [307, 200]  # the redirect is still traced, with its status


# -- 2. model paths without /v1 ------------------------------------------------------------------------


@pytest.fixture(params=["in-process", "proxy"])
def model_url(request: pytest.FixtureRequest, telemetry: Telemetry) -> Iterator[tuple[str, ModelApp]]:
    model = _model_app()
    if request.param == "in-process":
        with serve(ModelCallCaptureMiddleware(model.app, tracer_provider=telemetry.provider)) as url:
            yield url, model
        return
    with serve(model.app) as upstream, start_proxy(upstream, tracer_provider=telemetry.provider) as proxy:
        yield proxy.url, model


def test_model_paths_without_v1_are_captured_with_and_without_the_prefix(
    model_url: tuple[str, ModelApp], telemetry: Telemetry
) -> None:
    url, model = model_url
    with openai.OpenAI(base_url=f"{url}/ng-rollout/nov1", api_key="k", max_retries=0) as client:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        client.responses.create(model="gpt-4o-mini", input="hi")
    httpx.post(f"{url}/ng-rollout/nov1/messages", json={"model": "claude", "max_tokens": 8, "messages": []})
    _chat(url, default_headers={"baggage": "rollout.id=nov1-bag"})
    assert [path for path, _ in model.seen] == [
        "/chat/completions",
        "/responses",
        "/messages",
        "/chat/completions",
    ]
    records = read_model_call_records(telemetry.store, "nov1")
    assert [(r.dialect, r.status_code) for r in records] == [
        ("chat", 200),
        ("responses", 200),
        ("messages", 200),
    ]
    assert records[2].response == json.loads(recorded_json("messages"))
    (bagged,) = read_model_call_records(telemetry.store, "nov1-bag")
    assert bagged.dialect == "chat" and bagged.response_id == CHAT_ID


# -- 3. uncorrelated model calls are announced ---------------------------------------------------------


def test_model_calls_without_a_rollout_id_are_logged_once_and_counted(
    telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    reader = InMemoryMetricReader()
    model = _model_app()
    app = ModelCallCaptureMiddleware(
        model.app, tracer_provider=telemetry.provider, meter_provider=MeterProvider(metric_readers=[reader])
    )
    with caplog.at_level(logging.WARNING, logger="otel_capture"), serve(app) as url:
        for _ in range(3):
            assert _chat(f"{url}/v1").id == CHAT_ID  # served as ever
        anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.create(
            model="claude", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
        _chat(f"{url}/ng-rollout/counted-not/v1")  # correlated: neither logged nor counted
        # recorded by a capture layer in front (its mark), whatever id it had: not this layer's to announce
        _chat(f"{url}/v1", default_headers={"x-otel-capture": "captured"})
        httpx.get(f"{url}/v1/links")  # not a model call
    warnings = [r.getMessage() for r in caplog.records if "no rollout id" in r.getMessage()]
    assert len(warnings) == 1, warnings  # the first one; the rest wait for the next minute, with a count
    assert "/v1/chat/completions" in warnings[0] and "x-rollout-id" in warnings[0]
    # and it points to the recipes per framework
    assert "docs/gateways.md, 'Per framework'" in warnings[0]
    assert "forward_client_headers_to_llm_api" in warnings[0] and "X-Session-ID" in warnings[0]
    data = reader.get_metrics_data()
    assert data is not None
    (metric,) = [
        m
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == UNCORRELATED_CALLS
    ]
    counts = {p.attributes[A.MODEL_CALL_DIALECT]: p.value for p in metric.data.data_points}
    assert counts == {"chat": 3, "messages": 1}
    assert telemetry.store.rollout_ids() == ["counted-not"]


# -- 4. header correlation through a gateway -----------------------------------------------------------


@pytest.fixture
def gateway_to_proxy(telemetry: Telemetry) -> Iterator[tuple[str, ModelApp]]:
    """agent → gateway (x-* headers only) → capture proxy → model app."""
    model = _model_app()
    with (
        serve(model.app) as upstream,
        start_proxy(upstream, tracer_provider=telemetry.provider) as proxy,
        serve(_gateway(proxy.url)) as gateway,
    ):
        yield gateway, model


def test_behind_a_gateway_the_rollout_header_correlates_and_never_reaches_the_model(
    gateway_to_proxy: tuple[str, ModelApp], telemetry: Telemetry
) -> None:
    gateway, model = gateway_to_proxy
    # baggage does not survive this gateway; the header does
    _chat(f"{gateway}/v1", default_headers={**rollout_headers("gw-1"), "baggage": "rollout.id=lost"})
    http_client = instrument_http_client(openai.DefaultHttpxClient(), rollout_header=True)
    with rollout_context("gw-2"):
        _chat(f"{gateway}/v1", http_client=http_client)
    assert [len(read_model_call_records(telemetry.store, rid)) for rid in ("gw-1", "gw-2")] == [1, 1]
    assert telemetry.store.rollout_ids() == ["gw-1", "gw-2"]
    model_spans = [s for s in telemetry.spans.get_finished_spans() if s.name == "chat gpt-4o"]
    assert [s.attributes[A.MODEL_CALL_ROLLOUT_SOURCE] for s in model_spans] == ["header", "header"]
    assert [path for path, _ in model.seen] == ["/v1/chat/completions"] * 2
    assert not [h for _, h in model.seen if "x-rollout-id" in h]


def test_an_invalid_rollout_header_is_served_not_recorded_and_not_forwarded(
    gateway_to_proxy: tuple[str, ModelApp], telemetry: Telemetry
) -> None:
    """Issue 33: an id outside the grammar (an inspect-ai sample id ``city 9``) no longer fails the call
    (it was a 400): served, the header not forwarded, nothing recorded."""
    gateway, model = gateway_to_proxy
    assert _chat(f"{gateway}/v1", default_headers={"x-rollout-id": "city 9"}).id == CHAT_ID
    assert [path for path, _ in model.seen] == ["/v1/chat/completions"]
    assert not [h for _, h in model.seen if "x-rollout-id" in h]
    assert telemetry.store.rollout_ids() == []


def test_a_double_prefix_is_served_without_both_prefixes_and_not_recorded(
    gateway_to_proxy: tuple[str, ModelApp], telemetry: Telemetry
) -> None:
    """/ng-rollout/a/ng-rollout/b/...: which rollout is meant is anyone's guess (it was a 400 naming the
    rule). Capture never fails a call: the proxy and a middleware in the app alike serve the model path
    the caller meant, both prefixes stripped, and record nothing (counted as invalid_id)."""
    gateway, model = gateway_to_proxy
    behind = ModelCallCaptureMiddleware(_model_app().app, tracer_provider=telemetry.provider)
    with serve(behind) as app_url:
        for url in (gateway, app_url):
            assert _chat(f"{url}/ng-rollout/a/ng-rollout/b/v1").id == CHAT_ID
        deadline = time.monotonic() + 30  # a bounded wait: the count is written within a second
        while read_uncorrelated(telemetry.store.root).invalid.calls != 2:
            assert time.monotonic() < deadline, read_uncorrelated(telemetry.store.root)
            time.sleep(0.05)  # polling interval of a bounded wait
    assert [path for path, _ in model.seen] == ["/v1/chat/completions"]  # through the proxy, unprefixed
    assert telemetry.store.rollout_ids() == []


def test_in_front_of_a_gateway_the_capture_records_once_and_its_mark_passes_the_gateway(
    telemetry: Telemetry,
) -> None:
    """agent → capture proxy → gateway → model app with its own capture middleware, all on one directory."""
    model = _model_app()
    behind = ModelCallCaptureMiddleware(model.app, tracer_provider=telemetry.provider)
    with (
        serve(behind) as upstream,
        serve(_gateway(upstream)) as gateway,
        start_proxy(gateway, tracer_provider=telemetry.provider) as proxy,
    ):
        assert _chat(f"{proxy.url}/ng-rollout/front-1/v1").id == CHAT_ID
        _chat(f"{proxy.url}/v1", default_headers={"x-rollout-id": "front-2"})
    assert [len(read_model_call_records(telemetry.store, rid)) for rid in ("front-1", "front-2")] == [1, 1]
    assert [path for path, _ in model.seen] == ["/v1/chat/completions"] * 2
    assert [h.get("x-otel-capture") for _, h in model.seen] == ["captured"] * 2


# -- 5. one call, one record, however the layers stack -------------------------------------------------


def _three_correlations(url: str) -> None:
    _chat(f"{url}/ng-rollout/stack-prefix/v1")
    _chat(f"{url}/v1", default_headers={"baggage": "rollout.id=stack-baggage"})
    _chat(f"{url}/v1", default_headers=rollout_headers("stack-header"))


def _one_record_each(capture_dir: Path) -> None:
    store = CaptureStore(capture_dir)
    assert store.rollout_ids() == ["stack-baggage", "stack-header", "stack-prefix"]
    for rollout_id in store.rollout_ids():
        (record,) = read_model_call_records(store, rollout_id)
        assert record.response_id == CHAT_ID


def test_proxy_in_front_of_a_proxy_on_one_directory_writes_one_record_per_call(tmp_path: Path) -> None:
    model = _model_app()
    capture_dir = str(tmp_path / "calls")
    processes = []
    with serve(model.app) as upstream:
        try:
            back, back_url = start_cli_proxy(upstream, "--capture-dir", capture_dir)
            processes.append(back)
            front, front_url = start_cli_proxy(back_url, "--capture-dir", capture_dir)
            processes.append(front)
            _three_correlations(front_url)
        finally:
            for process in processes:
                process.terminate()
                process.communicate(timeout=30)
    assert [p.returncode for p in processes] == [0, 0]
    _one_record_each(tmp_path / "calls")
    assert len(model.seen) == 3


def test_proxy_in_front_of_a_zero_code_server_records_once_and_the_server_still_traces_the_call(
    tmp_path: Path,
) -> None:
    otlp = OtlpReceiver()
    capture_dir = tmp_path / "calls"
    with serve(otlp) as otlp_url:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp,model_call_jsonl",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_url,
            "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": str(capture_dir),
            "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "fastapi",
        }
        with instrumented_model_server(env) as server:
            proxy, proxy_url = start_cli_proxy(server.url, "--capture-dir", str(capture_dir), env=env)
            try:
                _three_correlations(proxy_url)
            finally:
                proxy.terminate()
                proxy.communicate(timeout=30)
            server.stop()
        otlp.wait_for(lambda r: sum(s.kind == SERVER and s.name.startswith("POST") for s in r.spans) == 6)
    assert proxy.returncode == 0
    _one_record_each(capture_dir)
    spans = {s.span_id: s for s in otlp.spans}
    store = CaptureStore(capture_dir)
    for rollout_id in store.rollout_ids():
        (record,) = read_model_call_records(store, rollout_id)
        # the proxy's model-call span is the parent of the zero-code server's HTTP span, which has no
        # model-call span of its own
        (behind,) = [s for s in otlp.spans if s.parent_span_id == record.span_id]
        assert behind.kind == SERVER and behind.name == "POST /v1/chat/completions"
        assert not [s for s in otlp.spans if s.parent_span_id == behind.span_id]
        assert spans[record.span_id].kind == CLIENT
    assert sum(s.name.startswith("chat ") for s in otlp.spans) == 3
