"""The servers the HTTP benchmarks load, each run in its own process:

    python bench/_servers.py VARIANT [--app asgi|starlette] [--events N] [--capture-dir DIR] [--upstream URL]

prints ``listening on <url>`` as its first line, then serves on 127.0.0.1 (a free port) with uvicorn, one
worker, the same settings for every variant (those of ``otel-capture proxy``). ``GET /_bench/stats``
answers the capture counters (records, fsyncs, batches, failures) so the benchmark can compute fsyncs per
record over exactly its measurement window; that route sits outside everything else.

Variants:

* ``bare``: the upstream alone, a raw ASGI app that answers a fixed chat completion at once;
* ``spans``: the upstream inside ``ModelCallCaptureMiddleware`` with an SDK tracer provider and no
  capture directory (no record; no processor either, so no span is built, only its context:
  ``otel_capture._spans``);
* ``capture``: the same plus the ``model_call_jsonl`` exporter on a synchronous processor (durable
  records, group commit; the exporter alone ignores spans, so none is built);
* ``capture-nosync``: ``capture`` with the writer's fsync replaced by a no-op (diagnostic only: the CPU
  cost of capture without the disk);
* ``capture-traced``: ``capture`` plus one processor that does nothing but sees the spans, so they are
  built as for an OTLP exporter (without the exporter's own work);
* ``gym``: the upstream inside the per-call-fsync baseline (``_gym_baseline.py``);
* ``fwd-httpx``, ``fwd-httpx16``, ``fwd-httpcore``, ``fwd-aiohttp``, ``fwd-aiohttp-conn``, ``fwd-raw``:
  minimal forwarders to ``--upstream`` (no capture, no span), one client each: one ``httpx.AsyncClient``;
  16 of them round-robin (the proxy's shards); one ``httpcore.AsyncConnectionPool``; one
  ``aiohttp.ClientSession``; aiohttp's connector and response protocol without the session; a bench-only
  asyncio protocol with httptools' response parser and a stack of idle kept-alive connections (the floor).
  They measure what the proxy's upstream client costs per call;
* ``proxy``: the real ``otel-capture proxy`` CLI (``--upstream URL``, ``--capture-dir`` when given), with
  the stats route wrapped around the app it builds, and its listening socket made with
  ``proto=IPPROTO_TCP`` (see :func:`bind_tcp_socket`); ``proxy-as-shipped`` leaves the socket as the CLI
  makes it.

Every in-process variant listens on a socket from :func:`bind_tcp_socket` too.

``--app starlette`` serves a Starlette model app (one ``POST /v1/chat/completions`` route that reads the
body and answers at once) instead of the raw ASGI one: ``bare`` then is that app alone (run it under
``opentelemetry-instrument`` for zero-code capture: the stats route then reports the writer of the global
tracer provider's ``model_call_jsonl`` exporter), ``gym`` is that app with the baseline middleware as its
first user middleware (where NeMo Gym installs its own), ``server-span`` is that app inside contrib's
``OpenTelemetryMiddleware`` alone (the HTTP server span zero-code added until issue #12, without our capture
middleware), ``lean-server-span`` that app inside ``LeanServerSpanMiddleware`` alone (the one it adds now). ``--events N`` makes the model stream N Chat
Completions chunks (one SSE event per ASGI message, then the finish and usage chunks and ``[DONE]``)
instead of the JSON answer.

``BENCH_SEES_SPANS=1`` adds such a processor to the variant's tracer provider, and to the global one (the one
``opentelemetry-instrument`` set), so that the spans are built: ``spans`` with it is "spans only". ``BENCH_UVICORN_HTTP`` and ``BENCH_UVICORN_LOOP`` (``h11``, ``asyncio``) override uvicorn's ``auto`` choice, to show
what the stack itself is worth. ``BENCH_CPROFILE=<file>`` in the environment runs the server under ``cProfile`` and dumps the stats to
``<file>`` when it stops (``bench/profile_goals.py`` uses it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: F401  (puts the repository on sys.path)

RESPONSE_BODY = orjson.dumps(
    {
        "id": "chatcmpl-bench0001",
        "object": "chat.completion",
        "created": 1753983920,
        "model": "bench-model",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "The capital of France is Paris. It has been the country's capital since the tenth "
                    "century and is its largest city, with about two million people in the city proper.",
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 182,
            "completion_tokens": 38,
            "total_tokens": 220,
            "prompt_tokens_details": {"cached_tokens": 64, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        },
        "service_tier": "default",
        "system_fingerprint": "fp_bench",
    }
)

REQUEST_BODY = orjson.dumps(
    {
        "model": "bench-model",
        "messages": [
            {
                "role": "system",
                "content": "You are a careful assistant. Answer briefly and cite no sources. " * 6,
            },
            {
                "role": "user",
                "content": "Which city is the capital of France, and since when has it been? " * 8,
            },
        ],
        "temperature": 0.7,
        "top_p": 0.95,
        "max_tokens": 256,
        "seed": 7,
    }
)

_RESPONSE_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(RESPONSE_BODY)).encode()),
]
_STREAM_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def chat_events(count: int) -> list[bytes]:
    """``count`` Chat Completions chunks as SSE events, then the finish chunk, the usage chunk and
    ``[DONE]`` (one list item each: one ASGI body message each)."""

    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    head = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1727000000,
        "model": "bench-model",
    }
    events = [
        event(
            {
                **head,
                "system_fingerprint": "fp_bench",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": f"tok{i % 1000} "},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        )
        for i in range(count)
    ]
    events.append(event({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    events.append(
        event(
            {
                **head,
                "choices": [],
                "usage": {
                    "prompt_tokens": 182,
                    "completion_tokens": count,
                    "total_tokens": 182 + count,
                },
            }
        )
    )
    events.append(b"data: [DONE]\n\n")
    return events


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def upstream_app(scope: Any, receive: Any, send: Any) -> None:
    """A model server that answers at once: reads the request, returns a fixed chat completion."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": _RESPONSE_HEADERS})
    await send({"type": "http.response.body", "body": RESPONSE_BODY})


def streaming_upstream_app(events: int) -> Any:
    """A model server that streams ``events`` chunks at once, one SSE event per ASGI message."""
    bodies = chat_events(events)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": _STREAM_HEADERS})
        for body in bodies:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def starlette_model_app(events: int, middleware: list[Any] | None = None) -> Any:
    """The same model as a Starlette app (a route, ``request.body()``, a ``Response`` or a
    ``StreamingResponse``): what a Python model server looks like to zero-code instrumentation."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    bodies = chat_events(events) if events else []

    async def stream() -> Any:
        for body in bodies:
            yield body

    async def chat(request: Request) -> Response:
        await request.body()
        if events:
            return StreamingResponse(
                stream(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
            )
        return Response(RESPONSE_BODY, media_type="application/json")

    return Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"])], middleware=middleware or []
    )


class StatsRoute:
    """``GET /_bench/stats`` answered here, everything else passed to ``app`` untouched."""

    def __init__(self, app: Any, stats: Any) -> None:
        self.app = app
        self.stats = stats  # () -> dict

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/_bench/stats":
            body = orjson.dumps(self.stats())
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _writer_stats(sink: Any = None) -> dict[str, int]:
    stats = getattr(sink, "stats", None)
    if stats is None:
        return {"records": 0, "fsyncs": 0, "batches": 0, "failures": 0}
    return {
        "records": stats.records_written,
        "fsyncs": stats.fsyncs,
        "batches": stats.batches,
        "failures": stats.failures,
    }


def _global_sink() -> Any:
    """The ``model_call_jsonl`` exporter of the global tracer provider (zero-code: the one the distro built),
    found by walking the SDK's processors (the benchmark does not depend on where the package keeps its own
    lookup); ``None`` when there is none."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    multi = getattr(provider, "_active_span_processor", None)
    for processor in getattr(multi, "_span_processors", ()):
        exporter = getattr(processor, "span_exporter", None)
        if exporter is None:
            exporter = getattr(getattr(processor, "_batch_processor", None), "_exporter", None)
        if exporter is not None and hasattr(exporter, "stats") and hasattr(exporter, "write_call"):
            return exporter
    return None


def _in_process_app(variant: str, capture_dir: str | None, app_kind: str = "asgi", events: int = 0) -> Any:
    if app_kind == "starlette":
        if variant == "bare":
            return StatsRoute(starlette_model_app(events), lambda: _writer_stats(_global_sink()))
        if variant == "gym":
            from _gym_baseline import GymCaptureMiddleware, GymStore
            from starlette.middleware import Middleware

            assert capture_dir, "gym needs --capture-dir"
            store = GymStore(Path(capture_dir))
            return StatsRoute(
                starlette_model_app(events, [Middleware(GymCaptureMiddleware, store=store)]), store.stats
            )
        if variant == "server-span":
            from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

            # the HTTP server span alone, as the instrumentor adds it (global providers: run it under
            # opentelemetry-instrument with OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=otel_capture)
            app = OpenTelemetryMiddleware(starlette_model_app(events), exclude_spans=["receive", "send"])
            return StatsRoute(app, lambda: _writer_stats(_global_sink()))
        if variant == "lean-server-span":
            from otel_capture._server_span import LeanServerSpanMiddleware

            # the lean HTTP server span alone, as the instrumentor adds it since issue #12 (same set-up)
            app = LeanServerSpanMiddleware(starlette_model_app(events))
            return StatsRoute(app, lambda: _writer_stats(_global_sink()))
        raise SystemExit(
            f"--app starlette serves bare (instrument it with opentelemetry-instrument), server-span, "
            f"lean-server-span or gym, not {variant!r}"
        )
    model = streaming_upstream_app(events) if events else upstream_app
    if variant == "bare":
        return StatsRoute(model, _writer_stats)
    if variant == "gym":
        from _gym_baseline import GymCaptureMiddleware, GymStore

        assert capture_dir, "gym needs --capture-dir"
        store = GymStore(Path(capture_dir))
        return StatsRoute(GymCaptureMiddleware(model, store), store.stats)

    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from otel_capture import CaptureSettings, ModelCallCaptureMiddleware

    provider = TracerProvider()
    settings = CaptureSettings.from_environ({})
    exporter = None
    if variant in ("capture", "capture-nosync", "capture-traced"):
        from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

        assert capture_dir, f"{variant} needs --capture-dir"
        if variant == "capture-nosync":
            exporter = ModelCallJsonlExporter(capture_dir, fsync=lambda fd: None, syncfs=lambda fd: None)
        else:
            exporter = ModelCallJsonlExporter(capture_dir)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif variant != "spans":
        raise SystemExit(f"unknown variant {variant!r}")
    if variant == "capture-traced" or os.environ.get("BENCH_SEES_SPANS"):
        # spans are built, as for an OTLP exporter (without the exporter's own work)
        provider.add_span_processor(SpanProcessor())
    app = ModelCallCaptureMiddleware(model, tracer_provider=provider, settings=settings)
    return StatsRoute(app, lambda: _writer_stats(exporter))


# --- minimal forwarders: what the upstream client library costs per call ------------------------------

_DROP = {b"host", b"connection", b"keep-alive", b"content-length", b"transfer-encoding", b"accept-encoding"}


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class _RawConnection:
    """One kept-alive HTTP/1.1 connection to the upstream: an asyncio protocol with httptools' response
    parser (the parser uvicorn serves with). A bench-only floor for what a forwarding client costs."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.usable = True
        self._reset()

    def _reset(self) -> None:
        import asyncio

        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

    # asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as exc:
            self.usable = False
            if not self.head.done():
                self.head.set_exception(exc)
            self.chunks.put_nowait(None)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.usable = False
        if not self.head.done():
            self.head.set_exception(ConnectionError("upstream closed the connection"))
        self.chunks.put_nowait(None)

    def eof_received(self) -> None:
        self.usable = False

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if not self.head.done():
            self.head.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.chunks.put_nowait(body)

    def on_message_complete(self) -> None:
        self.chunks.put_nowait(None)
        if not self.parser.should_keep_alive():
            self.usable = False


def forwarder_app(kind: str, upstream: str) -> Any:
    """A pure ASGI app that forwards each request to ``upstream`` (path kept) and streams the answer back,
    with one client library; nothing else (no capture, no span, no disconnect watcher)."""
    base = upstream.rstrip("/")
    state: dict[str, Any] = {}

    async def start() -> None:
        if kind in ("httpx", "httpx16"):
            import httpx

            limits = httpx.Limits(
                max_connections=None, max_keepalive_connections=16 if kind == "httpx16" else 256
            )
            count = 16 if kind == "httpx16" else 1
            state["clients"] = [
                httpx.AsyncClient(limits=limits, timeout=None, trust_env=False) for _ in range(count)
            ]
            state["turn"] = 0
        elif kind == "httpcore":
            import httpcore

            state["pool"] = httpcore.AsyncConnectionPool(max_connections=None, max_keepalive_connections=256)
        elif kind == "raw":
            from urllib.parse import urlsplit

            parts = urlsplit(base)
            state["addr"] = (parts.hostname, parts.port or 80)
            state["host"] = parts.netloc.encode()
            state["idle"] = []
        elif kind == "aiohttp-conn":
            from yarl import URL

            from otel_capture._proxy_pool import _Pool  # the proxy's own client path, not a copy of it

            state["conn_pool"] = _Pool(URL(base), 600.0, keep_alive=True)
        elif kind == "aiohttp":
            import aiohttp

            state["session"] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )

    async def stop() -> None:
        for client in state.get("clients", ()):
            await client.aclose()
        if "pool" in state:
            await state["pool"].aclose()
        if "session" in state:
            await state["session"].close()
        if "conn_pool" in state:
            await state["conn_pool"].close()
        for connection in state.get("idle", ()):
            connection.transport.close()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await start()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = await _read_body(receive)
        url = base + scope["path"]
        headers = [(k, v) for k, v in scope["headers"] if k not in _DROP]
        if kind in ("httpx", "httpx16"):
            clients = state["clients"]
            state["turn"] += 1
            client = clients[state["turn"] % len(clients)]
            request = client.build_request(scope["method"], url, headers=headers, content=body)
            response = await client.send(request, stream=True)
            try:
                out = [(k, v) for k, v in response.headers.raw if k.lower() not in _DROP]
                await send({"type": "http.response.start", "status": response.status_code, "headers": out})
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finally:
                await response.aclose()
        elif kind == "httpcore":
            async with state["pool"].stream(
                scope["method"].encode(), url.encode(), headers=headers, content=body
            ) as response:
                out = [(k, v) for k, v in response.headers if k.lower() not in _DROP]
                await send({"type": "http.response.start", "status": response.status, "headers": out})
                async for chunk in response.aiter_stream():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        elif kind == "aiohttp-conn":
            lines = b"".join(k + b": " + v + b"\r\n" for k, v in headers)
            lines += b"content-length: " + str(len(body)).encode() + b"\r\n"
            response = await state["conn_pool"].send(scope["method"], scope["path"].encode(), lines, body)
            out = [(k, v) for k, v in response.raw_headers if k.lower() not in _DROP]
            await send({"type": "http.response.start", "status": response.status, "headers": out})
            while chunk := await response.content.readany():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if response.content.is_eof():
                response.release()
            else:
                response.close()
        elif kind == "raw":
            import asyncio

            idle: list[_RawConnection] = state["idle"]
            while idle and not idle[-1].usable:
                idle.pop().transport.close()
            if idle:
                connection = idle.pop()
                connection._reset()
            else:
                _, connection = await asyncio.get_running_loop().create_connection(
                    _RawConnection, *state["addr"]
                )
            head = [
                scope["method"].encode(),
                b" ",
                scope["path"].encode(),
                b" HTTP/1.1\r\nhost: ",
                state["host"],
                b"\r\ncontent-length: ",
                str(len(body)).encode(),
                b"\r\n",
            ]
            for k, v in headers:
                head += [k, b": ", v, b"\r\n"]
            head.append(b"\r\n")
            connection.transport.write(b"".join(head) + body)
            status = await connection.head
            out = [(k.lower(), v) for k, v in connection.headers if k.lower() not in _DROP]
            await send({"type": "http.response.start", "status": status, "headers": out})
            while (chunk := await connection.chunks.get()) is not None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if connection.usable:
                idle.append(connection)
            else:
                connection.transport.close()
        else:
            async with state["session"].request(
                scope["method"],
                url,
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
                data=body,
            ) as response:
                out = [(k, v) for k, v in response.raw_headers if k.lower() not in _DROP]
                await send({"type": "http.response.start", "status": response.status, "headers": out})
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return StatsRoute(app, _writer_stats)


def bind_tcp_socket(host: str, port: int) -> socket.socket:
    """``otel_capture._proxy.bind_socket`` with ``proto=IPPROTO_TCP``.

    asyncio turns on ``TCP_NODELAY`` for accepted connections only when the listening socket says
    ``proto == IPPROTO_TCP``; a socket made as ``socket(AF_INET, SOCK_STREAM)`` says 0, so Nagle stays on
    and every response uvicorn writes in two pieces (head, then body) waits ~40 ms for the client's
    delayed ACK. See docs/performance.md.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _serve(app: Any) -> None:
    # uvicorn's defaults (http and loop "auto": httptools and uvloop when installed), as `otel-capture proxy`
    # and `uvicorn app:app` run, so every variant runs alike.
    import uvicorn

    class Server(uvicorn.Server):
        """Not re-raising SIGTERM after the graceful shutdown (as ``otel-capture proxy`` does): the process
        then ends normally, so ``BENCH_CPROFILE`` gets its stats written."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    import os

    sock = bind_tcp_socket("127.0.0.1", 0)
    print(f"listening on {_socket_url(sock)}", flush=True)
    stack = {
        "http": os.environ.get("BENCH_UVICORN_HTTP", "auto"),
        "loop": os.environ.get("BENCH_UVICORN_LOOP", "auto"),
    }
    Server(uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False, **stack)).run(
        sockets=[sock]
    )


def _proxy(upstream: str, capture_dir: str | None, *, as_shipped: bool = False) -> int:
    """The real CLI; the app it builds is wrapped in the stats route and, unless ``as_shipped``, its
    listening socket is made by :func:`bind_tcp_socket` (TCP_NODELAY on accepted connections)."""
    from otel_capture import _proxy as proxy_module
    from otel_capture._cli.main import main

    build = proxy_module.build_proxy_app
    if not as_shipped:
        proxy_module.bind_socket = bind_tcp_socket  # type: ignore[assignment]

    def build_with_stats(*args: Any, **kwargs: Any) -> Any:
        app = build(*args, **kwargs)  # the server span middleware around the capture middleware
        return StatsRoute(app, lambda: _writer_stats(_find_attr(app, "sink")))

    proxy_module.build_proxy_app = build_with_stats  # type: ignore[assignment]
    argv = ["proxy", "--upstream", upstream, "--port", "0"]
    if capture_dir:
        argv += ["--capture-dir", capture_dir]
    return main(argv)


def _find_attr(app: Any, name: str) -> Any:
    """``name`` on ``app`` or on the first app down its ``.app`` chain that has it."""
    for _ in range(16):
        if app is None:
            return None
        if hasattr(app, name):
            return getattr(app, name)
        app = getattr(app, "app", None)
    return None


def _profiled(run: Any) -> Any:
    """``run()`` under cProfile when ``BENCH_CPROFILE`` names a file; the stats are dumped when it returns
    (uvicorn returns from ``run`` after a graceful shutdown on SIGTERM)."""
    import os

    target = os.environ.get("BENCH_CPROFILE")
    if not target:
        return run()
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        return run()
    finally:
        profile.disable()
        profile.dump_stats(target)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "variant",
        choices=[
            "bare",
            "spans",
            "capture",
            "capture-nosync",
            "capture-traced",
            "gym",
            "server-span",
            "lean-server-span",
            "proxy",
            "proxy-as-shipped",
            "fwd-httpx",
            "fwd-httpx16",
            "fwd-httpcore",
            "fwd-aiohttp",
            "fwd-aiohttp-conn",
            "fwd-raw",
        ],
    )
    parser.add_argument("--capture-dir")
    parser.add_argument("--upstream")
    parser.add_argument("--app", choices=["asgi", "starlette"], default="asgi")
    parser.add_argument(
        "--events", type=int, default=0, help="stream this many chunks (default: a JSON answer)"
    )
    args = parser.parse_args()
    if os.environ.get("BENCH_SEES_SPANS"):
        # a processor that does nothing but sees the spans, on the provider opentelemetry-instrument set: the
        # spans are built, as for an exporter (with no processor, ours make only their context)
        from opentelemetry import trace
        from opentelemetry.sdk.trace import SpanProcessor

        add = getattr(trace.get_tracer_provider(), "add_span_processor", None)
        if add is not None:
            add(SpanProcessor())
    if args.variant in ("proxy", "proxy-as-shipped"):
        return int(
            _profiled(
                lambda: _proxy(args.upstream, args.capture_dir, as_shipped=args.variant == "proxy-as-shipped")
            )
        )
    if args.variant.startswith("fwd-"):
        app = forwarder_app(args.variant.removeprefix("fwd-"), args.upstream)
    else:
        app = _in_process_app(args.variant, args.capture_dir, args.app, args.events)
    _profiled(lambda: _serve(app))
    return 0


if __name__ == "__main__":
    sys.exit(main())
