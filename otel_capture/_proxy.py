"""The capture proxy: the capture middleware in front of any OpenAI/Anthropic-compatible server.

``UpstreamProxy`` is a pure ASGI app that forwards each request to the upstream with httpx, streaming
both ways without buffering. ``build_proxy_app`` wraps it in the capture middleware and, outside that,
``opentelemetry-instrumentation-asgi``'s HTTP server span (without its per-chunk send/receive spans).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType

import httpx
import orjson
import uvicorn
from opentelemetry import propagate
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind

from ._asgi import ASGIApp, Receive, Scope, Send
from ._middleware import ModelCallCaptureMiddleware, server_span_details, unprefixed_raw_path
from ._settings import CaptureSettings, WriterSettings, upstream_from_environ
from ._telemetry import build_tracer_provider

_logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 §7.6.1) are never forwarded; content-length is recomputed by httpx and
# host names the upstream. accept-encoding is dropped so the upstream answers uncompressed and the
# capture sees the bytes the model produced (the client then receives them uncompressed too).
_REQUEST_DROP = {
    b"host", b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
    b"upgrade", b"content-length", b"accept-encoding",
}
_RESPONSE_DROP = {b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding", b"upgrade"}


_SHARDS = 16
_KEEPALIVE_PER_SHARD = 16


class UpstreamProxy:
    """Forwards every HTTP request to ``upstream`` (scheme://host[:port][/base]), path and query kept."""

    def __init__(
        self,
        upstream: str,
        *,
        on_shutdown: list[Callable[[], None]] | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> None:
        self.upstream = httpx.URL(upstream.rstrip("/"))
        self._timeout = timeout or httpx.Timeout(connect=30.0, read=None, write=None, pool=None)
        self._clients: list[httpx.AsyncClient] = []
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
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=_KEEPALIVE_PER_SHARD)
            self._clients = [
                httpx.AsyncClient(timeout=self._timeout, limits=limits, trust_env=False) for _ in range(_SHARDS)
            ]
        return self._clients[next(self._turn) % _SHARDS]

    async def aclose(self) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            await client.aclose()

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client left before sending its request
        path = self.upstream.raw_path.rstrip(b"/") + unprefixed_raw_path(scope)
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        url = self.upstream.copy_with(raw_path=path)
        trace_headers: dict[str, str] = {}
        propagate.inject(trace_headers)  # this proxy's span is the upstream's parent (baggage passes as sent)
        trace_headers.pop("baggage", None)
        drop = _REQUEST_DROP | {k.encode() for k in trace_headers}
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in drop]
        headers += [(k.encode(), v.encode()) for k, v in trace_headers.items()]
        client = self._next_client()
        request = client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            await _send_error(send, 504, "upstream_timeout", f"upstream {self.upstream} timed out: {exc}")
            return
        except httpx.HTTPError as exc:
            await _send_error(send, 502, "upstream_unreachable", f"upstream {self.upstream} failed: {exc!r}")
            return
        try:
            await self._relay(response, receive, send)
        finally:
            await response.aclose()

    async def _relay(self, response: httpx.Response, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _RESPONSE_DROP]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        disconnected = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, disconnected))
        try:
            async for chunk in _until(response.aiter_raw(), disconnected):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not disconnected.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


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


async def _until(chunks: AsyncIterator[bytes], stop: asyncio.Event) -> AsyncIterator[bytes]:
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
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    })
    await send({"type": "http.response.body", "body": body})


def build_proxy_app(
    upstream: str,
    *,
    settings: CaptureSettings | None = None,
    writer: WriterSettings | None = None,
    tracer_provider: TracerProvider | None = None,
) -> ASGIApp:
    """The proxy app: HTTP server span → capture middleware → upstream forwarding.

    Without ``tracer_provider`` one is built from ``writer`` (records when it names a directory) and the
    SDK's ``OTEL_*`` configuration (OTLP when ``OTEL_TRACES_EXPORTER`` asks for it), and shut down, so
    every acknowledged record is flushed, when the server's lifespan ends. Settings not passed are read
    from the environment.
    """
    settings = settings if settings is not None else CaptureSettings.from_environ()
    shutdown: list[Callable[[], None]] = []
    if tracer_provider is None:
        tracer_provider = build_tracer_provider(settings, writer if writer is not None else WriterSettings.from_environ())
        shutdown.append(tracer_provider.shutdown)
    proxy = UpstreamProxy(upstream, on_shutdown=shutdown)
    capture = ModelCallCaptureMiddleware(
        proxy, tracer_provider=tracer_provider, settings=settings, span_kind=SpanKind.CLIENT
    )
    return OpenTelemetryMiddleware(
        capture, tracer_provider=tracer_provider, exclude_spans=["receive", "send"],
        default_span_details=server_span_details,  # named without the rollout prefix
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


@dataclass
class RunningProxy:
    """A proxy served by uvicorn in a background thread (for the demo, tests and embedding)."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        """Stop serving; in-flight calls finish and every acknowledged record is on disk."""
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
) -> RunningProxy:
    """Serve the capture proxy in a background thread; returns once it accepts connections.
    ``capture_dir`` is a shortcut for ``writer=WriterSettings.from_environ(directory=capture_dir)``."""
    if writer is None:
        writer = WriterSettings.from_environ(directory=capture_dir)
    elif capture_dir is not None:
        raise TypeError("pass the capture directory either as `capture_dir` or in `writer`, not both")
    app = build_proxy_app(upstream, settings=settings, writer=writer, tracer_provider=tracer_provider)
    sock = bind_socket(host, port)
    config = uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="otel-capture-proxy", daemon=True)
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
