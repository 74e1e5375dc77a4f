"""The capture proxy: the capture middleware in front of any OpenAI/Anthropic-compatible server.

``UpstreamProxy`` is a pure ASGI app that forwards each request to the upstream over one pool of
aiohttp connections (``_Pool`` in :mod:`.pool`: aiohttp's connector and response parser, without
``ClientSession``'s per-request work), streaming both ways without buffering. ``build_proxy_app`` wraps it
in the capture middleware and, outside that, the request-size limit and the lean HTTP server span
(``LeanServerSpanMiddleware``), which redacts query values and credential headers itself.

A call ends when it is over, whatever the other side does: the upstream gets ``upstream_timeout`` seconds
for each byte; a client that leaves is noticed while the upstream thinks, not only while it streams; a
captured stream ends for the client at its last event even if the upstream holds the response open
(contract D28, D29).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
import httptools
import uvicorn
import uvloop
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from opentelemetry.util.http import remove_url_credentials
from yarl import URL

from .._asgi import ASGIApp, Message, Receive, Scope, Send, send_json
from .._capture import (
    SCOPE_LOCAL_RESPONSE,
    SCOPE_RESPONSE_COMPLETE,
    SCOPE_UPSTREAM,
    SCOPE_UPSTREAM_REQUEST_ID,
    ModelCallCaptureMiddleware,
    current_trace_fields,
)
from .._correlation import server_span_details, unprefixed_raw_path
from .._notices import RateLimitedNotice, notify
from .._records.schema import REFUSED_OVER_CAPACITY
from .._settings import CaptureSettings, ProxySettings, WriterSettings, upstream_from_environ, upstream_url
from .._telemetry import LeanServerSpanMiddleware, build_tracer_provider
from .guards import CallLimit, RequestSizeLimit, limit_client_buffers
from .pool import MAX_HEADER_LINE_BYTES, UpstreamHeadTooLarge, _Pool, _Response, _stale
from .redirects import relocate

_logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 §7.6.1) are never forwarded; content-length is recomputed (``_forward``) and
# host names the upstream. accept-encoding is replaced by ``identity``, so the upstream answers
# uncompressed (the client then receives it uncompressed too); an upstream that compresses anyway reaches
# the client as sent (``_Pool`` never decodes) and is decoded for the record only.
_REQUEST_DROP = frozenset(
    {
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
)
_RESPONSE_DROP = frozenset(
    {b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
)
# Methods sent without Content-Length when they carry no body (as aiohttp sends them); others say 0.
_BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"})

# The most relayed to the client in one piece. aiohttp hands over all it has buffered (up to a few hundred
# KiB after one 256 KiB socket read), and a piece is written whole into a slow client's connection buffer
# before flow control pauses the relay: bounded here, that buffer holds at most this plus its high-water
# mark per client (contract D33, D45).
_RELAY_CHUNK = 64 * 1024
_MAX_REQUEST_ID = 200  # characters of an upstream's x-request-id kept in the record
_DRAIN_BOUND = 10.0  # seconds a shutdown waits for cancelled calls to hand over their records


class UpstreamProxy:
    """Forwards every HTTP request to ``upstream`` (scheme://host[:port][/base]), path and query kept."""

    def __init__(
        self,
        upstream: str,
        *,
        on_shutdown: list[Callable[[], None]] | None = None,
        settings: ProxySettings | None = None,
    ) -> None:
        base = URL(upstream.rstrip("/"))
        self._upstream = base
        self._origin = base.origin()
        self._base_path = base.raw_path.rstrip("/").encode("latin-1")
        self.shown_upstream = display_url(upstream.rstrip("/"))  # for the log: never its password
        # for each record's `writer.upstream`: no user, password or query (a key may ride in either)
        self.upstream_name = str(base.with_user(None).with_query(None)).rstrip("/")
        self._failure_notice = RateLimitedNotice(60.0)
        # credentials in the URL go as Basic auth, unless the client sends its own authorization
        auth = aiohttp.BasicAuth(base.user, base.password or "").encode() if base.user else None
        self._auth = b"authorization: " + auth.encode("latin-1") + b"\r\n" if auth else b""
        settings = settings or ProxySettings()
        self.timeout = settings.upstream_timeout
        self.calls = CallLimit(settings.max_concurrent_calls)
        self._pool: _Pool | None = None
        self._fresh: _Pool | None = None  # no keep-alive: the retry of a stale connection
        self._closed = False  # after the lifespan's shutdown no pool is opened again (none left unclosed)
        self._on_shutdown = on_shutdown or []
        self._drops: dict[frozenset[str], frozenset[bytes]] = {}  # trace header names -> headers not passed

    def _drop_for(self, trace_headers: dict[str, str]) -> frozenset[bytes]:
        """The request headers not passed on: hop-by-hop ones and the client's own trace headers (this
        proxy's replace them), one set per propagator's header names."""
        names = frozenset(trace_headers)
        drop = self._drops.get(names)
        if drop is None:
            drop = self._drops[names] = _REQUEST_DROP | {k.lower().encode("latin-1") for k in names}
        return drop

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

    async def aclose(self) -> None:
        self._closed = True
        pools = [p for p in (self._pool, self._fresh) if p is not None]
        self._pool = self._fresh = None
        for pool in pools:
            await pool.close()

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Inside the capture: a refused model call is recorded as refused, a retry to come (503, Retry-After)
        scope[SCOPE_UPSTREAM] = self.upstream_name
        if not self.calls.enter():
            scope[SCOPE_LOCAL_RESPONSE] = REFUSED_OVER_CAPACITY
            await self.calls.refuse(send)
            return
        try:
            await self._forward_one(scope, receive, send)
        finally:
            self.calls.leave()

    async def _forward_one(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client left before sending its request
        method: str = scope["method"]
        target = self._base_path + unprefixed_raw_path(scope)
        query: bytes = scope.get("query_string", b"")
        if query:
            target += b"?" + query
        trace_headers = current_trace_fields()  # this proxy's span is the upstream's parent
        drop = self._drop_for(trace_headers) if trace_headers else _REQUEST_DROP
        lines: list[bytes] = []
        auth = self._auth
        for k, v in scope.get("headers", ()):
            name = k.lower()
            if name not in drop:
                lines += (k, b": ", v, b"\r\n")
                if name == b"authorization":
                    auth = b""  # the client's own authorization goes, not the URL's credentials
        for k, v in trace_headers.items():
            if "\r" not in v and "\n" not in v:
                lines += (k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n")
        lines.append(b"accept-encoding: identity\r\n")  # (contract D30)
        lines.append(auth)
        if body or method not in _BODYLESS_METHODS:
            lines += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        headers = b"".join(lines)
        # The client may leave at any time, also while the upstream has not answered yet: one watcher per
        # call cancels this task then (no per-chunk wait on two futures) (contract D28).
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)  # (given the loop: no second look-up, a system call on 3.11)
        assert task is not None
        watch = _ClientWatch(task)
        watcher = loop.create_task(watch.run(receive))
        try:
            await self._exchange(scope, method, target, headers, body, send)
        except asyncio.CancelledError:
            if not watch.left:
                raise  # cancelled from outside (a shutdown past its bound)
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+: cancellations still requested
            if uncancel is not None and uncancel() > 0:
                raise  # cancelled from outside as well
            # the client left: the upstream's connection is closed; the capture saw the disconnect
        finally:
            watch.active = False
            watcher.cancel()

    async def _exchange(
        self, scope: Scope, method: str, target: bytes, headers: bytes, body: bytes, send: Send
    ) -> None:
        try:
            response = await self._request(method, target, headers, body)
        except asyncio.TimeoutError as exc:  # no byte before the headers within the timeout (contract D28)
            self._upstream_failed("did not answer within the upstream timeout (%s s): %r", self.timeout, exc)
            message = f"the upstream did not answer within {self.timeout} s"
            await send_json(send, 504, {"error": {"type": "upstream_timeout", "message": message}})
            return
        except UpstreamHeadTooLarge as exc:
            self._upstream_failed(
                "sent a response header line over %s bytes: %s", MAX_HEADER_LINE_BYTES, exc.message
            )
            message = f"the upstream sent a response header line over this proxy's limit of {MAX_HEADER_LINE_BYTES} bytes"
            await send_json(send, 502, {"error": {"type": "upstream_header_too_large", "message": message}})
            return
        except aiohttp.ClientError as exc:
            self._upstream_failed("could not be reached (is it down?): %r", exc)
            message = "the capture proxy could not reach its upstream; its log says why"
            await send_json(send, 502, {"error": {"type": "upstream_unreachable", "message": message}})
            return
        complete = False
        try:
            await self._relay(scope, response, target, send)
            complete = True
        finally:
            if complete and response.content.is_eof():
                response.release()  # read to its end: the connection goes back to the pool
            else:
                response.close()  # stopped early, failed or cancelled: the connection is not reused

    def _upstream_failed(self, what: str, *args: object) -> None:
        """The log, not the client, learns where the upstream is and what failed: the first time, then at
        most once a minute with the count since (a client's error body names neither)."""
        held = self._failure_notice.note()
        if held is not None:
            since = f" ({held} more since the last line)" if held else ""
            notify(_logger, logging.WARNING, "upstream %s " + what + "%s", self.shown_upstream, *args, since)

    async def _request(self, method: str, target: bytes, headers: bytes, body: bytes) -> _Response:
        """Send; a request the upstream dropped before any byte of the answer (it closed the kept-alive
        connection while idle, just as the request went out) goes once more on a fresh connection, as HTTP
        clients do. The body is in memory, so sending it again is safe (contract D31)."""
        if self._closed:
            raise aiohttp.ClientConnectionError("the proxy is shutting down")
        if self._pool is None:
            self._pool = _Pool(self._origin, self.timeout, keep_alive=True)
        try:
            return await self._pool.send(method, target, headers, body)
        except aiohttp.ClientError as exc:
            if not _stale(exc):
                raise
            _logger.debug("upstream %s dropped a request (%r); sending again", self.shown_upstream, exc)
        if self._closed:
            raise aiohttp.ClientConnectionError("the proxy is shutting down")
        if self._fresh is None:
            self._fresh = _Pool(self._origin, self.timeout, keep_alive=False)
        return await self._fresh.send(method, target, headers, body)

    async def _relay(self, scope: Scope, response: _Response, target: bytes, send: Send) -> None:
        headers = [(k, v) for k, v in response.raw_headers if k.lower() not in _RESPONSE_DROP]
        request_id = response.headers.get("x-request-id")
        if request_id:  # the upstream's own id of this answer (OpenAI, vLLM --enable-request-id-headers)
            scope[SCOPE_UPSTREAM_REQUEST_ID] = request_id[:_MAX_REQUEST_ID]
        if 300 <= response.status < 400:  # a redirect leads back through the proxy, with the rollout
            requested = self._origin.join(URL(target.decode("latin-1"), encoded=True))
            headers = relocate(headers, scope, requested, self._upstream)
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        # A compressed body goes on past its last event (the encoding's own end): relay it whole.
        may_stop = response.headers.get("content-encoding", "identity").strip().lower() == "identity"
        content = response.content
        while True:
            try:
                # b"" at the end of the body; at most _RELAY_CHUNK at once, so what waits in the client
                # connection's write buffer stays within uvicorn's high-water mark plus one piece; only an
                # empty buffer waits. The price: ~5 % more CPU on a fast 512-event stream than readany().
                chunk = content.read_nowait(_RELAY_CHUNK) or await content.read(_RELAY_CHUNK)
            except asyncio.TimeoutError as exc:  # recorded under a name of its own, whatever the client
                raise ReadTimeout(f"no byte from the upstream for {self.timeout} s") from exc
            if not chunk:
                break
            if content.at_eof():  # the body's last bytes end the response in one message, as a server's
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if may_stop and scope.get(SCOPE_RESPONSE_COMPLETE):
                # the capture saw the stream's last event: the call is over, whatever the upstream does
                break  # (contract D29)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ReadTimeout(TimeoutError):
    """The upstream sent no byte of its body for the upstream timeout: the stream is cut (the record's
    ``failure.exception`` names this class)."""


class _ClientWatch:
    """Waits for the client's ``http.disconnect`` and then cancels the call's task, once, while the call
    still forwards."""

    __slots__ = ("active", "left", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.active = True
        self.left = False

    async def run(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if self.active:
            self.left = True
            self.task.cancel()


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class _FinishCallsFirst:
    """Holds the lifespan's shutdown, which flushes and closes the record writer, until the HTTP calls in
    flight have returned (within ``_DRAIN_BOUND``): when a shutdown passes its bound uvicorn cancels them,
    and each still hands its ``cancelled`` record to the writer on its way out (contract D11)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._calls = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._shutting_down = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._shutdown_after_calls(receive), send)
            return
        self._calls += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not self._shutting_down:
                raise
            # The documented end of a call past --shutdown-timeout: its record says `cancelled`; the log
            # gets one line, not the server's stack trace of an exception in the app.
            notify(
                _logger,
                logging.WARNING,
                "shutdown: a call still running after the shutdown timeout was cancelled (recorded as cancelled)",
            )
        finally:
            self._calls -= 1
            if not self._calls:
                self._idle.set()

    def _shutdown_after_calls(self, receive: Receive) -> Receive:
        async def receive_lifespan() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                self._shutting_down = True
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
    """The proxy app: HTTP server span (query values and credential headers redacted) → request-size
    limit → capture middleware → upstream forwarding.

    Without ``tracer_provider`` one is built from ``writer`` (records when it names a directory) and the
    SDK's ``OTEL_*`` configuration (OTLP when ``OTEL_TRACES_EXPORTER`` asks for it), and shut down, so
    every acknowledged record is flushed, when the server's lifespan ends. Settings not passed are read
    from the environment.
    """
    upstream = upstream_url("upstream", upstream)  # its parts go into every request head
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
        LeanServerSpanMiddleware(
            limited,
            tracer_provider=tracer_provider,
            default_span_details=server_span_details,  # named without the rollout prefix
            # url.query values are redacted by the span itself; credential headers always are
            capture_request_headers=proxy.capture_request_headers,
            capture_response_headers=proxy.capture_response_headers,
            sanitize_headers=proxy.sanitize_headers,
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


def server_options(proxy: ProxySettings) -> dict[str, Any]:
    """uvicorn's options for the proxy, however it is started (``start_proxy``, the CLI, its workers): the
    lifespan on (the writer is flushed at its shutdown), no access log, the graceful-shutdown bound, and
    uvicorn's fastest stack, named rather than left to "auto" (which takes h11 and asyncio when they are
    missing): httptools' parser and uvloop's event loop, both dependencies of the package for this
    (pyproject says the measured reason). Each option's value is the module's own name."""
    return {
        "http": httptools.__name__,
        "loop": uvloop.__name__,
        "lifespan": "on",
        "log_level": "warning",
        "access_log": False,
        "timeout_graceful_shutdown": proxy.shutdown_timeout,
    }


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
    sock = limit_client_buffers(bind_socket(host, port))
    server = uvicorn.Server(uvicorn.Config(app, **server_options(proxy)))
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
