"""The servers the HTTP benchmarks load, each run in its own process:

    python bench/_servers.py VARIANT [--capture-dir DIR] [--upstream URL]

prints ``listening on <url>`` as its first line, then serves on 127.0.0.1 (a free port) with uvicorn, one
worker, the same settings for every variant (those of ``otel-capture proxy``). ``GET /_bench/stats``
answers the capture counters (records, fsyncs, batches, failures) so the benchmark can compute fsyncs per
record over exactly its measurement window; that route sits outside everything else.

Variants:

* ``bare``: the upstream alone, a raw ASGI app that answers a fixed chat completion at once;
* ``spans``: the upstream inside ``ModelCallCaptureMiddleware`` with an SDK tracer provider and no
  capture directory (spans only: capture off);
* ``capture``: the same plus the ``model_call_jsonl`` exporter on a synchronous processor (durable
  records, group commit);
* ``capture-nosync``: ``capture`` with the writer's fsync replaced by a no-op (diagnostic only: the CPU
  cost of capture without the disk);
* ``gym``: the upstream inside the per-call-fsync baseline (``_gym_baseline.py``);
* ``proxy``: the real ``otel-capture proxy`` CLI (``--upstream URL``, ``--capture-dir`` when given), with
  the stats route wrapped around the app it builds, and its listening socket made with
  ``proto=IPPROTO_TCP`` (see :func:`bind_tcp_socket`); ``proxy-as-shipped`` leaves the socket as the CLI
  makes it.

Every in-process variant listens on a socket from :func:`bind_tcp_socket` too.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: F401  (puts the repository on sys.path)

RESPONSE_BODY = orjson.dumps({
    "id": "chatcmpl-bench0001",
    "object": "chat.completion",
    "created": 1753983920,
    "model": "bench-model",
    "choices": [{
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
    }],
    "usage": {
        "prompt_tokens": 182,
        "completion_tokens": 38,
        "total_tokens": 220,
        "prompt_tokens_details": {"cached_tokens": 64, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    },
    "service_tier": "default",
    "system_fingerprint": "fp_bench",
})

REQUEST_BODY = orjson.dumps({
    "model": "bench-model",
    "messages": [
        {"role": "system", "content": "You are a careful assistant. Answer briefly and cite no sources. " * 6},
        {"role": "user", "content": "Which city is the capital of France, and since when has it been? " * 8},
    ],
    "temperature": 0.7,
    "top_p": 0.95,
    "max_tokens": 256,
    "seed": 7,
})

_RESPONSE_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(RESPONSE_BODY)).encode()),
]


async def upstream_app(scope: Any, receive: Any, send: Any) -> None:
    """A model server that answers at once: reads the request, returns a fixed chat completion."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": _RESPONSE_HEADERS})
    await send({"type": "http.response.body", "body": RESPONSE_BODY})


class StatsRoute:
    """``GET /_bench/stats`` answered here, everything else passed to ``app`` untouched."""

    def __init__(self, app: Any, stats: Any) -> None:
        self.app = app
        self.stats = stats  # () -> dict

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/_bench/stats":
            body = orjson.dumps(self.stats())
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _writer_stats(sink: Any = None) -> dict[str, int]:
    stats = getattr(sink, "stats", None)
    if stats is None:
        return {"records": 0, "fsyncs": 0, "batches": 0, "failures": 0}
    return {"records": stats.records_written, "fsyncs": stats.fsyncs, "batches": stats.batches, "failures": stats.failures}


def _in_process_app(variant: str, capture_dir: str | None) -> Any:
    if variant == "bare":
        return StatsRoute(upstream_app, _writer_stats)
    if variant == "gym":
        from _gym_baseline import GymCaptureMiddleware, GymStore

        assert capture_dir, "gym needs --capture-dir"
        store = GymStore(Path(capture_dir))
        stats = lambda: {"records": store.records, "fsyncs": store.fsyncs, "batches": store.records, "failures": 0}
        return StatsRoute(GymCaptureMiddleware(upstream_app, store), stats)

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from otel_capture import CaptureSettings, ModelCallCaptureMiddleware

    provider = TracerProvider()
    settings = CaptureSettings.from_environ({})
    exporter = None
    if variant in ("capture", "capture-nosync"):
        from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

        assert capture_dir, f"{variant} needs --capture-dir"
        if variant == "capture-nosync":
            exporter = ModelCallJsonlExporter(capture_dir, fsync=lambda fd: None)
        else:
            exporter = ModelCallJsonlExporter(capture_dir)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif variant != "spans":
        raise SystemExit(f"unknown variant {variant!r}")
    app = ModelCallCaptureMiddleware(upstream_app, tracer_provider=provider, settings=settings)
    return StatsRoute(app, lambda: _writer_stats(exporter))


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


def _serve(app: Any) -> None:
    # The settings of `otel-capture proxy` (otel_capture/_cli.py), so every variant runs alike.
    import uvicorn

    from otel_capture._proxy import socket_url

    sock = bind_tcp_socket("127.0.0.1", 0)
    print(f"listening on {socket_url(sock)}", flush=True)
    uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False)).run(sockets=[sock])


def _proxy(upstream: str, capture_dir: str | None, *, as_shipped: bool = False) -> int:
    """The real CLI; the app it builds is wrapped in the stats route and, unless ``as_shipped``, its
    listening socket is made by :func:`bind_tcp_socket` (TCP_NODELAY on accepted connections)."""
    from otel_capture._cli.main import main
    from otel_capture import _proxy as proxy_module

    build = proxy_module.build_proxy_app
    if not as_shipped:
        proxy_module.bind_socket = bind_tcp_socket  # type: ignore[assignment]
    def build_with_stats(*args: Any, **kwargs: Any) -> Any:
        app = build(*args, **kwargs)  # the server span middleware around the capture middleware
        return StatsRoute(app, lambda: _writer_stats(getattr(app.app, "sink", None)))

    proxy_module.build_proxy_app = build_with_stats  # type: ignore[assignment]
    argv = ["proxy", "--upstream", upstream, "--port", "0"]
    if capture_dir:
        argv += ["--capture-dir", capture_dir]
    return main(argv)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=["bare", "spans", "capture", "capture-nosync", "gym", "proxy", "proxy-as-shipped"])
    parser.add_argument("--capture-dir")
    parser.add_argument("--upstream")
    args = parser.parse_args()
    if args.variant in ("proxy", "proxy-as-shipped"):
        return _proxy(args.upstream, args.capture_dir, as_shipped=args.variant == "proxy-as-shipped")
    _serve(_in_process_app(args.variant, args.capture_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
