"""Where a captured call's CPU goes, stage by stage, in one process without HTTP: the OpenTelemetry
overhead measured, not assumed.

    python -m bench.bench_hotpath [--quick] [--calls N]
    python -m bench.bench_hotpath --drive {alone,floor,capture,traced} [--answer {plain,rl,stream,rl-stream}] --calls N   (callgrind)

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

``--drive VARIANT`` only drives ``--calls`` non-streaming chat calls (after 200 to warm up) through one
variant and prints only how many it recorded, and how many of them with a tokens line: ``alone`` (the app), ``floor`` (``bench/_floors.py``'s ``FloorCapture``,
its writer resolving each call at once), ``capture`` (the middleware, records only, a sink resolving each
call at once: no span built, no writer thread) or ``traced`` (the same with each span built and handed to
the SDK's ``BatchSpanProcessor`` around an exporter that sends nothing: what spans cost before encoding); ``--answer rl`` makes each call an RL run's (token ids and
log-probs asked for, :data:`RL_RESPONSE_BODY` answered), so the capture also reads, checks and writes its
tokens; ``--answer stream`` (``rl-stream``) answers each call with a 512-event chat stream (vLLM's RL chunks,
token ids and log-probs in each), after 5 calls to warm up: its instructions per call over 515 are the
instructions per event (the app alone's beside them). Run under ``valgrind --tool=callgrind`` at two sizes, the
difference of the instructions over the difference of the calls is each variant's instructions per call, a
count that does not move with the machine's load: the code the event loop runs per call, the capture's
against the floor's (docs/performance.md, "Inside vLLM").

Then the pieces on their own, in microseconds per call, and two of issue 34's goals side by side, each
variant measured in the same rounds as its baseline:

- **per SSE event**: a streamed chat call of 512 and of 32 events (one ASGI message each) through the
  middleware (records only: an in-memory sink, no span built) against the streaming app alone; the
  event-loop thread's CPU per call, and per event the slope between the two lengths (goal: <= 3 us added
  per event in bench_goals 4a, where a real server adds its own share); then the same with the chunks vLLM
  streams to an RL run, which asks for token ids and log-probs (each chunk carries both);
- **spans on against records only**: the non-streaming call with the records alone (no span built), with
  the SDK span seen by a processor that does nothing, behind the SDK's ``BatchSpanProcessor`` with an
  exporter that does nothing, one that only encodes OTLP protobuf, and the OTLP/HTTP exporter sending to a
  local receiver (its own process, not counted): the whole process's CPU per call (event loop and the
  batch processor's thread, which holds the same GIL) and the loop thread's, so the split says where the
  spans' cost goes (span and attributes, batching, encoding, export); the encoding and the export both
  with the SDK's encoder and with the capture's (``otel_capture._telemetry.otlp``, which the capture puts
  behind the SDK's OTLP exporters).
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
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from bench import _harness as H
from bench._servers import REQUEST_BODY, RESPONSE_BODY, upstream_app
from otel_capture import CaptureSettings, ModelCallCaptureMiddleware

CAPTURED_PATH = "/ng-rollout/bench-0/v1/chat/completions"


class MemorySink:
    """Resolves every call at once: the record is built and handed off, but nothing is written."""

    written = 0  # calls handed to it (``--drive`` says how many the capture recorded)
    with_tokens = 0  # of which with a tokens line

    def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        pass

    def abandon_call(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        pass

    def discard_call(self, rollout_id: str, model_call_id: str) -> None:
        pass

    def write_call(self, call: Any) -> None:  # a FinishedCall
        self.written += 1
        self.with_tokens += call.tokens_line is not None
        call.waiter.future.set_result(None)


def _scope(path: str, body: bytes = REQUEST_BODY) -> dict[str, Any]:
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
            (b"content-length", str(len(body)).encode()),
            (b"user-agent", b"bench"),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def _drive(app: Any, path: str, calls: int, body: bytes = REQUEST_BODY) -> float:
    request = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return request

    async def send(message: dict[str, Any]) -> None:
        pass

    gc.collect()
    t0 = time.perf_counter()
    for _i in range(calls):
        await app(_scope(path, body), receive, send)
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


# -- --drive: one variant's calls, for callgrind ------------------------------------------------------

DRIVEN = ("alone", "floor", "capture", "traced")
DRIVE_WARM = 200
STREAMED = ("stream", "rl-stream")  # answered with a 512-event chat stream
ANSWERS = ("plain", "rl", *STREAMED)
STREAM_WARM = 5  # a streamed call is ~40 plain ones

# ``--answer rl``: a call as an RL run makes it to vLLM (token ids and log-probs asked for), answered as vLLM
# answers it: a 200-token prompt's ids, 16 generated tokens with their ids and log-probs (one top log-prob
# each, vLLM's entry shape), the usage. The capture reads and checks the tokens and writes a tokens line.
RL_REQUEST_BODY = orjson.dumps(
    {
        **orjson.loads(REQUEST_BODY),
        "max_tokens": 16,
        "logprobs": True,
        "top_logprobs": 1,
        "return_token_ids": True,
    }
)
_RL_TOKENS = [(1000 + 37 * i) % 262_000 for i in range(16)]
RL_RESPONSE_BODY = orjson.dumps(
    {
        "id": "chatcmpl-bench-rl",
        "object": "chat.completion",
        "created": 1767225600,
        "model": "bench-model",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Paris, since the tenth century.",
                    "refusal": None,
                },
                "logprobs": {
                    "content": [
                        {
                            "token": f"t{token}",
                            "logprob": -0.01 * (i + 1),
                            "bytes": [116, 49],
                            "top_logprobs": [
                                {"token": f"t{token}", "logprob": -0.01 * (i + 1), "bytes": [116]}
                            ],
                        }
                        for i, token in enumerate(_RL_TOKENS)
                    ]
                },
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": _RL_TOKENS,
            }
        ],
        "usage": {"prompt_tokens": 200, "total_tokens": 216, "completion_tokens": 16},
        "prompt_logprobs": None,
        "prompt_token_ids": [2 + (7919 * i) % 262_000 for i in range(200)],
        "kv_transfer_params": None,
    }
)
_RL_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(RL_RESPONSE_BODY)).encode()),
]


async def rl_upstream_app(scope: Any, receive: Any, send: Any) -> None:
    """``upstream_app`` answering as vLLM answers an RL call (:data:`RL_RESPONSE_BODY`)."""
    while (await receive()).get("more_body", False):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": _RL_HEADERS})
    await send({"type": "http.response.body", "body": RL_RESPONSE_BODY})


class _ResolvedWriter:
    """The floor's writer with nothing written: each call's future is done at once (the capture's variant
    has :class:`MemorySink`, its like)."""

    written = 0  # lines handed to it

    def submit(self, rollout: str, line: bytes) -> asyncio.Future[None]:
        self.written += 1
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def _driven(variant: str, answer: str = "plain") -> tuple[Any, str, Callable[[], tuple[int, int, int]]]:
    """The app and path ``--drive`` calls (the upstream app, the floor or the capture around it, answering
    ``answer``), how many calls it has recorded so far, and of them with a tokens line (a variant that
    stopped capturing would count the app's code only), and how many spans it exported."""
    if answer in STREAMED:
        from bench._servers import chat_events

        app = _streaming_app((rl_events if answer == "rl-stream" else chat_events)(STREAM_LENGTHS[0]))
    else:
        app = rl_upstream_app if answer == "rl" else upstream_app
    if variant == "alone":
        return app, "/v1/chat/completions", lambda: (0, 0, 0)
    if variant == "floor":
        from bench._floors import FloorCapture

        writer = _ResolvedWriter()
        floor = FloorCapture(app, writer)  # type: ignore[arg-type]
        return floor, CAPTURED_PATH, lambda: (writer.written, 0, 0)
    settings = CaptureSettings.from_environ({})
    sink = MemorySink()
    provider = TracerProvider()
    exporter = _NothingExporter()
    if variant == "traced":  # each span built, batched and handed to an exporter (that sends nothing)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    middleware = ModelCallCaptureMiddleware(app, tracer_provider=provider, settings=settings, sink=sink)

    def recorded() -> tuple[int, int, int]:
        provider.force_flush()  # the batch thread's export of what it holds, counted with the calls
        return sink.written, sink.with_tokens, exporter.exported

    return middleware, CAPTURED_PATH, recorded


# -- per SSE event -----------------------------------------------------------------------------------

_STREAM_HEADERS = [(b"content-type", b"text/event-stream")]
STREAM_LENGTHS = (512, 32)


def _streaming_app(events: list[bytes]) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": _STREAM_HEADERS})
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def _drive_cpu(
    app: Any, path: str, calls: int, body: bytes = REQUEST_BODY, flush: Callable[[], object] | None = None
) -> tuple[float, float]:
    """``(process CPU, this thread's CPU)`` per call, in microseconds; ``flush`` (the batch processor's
    export of what it still holds) is counted in the process's CPU."""
    request = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return request

    async def send(message: dict[str, Any]) -> None:
        pass

    gc.collect()
    process, thread = time.process_time(), time.thread_time()
    for _i in range(calls):
        await app(_scope(path, body), receive, send)
    thread = time.thread_time() - thread
    if flush is not None:
        flush()
    return (time.process_time() - process) / calls * 1e6, thread / calls * 1e6


def rl_events(count: int) -> list[bytes]:
    """``count`` Chat Completions chunks as vLLM streams them to an RL run, which asks for the token ids
    and log-probs: each with its ``token_ids`` and a ``logprobs`` object (one top log-prob), then the
    usual closing events."""
    events = []
    for i in range(count):
        token = f"tok{i % 1000} "
        entry = {"token": token, "logprob": -0.25, "bytes": list(token.encode())}
        choice = {
            "index": 0,
            "delta": {"content": token},
            "logprobs": {"content": [{**entry, "top_logprobs": [entry]}]},
            "finish_reason": None,
            "token_ids": [1000 + i % 1000],
        }
        payload = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1727000000}
        events.append(
            b"data: " + orjson.dumps({**payload, "model": "bench-model", "choices": [choice]}) + b"\n\n"
        )
    from bench._servers import closing_events

    return [*events, *closing_events(count)]


def per_event_table(calls: int, rounds: int) -> None:
    from bench._servers import chat_events

    _per_event(
        chat_events,
        "per SSE event (issue 34 goal 4a): the middleware, records only, around a streaming app",
        calls,
        rounds,
    )
    _per_event(
        rl_events,
        "per SSE event, vLLM's chunks for an RL run (token ids and log-probs in each): the same measure",
        calls,
        rounds,
    )


def _per_event(make_events: Callable[[int], list[bytes]], title: str, calls: int, rounds: int) -> None:
    settings = CaptureSettings.from_environ({})
    body = orjson.dumps({**orjson.loads(REQUEST_BODY), "stream": True})
    apps = {}
    for n in STREAM_LENGTHS:
        app = _streaming_app(make_events(n))
        middleware = ModelCallCaptureMiddleware(
            app, tracer_provider=TracerProvider(), settings=settings, sink=MemorySink()
        )
        apps[f"alone-{n}"] = (app, "/v1/chat/completions")
        apps[f"on-{n}"] = (middleware, CAPTURED_PATH)
    best: dict[str, float] = {}

    async def run() -> None:
        for _ in range(rounds):
            for name, (app, path) in apps.items():
                n = int(name.rsplit("-", 1)[1])
                _, us = await _drive_cpu(app, path, max(5, calls // n), body)
                best[name] = min(best.get(name, us), us)

    asyncio.run(run())
    long, short = STREAM_LENGTHS
    added = {n: best[f"on-{n}"] - best[f"alone-{n}"] for n in STREAM_LENGTHS}
    slope = (added[long] - added[short]) / (long - short)
    own = (best[f"alone-{long}"] - best[f"alone-{short}"]) / (long - short)
    H.print_table(
        title,
        ["events", "app alone us/call", "captured us/call", "added us/call", "captured / alone"],
        [
            [n + 3, best[f"alone-{n}"], best[f"on-{n}"], added[n], best[f"on-{n}"] / best[f"alone-{n}"]]
            for n in STREAM_LENGTHS
        ],
        [
            f"added per event (the slope between {long} and {short} events): {slope:.2f} us of event-loop CPU, "
            f"{slope / max(own, 1e-9):.1f}x the app's own {own:.2f} us per event here (goal <= 3 us in "
            "bench_goals 4a, which adds the server's own per-event work)"
        ],
    )


# -- spans on against records only ----------------------------------------------------------------------


class _NothingExporter(SpanExporter):
    exported = 0  # spans handed to it

    def export(self, spans: Any) -> SpanExportResult:
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


class _EncodingExporter(SpanExporter):
    """What the SDK's OTLP exporters did before sending: the spans as one OTLP protobuf request, by the
    SDK's encoder."""

    def export(self, spans: Any) -> SpanExportResult:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        encode_spans(spans).SerializeToString()
        return SpanExportResult.SUCCESS


class _OwnEncodingExporter(SpanExporter):
    """The same request by the capture's encoder (otel_capture._telemetry.otlp), which the capture puts
    behind the SDK's OTLP exporters."""

    def export(self, spans: Any) -> SpanExportResult:
        from otel_capture._telemetry.otlp import encode_spans

        encode_spans(spans)
        return SpanExportResult.SUCCESS


def spans_table(calls: int, rounds: int) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    class SdkEncodedExporter(OTLPSpanExporter):
        """The SDK's OTLP/HTTP exporter as it is (a subclass: the capture's encoder is not put behind it)."""

    receiver = H.OtlpReceiver()
    providers: dict[str, TracerProvider] = {}
    try:
        processors: dict[str, list[SpanProcessor]] = {
            "records only (no span built)": [],
            "+ SDK span, a processor that does nothing": [SpanProcessor()],
            "+ BatchSpanProcessor, exporter does nothing": [BatchSpanProcessor(_NothingExporter())],
            "+ BatchSpanProcessor, OTLP encoding (SDK's)": [BatchSpanProcessor(_EncodingExporter())],
            "+ BatchSpanProcessor, OTLP/HTTP export (SDK's encoder)": [
                BatchSpanProcessor(SdkEncodedExporter(endpoint=receiver.endpoint))
            ],
            "+ BatchSpanProcessor, OTLP encoding (capture's)": [BatchSpanProcessor(_OwnEncodingExporter())],
            "+ BatchSpanProcessor, OTLP/HTTP export (capture's encoder)": [
                BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint))
            ],
        }
        settings = CaptureSettings.from_environ({})
        apps = {}
        for name, chosen in processors.items():
            provider = providers[name] = TracerProvider()
            for processor in chosen:
                provider.add_span_processor(processor)
            apps[name] = ModelCallCaptureMiddleware(
                upstream_app, tracer_provider=provider, settings=settings, sink=MemorySink()
            )
        best: dict[str, tuple[float, float]] = {}

        async def run() -> None:
            for _ in range(rounds):
                for name, app in apps.items():
                    flush = providers[name].force_flush  # the batch's export is the calls' too
                    process, thread = await _drive_cpu(app, CAPTURED_PATH, calls, flush=flush)
                    old = best.get(name, (process, thread))
                    best[name] = (min(old[0], process), min(old[1], thread))

        asyncio.run(run())
    finally:
        for provider in providers.values():
            provider.shutdown()
        receiver.stop()
    base_process, base_thread = best["records only (no span built)"]
    # each row adds one thing to the row it steps from: the one above, but the capture's encoder replaces
    # the SDK's, so its rows start again from the batch processor whose exporter does nothing
    batching = "+ BatchSpanProcessor, exporter does nothing"
    rows = []
    previous = None
    for name, (process, thread) in best.items():
        if name.endswith("encoding (capture's)"):
            previous = best[batching][0]
        step = None if previous is None else process - previous
        rows.append(
            [name, process, step, process - base_process, process / base_process, thread - base_thread]
        )
        previous = process
    H.print_table(
        "spans on against records only (issue 34 goal 2): the non-streaming call, process CPU per call",
        ["variant", "us/call", "+us vs the step before", "+us vs records", "x records", "+us on the loop"],
        rows,
        [
            "the batch processor's thread (encoding, export) holds the GIL the event loop needs: its CPU counts",
            f"the capture's encoding steps from '{batching}' (it replaces the SDK's encoding)",
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--drive", choices=DRIVEN)
    parser.add_argument("--answer", choices=ANSWERS, default="plain", help="with --drive: the call driven")
    args = parser.parse_args(argv)
    calls = args.calls or (5_000 if args.quick else 20_000)
    if args.drive:
        app, path, recorded = _driven(args.drive, args.answer)
        body = RL_REQUEST_BODY if args.answer.startswith("rl") else REQUEST_BODY
        warm = DRIVE_WARM
        if args.answer in STREAMED:
            body = orjson.dumps({**orjson.loads(body), "stream": True})
            warm = STREAM_WARM

        async def drive() -> None:
            await _drive(app, path, warm, body)
            await _drive(app, path, calls, body)

        asyncio.run(drive())
        lines, tokens, spans = recorded()
        print(
            f"drove {calls} {args.answer} calls through {args.drive} (after {warm}), {lines} recorded, "
            f"{tokens} with a tokens line, {spans} spans exported"
        )
        return 0
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
        per_event_table(calls, rounds)
        spans_table(max(20, calls // 4), rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
