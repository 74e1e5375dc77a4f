"""Where a captured call's CPU goes, stage by stage, in one process without HTTP: the OpenTelemetry
overhead measured, not assumed.

    python -m bench.bench_hotpath [--quick] [--calls N]

One non-streaming chat call (the non-streaming benchmark's request and response) is driven through the
ASGI stack with in-memory ``receive``/``send``, ``--calls`` times per variant (default 20,000; quick
5,000), variants interleaved in rounds, best round kept. Each row adds one thing to the row above:

1. ``app alone``: the upstream app (the floor);
2. ``middleware, unprefixed``: ``ModelCallCaptureMiddleware`` on a call it does not capture;
3. ``capture, no-op tracer``: a captured call with OpenTelemetry's no-op tracer provider and no sink:
   correlation, body teeing, parsing, attributes (no SDK span, no record);
4. ``+ SDK span``: the SDK ``TracerProvider`` with one processor that does nothing but is not known to
   ignore spans (as OTLP would be), so the span is built: what the OpenTelemetry SDK costs per call;
5. ``+ record line, sink in memory``: a sink that resolves each call's future at once: the record line
   (orjson), the hand-off and the durability wait, without the writer thread;
6. ``+ JSONL exporter, fsync off``: the real exporter and writer thread (files in a temp dir, fsync a
   no-op): queueing, the thread, the file appends and the wake-up of the event loop;
7. ``JSONL exporter alone, fsync off``: row 6 without the other processor, so no span is built, only its
   context (``otel_capture._telemetry.spans``): the usual set-up of a training run.

Then the pieces on their own, in microseconds per call.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from bench import _harness as H
from bench._servers import REQUEST_BODY, RESPONSE_BODY, upstream_app
from otel_capture import CaptureSettings, ModelCallCaptureMiddleware

CAPTURED_PATH = "/ng-rollout/bench-0/v1/chat/completions"


class MemorySink:
    """Resolves every call at once: the record is built and handed off, but nothing is written."""

    def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        pass

    def abandon_call(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        pass

    def discard_call(self, rollout_id: str, model_call_id: str) -> None:
        pass

    def write_call(self, call: Any) -> None:  # a FinishedCall
        call.waiter.future.set_result(None)


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(REQUEST_BODY)).encode()),
            (b"user-agent", b"bench"),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def _drive(app: Any, path: str, calls: int) -> float:
    request = {"type": "http.request", "body": REQUEST_BODY, "more_body": False}

    async def receive() -> dict[str, Any]:
        return request

    async def send(message: dict[str, Any]) -> None:
        pass

    gc.collect()
    t0 = time.perf_counter()
    for _i in range(calls):
        await app(_scope(path), receive, send)
    return (time.perf_counter() - t0) / calls * 1e6


def _variants(tmp: Path) -> list[tuple[str, Any, str, Callable[[], None], Callable[[], None]]]:
    settings = CaptureSettings.from_environ({})
    noop = trace.NoOpTracerProvider()
    sdk = TracerProvider()
    # the SDK's base processor does nothing, but is not one the capture knows to ignore spans: they are built
    sdk.add_span_processor(SpanProcessor())
    memory = MemorySink()
    from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

    exporter_provider = TracerProvider()
    exporter = ModelCallJsonlExporter(tmp / "traced", fsync=lambda fd: None)
    exporter_provider.add_span_processor(SimpleSpanProcessor(exporter))
    exporter_provider.add_span_processor(SpanProcessor())
    alone_provider = TracerProvider()
    alone = ModelCallJsonlExporter(tmp / "alone", fsync=lambda fd: None)
    alone_provider.add_span_processor(SimpleSpanProcessor(alone))

    def nothing():
        return None

    return [
        ("app alone", upstream_app, CAPTURED_PATH, nothing, nothing),
        (
            "middleware, unprefixed",
            ModelCallCaptureMiddleware(upstream_app, tracer_provider=noop, settings=settings),
            "/v1/chat/completions",
            nothing,
            nothing,
        ),
        (
            "capture, no-op tracer, no sink",
            ModelCallCaptureMiddleware(upstream_app, tracer_provider=noop, settings=settings),
            CAPTURED_PATH,
            nothing,
            nothing,
        ),
        (
            "+ SDK span (a processor sees it)",
            ModelCallCaptureMiddleware(upstream_app, tracer_provider=sdk, settings=settings),
            CAPTURED_PATH,
            nothing,
            nothing,
        ),
        (
            "+ record line, in-memory sink",
            ModelCallCaptureMiddleware(upstream_app, tracer_provider=sdk, settings=settings, sink=memory),
            CAPTURED_PATH,
            nothing,
            nothing,
        ),
        (
            "+ JSONL exporter, fsync off",
            ModelCallCaptureMiddleware(upstream_app, tracer_provider=exporter_provider, settings=settings),
            CAPTURED_PATH,
            nothing,
            nothing,
        ),
        (
            "JSONL exporter alone: no span, its context",
            ModelCallCaptureMiddleware(upstream_app, tracer_provider=alone_provider, settings=settings),
            CAPTURED_PATH,
            nothing,
            nothing,
        ),
    ]


def _pieces(calls: int) -> list[tuple[str, float]]:
    """Single pieces of the per-call work, timed alone."""
    from otel_capture._capture.call import InFlightCall

    settings = CaptureSettings.from_environ({})
    tracer = TracerProvider().get_tracer("bench")
    noop_tracer = trace.NoOpTracerProvider().get_tracer("bench")
    call = InFlightCall("chat", "bench-0", settings)
    call.set_request(REQUEST_BODY)
    call.on_response_start(200, "application/json")
    call.on_body(RESPONSE_BODY)
    call.finish()

    def full_call() -> None:
        c = InFlightCall("chat", "bench-0", settings)
        c.set_request(REQUEST_BODY)
        c.start_attributes()
        c.on_response_start(200, "application/json")
        c.on_body(RESPONSE_BODY)
        c.finish()
        c.end_attributes()
        c.line(1, 2)

    def sdk_span() -> None:
        span = tracer.start_span("chat bench-model", attributes=call.start_attributes())
        span.set_attributes(call.end_attributes())
        span.end()

    def noop_span() -> None:
        span = noop_tracer.start_span("chat bench-model", attributes=call.start_attributes())
        span.set_attributes(call.end_attributes())
        span.end()

    pieces: list[tuple[str, Callable[[], Any]]] = [
        ("uuid.uuid4().hex (model_call_id)", lambda: uuid.uuid4().hex),
        ("orjson.loads(request) (span attributes need it)", lambda: orjson.loads(REQUEST_BODY)),
        ("orjson.loads(response)", lambda: orjson.loads(RESPONSE_BODY)),
        ("InFlightCall.line(): the record, orjson + Fragment", lambda: call.line(1, 2)),
        ("InFlightCall: whole call, bytes in, line out", full_call),
        ("start/end attributes (dicts)", lambda: (call.start_attributes(), call.end_attributes())),
        ("SDK span: start, set_attributes, end", sdk_span),
        ("no-op span: the same calls", noop_span),
    ]
    out = []
    for name, fn in pieces:
        gc.collect()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        out.append((name, best))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int)
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args(argv)
    calls = args.calls or (5_000 if args.quick else 20_000)
    rounds = args.rounds or (2 if args.quick else 3)
    tmp = Path(tempfile.mkdtemp(prefix="otel-capture-bench-hotpath-"))
    print("== bench_hotpath: per-call CPU of each stage of a captured call (no HTTP) ==")
    print(H.machine_line(tmp))
    print(
        f"{calls:,} calls per variant and round, {rounds} rounds, best kept; request {len(REQUEST_BODY)} B, "
        f"response {len(RESPONSE_BODY)} B"
    )
    try:
        variants = _variants(tmp)
        best: dict[str, float] = {}

        async def run() -> None:
            for _ in range(rounds):
                for name, app, path, setup, teardown in variants:
                    setup()
                    try:
                        us = await _drive(app, path, calls)
                    finally:
                        teardown()
                    best[name] = min(best.get(name, us), us)

        asyncio.run(run())
        rows = []
        previous = None
        for name, *_ in variants:
            rows.append(
                [
                    name,
                    best[name],
                    None if previous is None else best[name] - previous,
                    best[name] - best["app alone"],
                ]
            )
            previous = best[name]
        H.print_table(
            "captured call, stage by stage (each row adds one thing to the row above)",
            ["variant", "us/call", "+us vs row above", "+us vs app alone"],
            rows,
            [
                "no HTTP server here: uvicorn's own per-request cost (bench_goals' CPU us/call of the bare app) "
                "comes on top of every row"
            ],
        )
        H.print_table("pieces alone", ["piece", "us/call"], [[n, us] for n, us in _pieces(calls)])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
