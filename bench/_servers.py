"""The servers the HTTP benchmarks load, each run in its own process:

    python -m bench._servers VARIANT [--app asgi|starlette] [--events N] [--answer-after MS] [--capture-dir DIR]
        [--upstream URL]

prints ``listening on <url>`` as its first line, then serves on 127.0.0.1 (a free port) with uvicorn, one
worker, uvicorn's defaults (``http`` and ``loop`` on ``auto``) for every variant. ``GET /_bench/stats``
answers the capture counters (records, fsyncs, batches, failures) so the benchmark can compute fsyncs per
record over exactly its measurement window; that route sits outside everything else.

Variants:

* ``bare``: the upstream alone, a raw ASGI app that answers a fixed chat completion at once;
* ``spans``: the upstream inside ``ModelCallCaptureMiddleware`` with an SDK tracer provider and no
  capture directory (no record; no processor either, so no span is built, only its context);
* ``capture``: the same plus the ``model_call_jsonl`` exporter on a synchronous processor (durable
  records, group commit; the exporter alone ignores spans, so none is built);
* ``capture-nosync``: ``capture`` with the writer's fsync replaced by a no-op (diagnostic only: the CPU
  cost of capture without the disk);
* ``capture-traced``: ``capture`` plus one processor that does nothing but sees the spans, so they are
  built as for an OTLP exporter (without the exporter's own work);
* ``gym``: the upstream inside the per-call-fsync baseline (``_gym_baseline.py``);
* ``proxy``: the app ``otel-capture proxy`` serves (``build_proxy_app``) in front of ``--upstream``, with
  ``--capture-dir`` when given;
* floors (``_floors.py``: the least any implementation costs here, not the product): ``floor``, the model
  app inside the barest durable capture (bodies kept, one JSON line, a writer thread with group commit);
  ``floor-onloop``, the same line written on the event loop, no thread, no fsync; ``floor-forward``, the
  barest forwarding ASGI app in front of ``--upstream`` (the proxy's own upstream pool); ``floor-raw``, a
  forwarder without ASGI or uvicorn (uvloop protocols, httptools' parsers).

``--app starlette`` serves a Starlette model app (one ``POST /v1/chat/completions`` route that reads the
body and answers at once) instead of the raw ASGI one: ``bare`` then is that app alone (run it under
``opentelemetry-instrument`` for zero-code capture: the stats route then reports the writer of the global
tracer provider's ``model_call_jsonl`` exporter), ``gym`` is that app with the baseline middleware as its
first user middleware (where NeMo Gym installs its own), ``server-span`` is that app inside contrib's
``OpenTelemetryMiddleware`` alone, ``lean-server-span`` that app inside ``LeanServerSpanMiddleware`` alone
(the one zero-code adds). ``--events N`` makes the model stream N Chat Completions chunks (one SSE event
per ASGI message, then the finish and usage chunks and ``[DONE]``) instead of the JSON answer.

``BENCH_SEES_SPANS=1`` adds such a processor to the variant's tracer provider, and to the global one (the
one ``opentelemetry-instrument`` set), so that the spans are built. ``BENCH_UVICORN_HTTP`` and
``BENCH_UVICORN_LOOP`` (``h11``, ``asyncio``) override uvicorn's ``auto`` choice, to show what the stack
itself is worth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

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


_CHUNK_HEAD = {
    "id": "chatcmpl-bench",
    "object": "chat.completion.chunk",
    "created": 1727000000,
    "model": "bench-model",
}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chat_event(i: int) -> bytes:
    """The ``i``-th content chunk of a Chat Completions stream, as one SSE event."""
    choice = {"index": 0, "delta": {"content": f"tok{i % 1000} "}, "logprobs": None, "finish_reason": None}
    return _event({**_CHUNK_HEAD, "system_fingerprint": "fp_bench", "choices": [choice]})


def closing_events(count: int) -> list[bytes]:
    """What ends a stream of ``count`` content chunks: the finish chunk, the usage chunk, ``[DONE]``."""
    usage = {"prompt_tokens": 182, "completion_tokens": count, "total_tokens": 182 + count}
    return [
        _event({**_CHUNK_HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        _event({**_CHUNK_HEAD, "choices": [], "usage": usage}),
        b"data: [DONE]\n\n",
    ]


def chat_events(count: int) -> list[bytes]:
    """``count`` Chat Completions chunks as SSE events, then :func:`closing_events` (one list item each:
    one ASGI body message each)."""
    return [*(chat_event(i) for i in range(count)), *closing_events(count)]


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


def slow_upstream_app(seconds: float) -> Any:
    """``upstream_app`` answering ``seconds`` after the request has been read, as a model server's call
    lasts (every call then outlasts the capture's in-flight marker delay, as an RL run's calls do)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            message = await receive()
            while message["type"] == "http.request" and message.get("more_body", False):
                message = await receive()
            await asyncio.sleep(seconds)
            await send({"type": "http.response.start", "status": 200, "headers": _RESPONSE_HEADERS})
            await send({"type": "http.response.body", "body": RESPONSE_BODY})
            return
        await upstream_app(scope, receive, send)

    return app


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


def _in_process_app(
    variant: str, capture_dir: str | None, app_kind: str = "asgi", events: int = 0, answer_after_ms: float = 0
) -> Any:
    if app_kind == "starlette":
        if variant in ("floor", "floor-onloop"):
            return floor_app(starlette_model_app(events), capture_dir, on_loop=variant == "floor-onloop")
        if variant == "bare":
            return StatsRoute(starlette_model_app(events), lambda: _writer_stats(_global_sink()))
        if variant == "gym":
            from starlette.middleware import Middleware

            from bench._gym_baseline import GymCaptureMiddleware, GymStore

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
            from otel_capture._telemetry import LeanServerSpanMiddleware

            # the lean HTTP server span alone, as the instrumentor adds it since issue #12 (same set-up)
            app = LeanServerSpanMiddleware(starlette_model_app(events))
            return StatsRoute(app, lambda: _writer_stats(_global_sink()))
        raise SystemExit(
            f"--app starlette serves bare (instrument it with opentelemetry-instrument), server-span, "
            f"lean-server-span or gym, not {variant!r}"
        )
    model = streaming_upstream_app(events) if events else upstream_app
    if answer_after_ms:
        model = slow_upstream_app(answer_after_ms / 1000)
    if variant in ("floor", "floor-onloop"):
        return floor_app(model, capture_dir, on_loop=variant == "floor-onloop")
    if variant == "bare":
        return StatsRoute(model, _writer_stats)
    if variant == "gym":
        from bench._gym_baseline import GymCaptureMiddleware, GymStore

        assert capture_dir, "gym needs --capture-dir"
        store = GymStore(Path(capture_dir))
        return StatsRoute(GymCaptureMiddleware(model, store), store.stats)

    if variant not in ("spans", "capture", "capture-nosync", "capture-traced"):
        raise SystemExit(f"unknown variant {variant!r}")
    assert variant == "spans" or capture_dir, f"{variant} needs --capture-dir"
    return capture_app(model, None if variant == "spans" else capture_dir, variant)


def capture_app(model: Any, capture_dir: str | None, variant: str = "capture") -> Any:
    """``model`` inside ``ModelCallCaptureMiddleware`` with an SDK tracer provider and, given a directory,
    the ``model_call_jsonl`` exporter (``capture-nosync``: fsync a no-op; ``capture-traced``, or
    ``BENCH_SEES_SPANS``: one more processor that sees the spans), in the stats route."""
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from otel_capture import CaptureSettings, ModelCallCaptureMiddleware
    from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

    provider = TracerProvider()
    exporter = None
    if capture_dir is not None:
        nosync = variant == "capture-nosync"
        exporter = (
            ModelCallJsonlExporter(capture_dir, fsync=lambda fd: None, syncfs=lambda fd: None)
            if nosync
            else ModelCallJsonlExporter(capture_dir)
        )
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if variant == "capture-traced" or os.environ.get("BENCH_SEES_SPANS"):
        # spans are built, as for an OTLP exporter (without the exporter's own work)
        provider.add_span_processor(SpanProcessor())
    settings = CaptureSettings.from_environ({})
    app = ModelCallCaptureMiddleware(model, tracer_provider=provider, settings=settings)
    return StatsRoute(app, lambda: _writer_stats(exporter))


def floor_app(model: Any, capture_dir: str | None, *, on_loop: bool) -> Any:
    """``model`` inside the barest durable capture (``on_loop``: the line written on the event loop, no
    thread, no fsync), in the stats route."""
    from bench._floors import FloorCapture, FloorWriter

    assert capture_dir, "a floor needs --capture-dir"
    writer = FloorWriter(capture_dir)
    return StatsRoute(FloorCapture(model, writer, on_loop=on_loop), writer.stats)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``proto=IPPROTO_TCP``, as ``otel-capture proxy`` makes its own:
    asyncio turns ``TCP_NODELAY`` on for accepted connections only then; without it every keep-alive
    answer uvicorn writes in two pieces (head, then body) waits ~40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # before "listening on" is printed: a client connecting before uvicorn runs waits
    sock.set_inheritable(True)
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _serve(app: Any) -> None:
    # uvicorn's defaults (http and loop "auto": httptools and uvloop when installed), as `otel-capture proxy`
    # and `uvicorn app:app` run, so every variant runs alike.
    import uvicorn

    class Server(uvicorn.Server):
        """Not re-raising SIGTERM after the graceful shutdown (as ``otel-capture proxy`` does): the process
        then ends normally, its writer flushed."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    sock = bind_socket("127.0.0.1", 0)
    print(f"listening on {socket_url(sock)}", flush=True)
    stack = {
        "http": os.environ.get("BENCH_UVICORN_HTTP", "auto"),
        "loop": os.environ.get("BENCH_UVICORN_LOOP", "auto"),
    }
    Server(uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False, **stack)).run(
        sockets=[sock]
    )


def proxy_app(upstream: str, capture_dir: str | None) -> Any:
    """The app ``otel-capture proxy`` serves (``build_proxy_app`` with the settings the command builds
    from an environment without ``OTEL_*`` variables), in the stats route."""
    from otel_capture import CaptureSettings, WriterSettings, build_proxy_app

    writer = WriterSettings(directory=Path(capture_dir)) if capture_dir else WriterSettings()
    app = build_proxy_app(upstream, settings=CaptureSettings.from_environ({}), writer=writer)
    return StatsRoute(app, lambda: _writer_stats(_find_attr(app, "sink")))


def _find_attr(app: Any, name: str) -> Any:
    """``name`` on ``app`` or on the first app down its ``.app`` chain that has it."""
    for _ in range(16):
        if app is None:
            return None
        if hasattr(app, name):
            return getattr(app, name)
        app = getattr(app, "app", None)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
            "floor",
            "floor-onloop",
            "floor-forward",
            "floor-raw",
        ],
    )
    parser.add_argument("--capture-dir")
    parser.add_argument("--upstream")
    parser.add_argument("--app", choices=["asgi", "starlette"], default="asgi")
    parser.add_argument(
        "--events", type=int, default=0, help="stream this many chunks (default: a JSON answer)"
    )
    parser.add_argument(
        "--answer-after",
        type=float,
        default=0,
        metavar="MS",
        help="the asgi app answers its JSON this many ms after the request (default: at once)",
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
    if args.variant == "floor-raw":
        from bench._floors import serve_raw_forwarder

        sock = bind_socket("127.0.0.1", 0)
        print(f"listening on {socket_url(sock)}", flush=True)
        serve_raw_forwarder(args.upstream, sock)
        return 0
    if args.variant == "proxy":
        app = proxy_app(args.upstream, args.capture_dir)
    elif args.variant == "floor-forward":
        from bench._floors import FloorForwarder

        app = StatsRoute(FloorForwarder(args.upstream), _writer_stats)
    else:
        app = _in_process_app(args.variant, args.capture_dir, args.app, args.events, args.answer_after)
    _serve(app)
    return 0


if __name__ == "__main__":
    sys.exit(main())
