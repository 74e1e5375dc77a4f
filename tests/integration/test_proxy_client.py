"""What the proxy's upstream client (``_Pool``: aiohttp's connector and response protocol, no
``ClientSession``) sends and how it reads: the request as the upstream sees it, bodiless methods, HEAD,
and kept-alive connections."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry import propagate
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from support import read_body, serve

from otel_capture import start_proxy


class _Echo:
    """An upstream that remembers each request (method, path, headers, body, client port) and answers
    ``ok`` with a Content-Length, HEAD included."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        self.seen.append(
            {
                "method": scope["method"],
                "target": scope["raw_path"]
                + (b"?" + scope["query_string"] if scope["query_string"] else b""),
                "headers": [(k.decode(), v.decode()) for k, v in scope["headers"]],
                "body": body,
                "port": scope["client"][1],
            }
        )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")],
            }
        )
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else b"ok"})


@pytest.fixture
def echo() -> Iterator[tuple[_Echo, str]]:
    app = _Echo()
    with serve(app) as url:
        yield app, url


def _names(headers: list[tuple[str, str]]) -> list[str]:
    return [k.lower() for k, _ in headers]


def test_the_upstream_sees_the_clients_request_and_nothing_of_the_clients_library(
    echo: tuple[_Echo, str],
) -> None:
    app, url = echo
    with start_proxy(url + "/base") as proxy, httpx.Client(timeout=10) as client:
        answer = client.post(
            f"{proxy.url}/v1/embeddings?a=1&b=%20",
            content=b'{"x": 1}',
            headers={"content-type": "application/json", "x-custom": "kept", "connection": "keep-alive"},
        )
    assert answer.status_code == 200 and answer.text == "ok"
    (request,) = app.seen
    assert request["method"] == "POST" and request["target"] == b"/base/v1/embeddings?a=1&b=%20"
    assert request["body"] == b'{"x": 1}'
    headers = dict((k.lower(), v) for k, v in request["headers"])
    assert headers["host"] == url.removeprefix("http://")
    assert headers["content-length"] == "8" and headers["content-type"] == "application/json"
    assert headers["x-custom"] == "kept" and headers["accept-encoding"] == "identity"
    assert headers["user-agent"].startswith("python-httpx")  # the client's, not aiohttp's
    assert "connection" not in headers  # hop-by-hop: not forwarded
    names = _names(request["headers"])
    assert len(names) == len(set(names)), names  # each header once


def test_bodiless_methods_go_without_a_length_and_a_bodiless_post_says_zero(echo: tuple[_Echo, str]) -> None:
    app, url = echo
    with start_proxy(url) as proxy, httpx.Client(timeout=10) as client:
        got = client.get(f"{proxy.url}/v1/models")
        head = client.head(f"{proxy.url}/v1/models")
        posted = client.post(f"{proxy.url}/v1/models")
    assert posted.status_code == 200
    assert (got.status_code, got.text) == (200, "ok")
    assert head.status_code == 200 and head.headers["content-length"] == "2" and head.content == b""
    assert [r["method"] for r in app.seen] == ["GET", "HEAD", "POST"]
    get_headers, head_headers, post_headers = (dict(r["headers"]) for r in app.seen)
    assert "content-length" not in get_headers and "content-length" not in head_headers
    assert post_headers["content-length"] == "0"


def test_calls_one_after_another_reuse_one_upstream_connection(echo: tuple[_Echo, str]) -> None:
    app, url = echo
    with start_proxy(url) as proxy, httpx.Client(timeout=10) as client:
        for _ in range(5):
            assert client.post(f"{proxy.url}/v1/embeddings", content=b"{}").status_code == 200
    assert len({r["port"] for r in app.seen}) == 1


_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
_CALLER = f"00-{_TRACE_ID}-b7ad6b7169203331-01"


@pytest.fixture(params=["w3c", "other"])
def propagator(request: pytest.FixtureRequest) -> Iterator[None]:
    """The SDK's default propagator (trace context, then baggage), or the same two in the other order
    (which the proxy hands to the propagator API as it is)."""
    saved = propagate.get_global_textmap()
    if request.param == "other":
        propagate.set_global_textmap(
            CompositePropagator([W3CBaggagePropagator(), TraceContextTextMapPropagator()])
        )
    try:
        yield
    finally:
        propagate.set_global_textmap(saved)


def test_the_upstream_continues_the_callers_trace_with_its_state_and_baggage_as_sent(
    echo: tuple[_Echo, str], propagator: None
) -> None:
    app, url = echo
    caller = {"traceparent": _CALLER, "tracestate": "vendor=abc", "baggage": "team=rl"}
    with start_proxy(url) as proxy, httpx.Client(timeout=10) as client:
        assert client.get(f"{proxy.url}/v1/models", headers=caller).status_code == 200
        answer = client.post(
            f"{proxy.url}/ng-rollout/r-1/v1/chat/completions",
            json={"model": "m", "messages": []},
            headers=caller,
        )
        assert answer.status_code == 200
    not_captured, captured = app.seen
    for request in (not_captured, captured):
        names = _names(request["headers"])
        assert names.count("traceparent") == names.count("tracestate") == names.count("baggage") == 1
        headers = dict(request["headers"])
        assert headers["tracestate"] == "vendor=abc" and headers["baggage"] == "team=rl"
    # not a model call: no span of the proxy's between, the caller's own context goes on
    assert dict(not_captured["headers"])["traceparent"] == _CALLER
    # a model call: its span (a child in the caller's trace) is the upstream's parent
    version, trace_id, span_id, flags = dict(captured["headers"])["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", _TRACE_ID, "01") and span_id != "b7ad6b7169203331"


def test_without_a_caller_trace_the_upstream_gets_the_calls_new_trace(echo: tuple[_Echo, str]) -> None:
    app, url = echo
    with start_proxy(url) as proxy, httpx.Client(timeout=10) as client:
        assert client.get(f"{proxy.url}/v1/models").status_code == 200
        client.post(f"{proxy.url}/ng-rollout/r-1/v1/chat/completions", json={"model": "m", "messages": []})
    not_captured, captured = (dict(r["headers"]) for r in app.seen)
    assert "traceparent" not in not_captured  # nothing to continue
    assert len(captured["traceparent"].split("-")[1]) == 32
