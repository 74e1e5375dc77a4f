"""The capture proxy: the capture middleware in front of any OpenAI/Anthropic-compatible server.

``UpstreamProxy`` is a pure ASGI app that forwards each request to the upstream with httpx, streaming
both ways without buffering. ``build_proxy_app`` wraps it in the capture middleware and, outside that,
the request-size limit and ``opentelemetry-instrumentation-asgi``'s HTTP server span (without its
per-chunk send/receive spans), which is shown query values and secret headers redacted.

A call ends when it is over, whatever the other side does: the upstream gets ``upstream_timeout`` seconds
for each byte; a client that leaves is noticed while the upstream thinks, not only while it streams; a
captured stream ends for the client at its last event even if the upstream holds the response open.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import httpx
import orjson
import uvicorn
from opentelemetry import propagate
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from opentelemetry.util.http import remove_url_credentials

from ._asgi import ASGIApp, Message, Receive, Scope, Send
from ._middleware import (
    SCOPE_RESPONSE_COMPLETE,
    ModelCallCaptureMiddleware,
    server_span_details,
    unprefixed_raw_path,
)
from ._proxy_guards import SCOPE_QUERY_STRING, QueryRedaction, RequestSizeLimit
from ._settings import CaptureSettings, ProxySettings, WriterSettings, upstream_from_environ
from ._telemetry import build_tracer_provider

_logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 §7.6.1) are never forwarded; content-length is recomputed by httpx and
# host names the upstream. accept-encoding is dropped, and the proxy's clients ask for identity, so the
# upstream answers uncompressed (the client then receives it uncompressed too); an upstream that compresses
# anyway reaches the client as sent and is decoded for the record only.
_REQUEST_DROP = {
    b"host",
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"content-length",
    b"accept-encoding",
}
_RESPONSE_DROP = {b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding", b"upgrade"}


_SHARDS = 16
_KEEPALIVE_PER_SHARD = 16
_CONNECT_TIMEOUT = 30.0
_DRAIN_BOUND = 10.0  # seconds a shutdown waits for cancelled calls to hand over their records
# Sending failed this way on a reused keep-alive connection, before any byte of the answer: the upstream
# closed it while idle just as the request went out. Safe to send again, once, on a fresh connection.
_STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)

_T = TypeVar("_T")


class UpstreamProxy:
    """Forwards every HTTP request to ``upstream`` (scheme://host[:port][/base]), path and query kept."""

    def __init__(
        self,
        upstream: str,
        *,
        on_shutdown: list[Callable[[], None]] | None = None,
        timeout: httpx.Timeout | None = None,
        settings: ProxySettings | None = None,
    ) -> None:
        self.upstream = httpx.URL(upstream.rstrip("/"))
        self.shown_upstream = display_url(upstream.rstrip("/"))  # for messages: never its password
        if timeout is None:
            limit = (settings or ProxySettings()).upstream_timeout
            timeout = httpx.Timeout(limit, connect=min(_CONNECT_TIMEOUT, limit), pool=None)
        self._timeout = timeout
        self._clients: list[httpx.AsyncClient] = []
        self._fresh: httpx.AsyncClient | None = None  # no keep-alive: the retry of a stale connection
        self._turn = itertools.count()
        self._on_shutdown = on_shutdown or []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._forward(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                for callback in self._on_shutdown:
                    try:
                        callback()
                    except Exception:
                        _logger.exception("proxy shutdown step failed")
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _next_client(self) -> httpx.AsyncClient:
        """Round-robin over a few clients. httpcore's pool checks every pooled connection on every request
        (a readability syscall each), so one pool of N connections costs O(N) per request: at 64
        concurrent calls the proxy spent most of its time there. Shards keep each pool small."""
        if not self._clients:
            self._clients = [self._client(_KEEPALIVE_PER_SHARD) for _ in range(_SHARDS)]
        return self._clients[next(self._turn) % _SHARDS]

    def _client(self, keepalive: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=keepalive)
        headers = {"accept-encoding": "identity"}  # httpx would ask for gzip: see _REQUEST_DROP
        return httpx.AsyncClient(timeout=self._timeout, limits=limits, headers=headers, trust_env=False)

    async def aclose(self) -> None:
        clients, self._clients = self._clients, []
        if self._fresh is not None:
            clients.append(self._fresh)
            self._fresh = None
        for client in clients:
            await client.aclose()

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client left before sending its request
        path = self.upstream.raw_path.rstrip(b"/") + unprefixed_raw_path(scope)
        query = scope.get(SCOPE_QUERY_STRING) or scope.get("query_string")
        if query:
            path += b"?" + query
        url = self.upstream.copy_with(raw_path=path)
        trace_headers: dict[str, str] = {}
        propagate.inject(trace_headers)  # this proxy's span is the upstream's parent (baggage passes as sent)
        trace_headers.pop("baggage", None)
        drop = _REQUEST_DROP | {k.encode() for k in trace_headers}
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in drop]
        headers += [(k.encode(), v.encode()) for k, v in trace_headers.items()]
        client = self._next_client()
        request = client.build_request(scope["method"], url, headers=headers, content=body)
        # The client may leave at any time, also while the upstream has not answered yet.
        disconnected = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, disconnected))
        try:
            response = await self._answer(client, request, disconnected, send)
            if response is None:
                return  # answered with an error, or the client left: the call is over
            try:
                await self._relay(scope, response, disconnected, send)
            finally:
                await response.aclose()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _answer(
        self, client: httpx.AsyncClient, request: httpx.Request, disconnected: asyncio.Event, send: Send
    ) -> httpx.Response | None:
        """The upstream's response (headers read, body not yet), or None once the client has left or has
        been answered 504/502 (the message names the upstream without its credentials)."""
        try:
            return await _unless(self._send(client, request), disconnected)
        except httpx.TimeoutException as exc:
            message = (
                f"upstream {self.shown_upstream} timed out: {exc!r} (upstream timeout {self._timeout.read} s)"
            )
            await _send_error(send, 504, "upstream_timeout", message)
        except httpx.HTTPError as exc:
            await _send_error(
                send, 502, "upstream_unreachable", f"upstream {self.shown_upstream} failed: {exc!r}"
            )
        return None

    async def _send(self, client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
        """Send; a request that failed on a reused keep-alive connection before any byte of the answer
        arrived (the upstream closed it while idle, just as the request went out) goes once more on a fresh
        connection, as HTTP clients do. The body is in memory, so sending it again is safe."""
        connection = _ConnectionWatch()
        request.extensions["trace"] = connection.trace
        try:
            return await client.send(request, stream=True)
        except _STALE_CONNECTION as exc:
            if connection.opened:
                raise  # a fresh connection failed: the upstream's own failure
            _logger.debug(
                "upstream %s closed a kept-alive connection (%r); sending again", self.shown_upstream, exc
            )
        if self._fresh is None:
            self._fresh = self._client(0)
        return await self._fresh.send(request, stream=True)

    async def _relay(
        self, scope: Scope, response: httpx.Response, disconnected: asyncio.Event, send: Send
    ) -> None:
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _RESPONSE_DROP]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        # A compressed body goes on past its last event (the encoding's own end): relay it whole.
        may_stop = response.headers.get("content-encoding", "identity").strip().lower() == "identity"
        async with contextlib.aclosing(_until(response.aiter_raw(), disconnected)) as chunks:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if may_stop and scope.get(SCOPE_RESPONSE_COMPLETE):
                    break  # the capture saw the stream's last event: the call is over, whatever the upstream does
        if not disconnected.is_set():
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class _ConnectionWatch:
    """An httpcore ``trace`` extension that notes whether a request opened its own connection."""

    __slots__ = ("opened",)

    def __init__(self) -> None:
        self.opened = False

    async def trace(self, event: str, info: dict[str, Any]) -> None:
        if ".connect_" in event:  # connection.connect_tcp / connect_unix_socket
            self.opened = True


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _watch_disconnect(receive: Receive, disconnected: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            disconnected.set()
            return


async def _unless(awaitable: Awaitable[_T], stop: asyncio.Event) -> _T | None:
    """What ``awaitable`` returns, or None if ``stop`` is set first (it is then cancelled)."""
    task = asyncio.ensure_future(awaitable)
    stop_wait = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # this call is cancelled itself (a shutdown past its bound)
        raise
    finally:
        stop_wait.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await task
    return None


async def _until(chunks: AsyncIterator[bytes], stop: asyncio.Event) -> AsyncGenerator[bytes, None]:
    """Yield upstream chunks until the client disconnects (then the upstream stream is abandoned)."""
    iterator = chunks.__aiter__()
    stop_wait = asyncio.ensure_future(stop.wait())
    try:
        while True:
            next_chunk = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({next_chunk, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if next_chunk not in done:
                next_chunk.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await next_chunk
                return
            try:
                yield next_chunk.result()
            except StopAsyncIteration:
                return
    finally:
        stop_wait.cancel()


async def _send_error(send: Send, status: int, kind: str, message: str) -> None:
    body = orjson.dumps({"error": {"type": kind, "message": message}})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _FinishCallsFirst:
    """Holds the lifespan's shutdown, which flushes and closes the record writer, until the HTTP calls in
    flight have returned (within ``_DRAIN_BOUND``): when a shutdown passes its bound uvicorn cancels them,
    and each still hands its ``cancelled`` record to the writer on its way out."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._calls = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._shutdown_after_calls(receive), send)
            return
        self._calls += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self._calls -= 1
            if not self._calls:
                self._idle.set()

    def _shutdown_after_calls(self, receive: Receive) -> Receive:
        async def receive_lifespan() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), _DRAIN_BOUND)
            return message

        return receive_lifespan


def build_proxy_app(
    upstream: str,
    *,
    settings: CaptureSettings | None = None,
    writer: WriterSettings | None = None,
    tracer_provider: TracerProvider | None = None,
    proxy: ProxySettings | None = None,
) -> ASGIApp:
    """The proxy app: query redaction → HTTP server span → request-size limit → capture middleware →
    upstream forwarding.

    Without ``tracer_provider`` one is built from ``writer`` (records when it names a directory) and the
    SDK's ``OTEL_*`` configuration (OTLP when ``OTEL_TRACES_EXPORTER`` asks for it), and shut down, so
    every acknowledged record is flushed, when the server's lifespan ends. Settings not passed are read
    from the environment.
    """
    settings = settings if settings is not None else CaptureSettings.from_environ()
    proxy = proxy if proxy is not None else ProxySettings.from_environ()
    shutdown: list[Callable[[], None]] = []
    if tracer_provider is None:
        tracer_provider = build_tracer_provider(
            settings, writer if writer is not None else WriterSettings.from_environ()
        )
        shutdown.append(tracer_provider.shutdown)
    forward = UpstreamProxy(upstream, on_shutdown=shutdown, settings=proxy)
    capture = ModelCallCaptureMiddleware(
        forward, tracer_provider=tracer_provider, settings=settings, span_kind=SpanKind.CLIENT
    )
    limited = RequestSizeLimit(capture, proxy.max_request_bytes)
    return _FinishCallsFirst(
        QueryRedaction(
            OpenTelemetryMiddleware(
                limited,
                tracer_provider=tracer_provider,
                exclude_spans=["receive", "send"],
                default_span_details=server_span_details,  # named without the rollout prefix
                # whatever OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST/_RESPONSE ask for
                http_capture_headers_sanitize_fields=list(proxy.sanitize_headers),
            )
        )
    )


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio turns TCP_NODELAY on only for sockets whose proto says TCP, and without
    # it every keep-alive response waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # Listen now, before the server runs: "listening on ..." is printed as soon as this returns, and a client
    # that connects before uvicorn starts must wait in the backlog, not be refused.
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def display_url(url: str) -> str:
    """``url`` fit to print: credentials in it read ``REDACTED:REDACTED@``."""
    return remove_url_credentials(url)


@dataclass
class RunningProxy:
    """A proxy served by uvicorn in a background thread (for the demo, tests and embedding)."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        """Stop serving; in-flight calls finish (those past ``ProxySettings.shutdown_timeout`` are
        cancelled) and every acknowledged record is on disk."""
        self.server.should_exit = True
        self.thread.join()

    def __enter__(self) -> RunningProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_proxy(
    upstream: str,
    capture_dir: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    settings: CaptureSettings | None = None,
    writer: WriterSettings | None = None,
    tracer_provider: TracerProvider | None = None,
    proxy: ProxySettings | None = None,
) -> RunningProxy:
    """Serve the capture proxy in a background thread; returns once it accepts connections.
    ``capture_dir`` is a shortcut for ``writer=WriterSettings.from_environ(directory=capture_dir)``."""
    if writer is None:
        writer = WriterSettings.from_environ(directory=capture_dir)
    elif capture_dir is not None:
        raise TypeError("pass the capture directory either as `capture_dir` or in `writer`, not both")
    proxy = proxy if proxy is not None else ProxySettings.from_environ()
    app = build_proxy_app(
        upstream, settings=settings, writer=writer, tracer_provider=tracer_provider, proxy=proxy
    )
    sock = bind_socket(host, port)
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=proxy.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="otel-capture-proxy", daemon=True
    )
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the capture proxy failed to start; see the log")
        threading.Event().wait(0.01)
    return RunningProxy(socket_url(sock), server, thread)


def proxy_app_from_environ() -> ASGIApp:
    """App factory for ``uvicorn --factory`` (and ``otel-capture proxy --workers N``): the upstream comes
    from ``OTEL_CAPTURE_UPSTREAM``, everything else from the usual variables. Each worker process builds
    its own writer; they share the capture files through ``flock``."""
    return build_proxy_app(upstream_from_environ())
