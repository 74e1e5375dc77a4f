"""``ModelCallCaptureMiddleware``: a pure ASGI middleware that turns each model call into a span and a
durable record, without delaying or changing the response.

Per request (``docs/gateways.md`` has the whole story):

1. :func:`otel_capture._correlation.correlate` decides, once, what the request is: its rollout id from the
   ``/ng-rollout/<id>/`` URL prefix, else the ``x-rollout-id`` header, else (when configured) the API key or ``x-session-id``, else
   the W3C ``baggage`` entry ``rollout.id``; its dialect; whether a capture layer in front records it. The prefix moves into
   ``root_path`` (so the app's redirects and links keep it) and the header is removed; an id that breaks
   the grammar in either, or a second prefix, is served the same way and not recorded (logged, counted).
2. Only ``POST`` to ``/v1/responses``, ``/v1/chat/completions``, ``/v1/messages``, ``/v1/completions`` (also
   without ``/v1``,
   a trailing slash tolerated) with a rollout id is captured; everything else goes to the app untouched.
   A model call without a rollout id is logged (the first time, then once a minute) and counted.
3. Response chunks are forwarded as they come; only the terminal chunk (the final SSE event, or the last
   body message of a JSON response) and what follows it wait until the record is durable. A redirect
   (``3xx``: a trailing-slash redirect by routing, or an upstream's behind the proxy) is not the model call
   (the call the client makes next is): no record, and a call already begun is discarded, not left in flight.
4. The span (GenAI semconv v1.41.1, :mod:`otel_capture._telemetry.semconv`) is a child of the HTTP server span when one is current,
   else of the caller's ``traceparent``; the ``gen_ai.server.*`` metrics are recorded when it ends.

A request is captured at most once: a capture middleware that captures marks the scope, and any other
below it (a mounted sub-app instrumented too) passes through. One that only strips the URL prefix hands
the rollout id down in the scope, so a mounted sub-app whose route is a dialect path still captures it.
Across processes, a layer that records adds ``x-otel-capture: captured`` to the request it passes on, and
a capture layer behind it (another proxy, a zero-code server) passes such a request through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import _attributes as A
from .._asgi import ASGIApp, Receive, Scope, Send
from .._correlation import (
    BAGGAGE_ROLLOUT_KEY,
    ROLLOUT_ID_HEADER,
    SCOPE_CAPTURED,
    RolloutRules,
    correlate,
    invalid_id_notice,
    name_server_span,
    server_attributes,
    warn_ignored_carriers,
)
from .._dialects import DIALECTS, Dialect
from .._notices import RateLimitedNotice, notify
from .._sdk_private import set_clean_attributes
from .._settings import (
    ENV_API_KEY_ROLLOUT_PATTERN,
    ENV_SESSION_ID_AS_ROLLOUT,
    JSONL_EXPORTER,
    CaptureSettings,
)
from .._store import INVALID_ID, NO_ID, CaptureFrozenError, UncorrelatedCounter, counter_for
from .._telemetry import ServerMetrics, SpanGate
from .._version import __version__
from .call import InFlightCall
from .engine import Admission, EngineWeights, engine_route
from .exchange import CapturedExchange
from .passthrough import pass_through
from .propagation import caller_context
from .sink import CallSink, FinishedCall, LoopWaiter, SinkLookup, find_sink
from .weight import (
    engine_span_attributes,
    record_weight_fields,
    span_weight_attributes,
)

_logger = logging.getLogger(__name__)

_UNCORRELATED_NOTICE_INTERVAL_S = 60.0


class ModelCallCaptureMiddleware:
    """Wraps any ASGI model-server app. Spans go to ``tracer_provider`` and metrics to ``meter_provider``
    (the global ones by default); records go to ``sink``, by default the ``model_call_jsonl`` exporter that
    ``tracer_provider`` has (looked for when the middleware is built, then on its calls until found, so a
    provider set later is found; none: spans only, with one warning when ``OTEL_TRACES_EXPORTER`` names
    ``model_call_jsonl``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        settings: CaptureSettings | None = None,
        span_kind: SpanKind = SpanKind.INTERNAL,
        sink: CallSink | None = None,
    ) -> None:
        self.app = app
        self.sink = sink if sink is not None else find_sink(tracer_provider)
        # none yet: the provider may be set (or its exporter added) later; looked for on each call until found
        self._sink_lookup = SinkLookup(tracer_provider) if self.sink is None else None
        self._no_sink_warned = False
        self.settings = settings if settings is not None else CaptureSettings.from_environ()
        self._rules = RolloutRules(  # the carriers read only when configured: API key, x-session-id
            self.settings.api_key_rollout_pattern,
            self.settings.session_id_as_rollout,
            self.settings.upstream_api_key,
        )
        self._tracer = trace.get_tracer(__name__, __version__, tracer_provider)
        self._spans = SpanGate(tracer_provider)
        self._metrics = ServerMetrics(meter_provider)
        self._span_kind = span_kind
        self._uncorrelated_notice = RateLimitedNotice(_UNCORRELATED_NOTICE_INTERVAL_S)
        self._invalid_id_notice = RateLimitedNotice(_UNCORRELATED_NOTICE_INTERVAL_S)
        self._late_notice = RateLimitedNotice(_UNCORRELATED_NOTICE_INTERVAL_S)
        self._uncorrelated_counter: UncorrelatedCounter | None = None
        self._deadlines: _Deadlines | None = None  # of the loop that last finished a call
        # the engine's weight version, from the RL routes that pass through (docs/tokens.md)
        self.engine = EngineWeights(ask_info=self.settings.engine_weight_info)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get(SCOPE_CAPTURED):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()  # the capture's own time begins (otel_capture.capture.duration)
        found = correlate(scope, self._rules)  # the one decision: what this request is
        if found.prefixed:
            name_server_span(found.scope, found.dialect)
        warn_ignored_carriers(found)  # a bad baggage id, API key group or session id: logged, not read
        if not found.captured:
            if found.dialect is not None and found.rollout_id is None and not found.captured_upstream:
                self._uncorrelated(found.scope, found.dialect, found.invalid_id)
            # not a model call, or one a capture layer in front of this one records (one call, one record)
            route = engine_route(found.scope) if found.dialect is None else None
            if route is not None:  # an RL route: served unchanged, unrecorded; what it set is noted
                await self.engine.observe(route, self.app, found.scope, receive, send)
            else:
                await self.app(found.scope, receive, send)
            return
        sink = self.sink if self._sink_lookup is None else self._late_sink()
        if sink is None and self.unread():  # nothing reads this call: served as it comes, nothing built
            settings = self.settings
            await pass_through(
                self.app, found, self._spans, self._span_kind, settings.max_body_bytes, receive, send
            )
            return
        exchange = CapturedExchange(self, found, sink, receive, send, started)
        await exchange.run(found)

    def unread(self) -> bool:
        """Whether a call without a sink would be read by nothing: no metric reader (the
        ``gen_ai.server.*`` metrics, the capture's cost, the token counters) and no span processor that
        sees its span, nor a sampler that reads its name. Asked per call, so a reader, a processor or a
        provider added later counts from the next call on."""
        return not self._metrics.recording and self._spans.unread()

    def _late_sink(self) -> CallSink | None:
        """The sink of a tracer provider set after this middleware was built, once there is one; until
        then ``None``, with one warning when the records' exporter is configured (its calls would be
        traced and not recorded, silently)."""
        assert self._sink_lookup is not None
        sink = self._sink_lookup.find()
        if sink is not None:
            self.sink, self._sink_lookup = sink, None
        elif self.settings.records_expected and not self._no_sink_warned:
            self._no_sink_warned = True
            notify(
                _logger,
                logging.WARNING,
                "OTEL_TRACES_EXPORTER names %s, but this capture middleware's tracer provider has no %s "
                "exporter: its calls are traced, not recorded, until one is added (set the tracer provider "
                "before the first call, or pass sink=); see docs/architecture.md",
                JSONL_EXPORTER,
                JSONL_EXPORTER,
            )
        return sink

    def _uncorrelated(self, scope: Scope, dialect: Dialect, invalid_id: tuple[str, str] | None) -> None:
        """A model call without a rollout id (or with one outside the grammar) is served but cannot be
        recorded: say so (the first time, then at most once a minute with a count) and count it, so a
        missing prefix shows at once."""
        self._metrics.count_uncorrelated(dialect)
        counter = self._uncorrelated_counter or self._counter_of_sink()
        if counter is not None:  # in memory; written to the capture directory at most once a second
            counter.count(dialect, NO_ID if invalid_id is None else INVALID_ID)
        if invalid_id is not None:
            more = "with a rollout id outside the grammar"
            self._notice(self._invalid_id_notice, more, *invalid_id_notice(dialect, *invalid_id))
            return
        suppressed = self._uncorrelated_notice.note()
        if suppressed is None:
            return
        if suppressed == 0:
            notify(
                _logger,
                logging.WARNING,
                "a %s model call to %s has no rollout id (no /ng-rollout/<id>/ prefix, %s header, API key "
                "or session id read as one, or baggage %s): it is served but not recorded; see "
                "docs/gateways.md, 'Per framework' (LiteLLM's forward_client_headers_to_llm_api, verifiers' "
                "X-Session-ID with %s, inspect-ai's solver, per-rollout API keys with %s)",
                dialect,
                scope.get("path", ""),
                ROLLOUT_ID_HEADER,
                BAGGAGE_ROLLOUT_KEY,
                ENV_SESSION_ID_AS_ROLLOUT,
                ENV_API_KEY_ROLLOUT_PATTERN,
            )
        else:
            notify(
                _logger,
                logging.WARNING,
                "%d more model calls without a rollout id were served but not recorded",
                suppressed,
            )

    def _late(self, call: InFlightCall) -> None:
        """A late call to a frozen or retired rollout: answered, its record dropped (and counted in the
        directory) by the writer (contract L9); metered and logged here, once a minute at most."""
        self._metrics.count_late(call.dialect)
        first = "a %s model call to rollout %s came after the rollout was frozen or retired: answered, not "
        first += "recorded (counted in the capture directory: otel-capture check); see docs/lifecycle.md"
        self._notice(
            self._late_notice, "to a frozen or retired rollout", first, call.dialect, call.rollout_id
        )

    @staticmethod
    def _notice(notice: RateLimitedNotice, more: str, first: str, *args: object) -> None:
        suppressed = notice.note()
        if suppressed == 0:
            notify(_logger, logging.WARNING, first, *args)
        elif suppressed is not None:
            notify(_logger, logging.WARNING, "%d more model calls %s, not recorded", suppressed, more)

    def _counter_of_sink(self) -> UncorrelatedCounter | None:
        """The capture directory's count of uncorrelated calls, once this middleware has a sink with a
        directory (the records' exporter)."""
        sink = self.sink if self._sink_lookup is None else self._late_sink()
        directory = getattr(sink, "directory", None)
        if isinstance(directory, str):
            self._uncorrelated_counter = counter_for(directory)
        return self._uncorrelated_counter

    def _start_span(
        self,
        call: InFlightCall,
        scope: Scope,
        headers: dict[str, list[bytes]],
        source: str,
        baggage_id: str | None,
        metrics_recording: bool,
    ) -> tuple[trace.Span, dict[str, Any] | None, otel_context.Context | None]:
        """The model-call span, its start attributes (kept for the metrics) and the caller's context read
        from the headers when no span is current (``None`` otherwise). When no processor would see the
        span, only its context is made (``_spans``), and the attributes only if the metrics need them
        (``metrics_recording``: :attr:`ServerMetrics.recording`, read once per call)."""
        parent = None
        if not trace.get_current_span().get_span_context().is_valid:
            # No HTTP server span around us: continue the caller's trace from its traceparent header.
            parent = caller_context(headers)
        model = call.request_model
        operation = DIALECTS[call.dialect].operation_name  # chat, or text_completion for /v1/completions
        name = f"{operation} {model}" if model else operation
        if self._spans.unseen():
            span: trace.Span = self._spans.context_only(name, parent, self._span_kind)
            if not metrics_recording:
                return span, None, parent
            return span, self._start_attributes(call, scope, headers, source, baggage_id), parent
        attributes = self._start_attributes(call, scope, headers, source, baggage_id)
        if self._spans.attributes_after_start():  # the same span, its attributes stored without the check
            span = self._tracer.start_span(
                name, context=parent, kind=self._span_kind, start_time=call.start_time_ns
            )
            set_clean_attributes(span, attributes)
            return span, attributes, parent
        span = self._tracer.start_span(
            name, context=parent, kind=self._span_kind, attributes=attributes, start_time=call.start_time_ns
        )
        return span, attributes, parent

    @staticmethod
    def _start_attributes(
        call: InFlightCall,
        scope: Scope,
        headers: dict[str, list[bytes]],
        source: str,
        baggage_id: str | None,
    ) -> dict[str, Any]:
        attributes = call.start_attributes()
        attributes[A.MODEL_CALL_ROLLOUT_SOURCE] = source
        if baggage_id is not None and baggage_id != call.rollout_id:
            attributes[A.ROLLOUT_ID_BAGGAGE] = baggage_id
        attributes.update(server_attributes(scope, headers))
        return attributes

    def _finish(
        self,
        call: InFlightCall,
        span: trace.Span,
        attributes: dict[str, Any] | None,
        exception: BaseException | None,
        cancelled: bool,
        sink: CallSink | None,
        admission: Admission,
    ) -> FinishedCall | None:
        """End the span exactly once, record the metrics, and hand the record to the sink; the handed
        call, for :meth:`_wait_durable`, or ``None``. Never raises."""
        finished: FinishedCall | None = None
        try:
            call.finish(exception=exception, cancelled=cancelled)
            engine = self.engine.fields(admission, call.engine_version)
            if sink is not None:  # the record's alone: no line without a sink
                call.weight_fields = record_weight_fields(engine, call.weight_version)
            if call.tokens_missing is not None:
                self._metrics.count_tokens_missing(call.dialect)
            if call.token_mismatch is not None:
                self._metrics.count_token_mismatch(call.dialect)
            recording = span.is_recording()
            if recording or attributes is not None:
                end_attributes = call.end_attributes()
                if recording:
                    end_attributes.update(
                        span_weight_attributes(call.weight_version, call.started_at, call.completed_at, sink)
                    )
                    end_attributes.update(engine_span_attributes(engine))
                if recording:
                    set_clean_attributes(span, end_attributes)  # the start attributes are on it already
                if attributes is not None:
                    attributes.update(end_attributes)
                    self._metrics.record(
                        attributes, *call.server_timings(attributes.get(A.GEN_AI_USAGE_OUTPUT_TOKENS))
                    )
            if recording:
                if self.settings.content_on_spans:
                    set_clean_attributes(span, call.content_attributes(self.settings.content_max_length))
                if call.error_category is not None:
                    span.set_status(Status(StatusCode.ERROR, call.error_category))
                if exception is not None and not isinstance(exception, asyncio.CancelledError):
                    span.record_exception(exception)
            if sink is not None:
                context = span.get_span_context()
                loop = asyncio.get_running_loop()
                finished = FinishedCall(
                    call.rollout_id,
                    call.model_call_id,
                    call.line(context.trace_id, context.span_id),
                    call.tokens_line(),
                    LoopWaiter(loop, loop.create_future()),
                    (call.weight_version, call.started_at, call.completed_at),
                )
                call.release_bodies()
        except Exception as exc:
            notify(
                _logger,
                logging.ERROR,
                "model-call capture failed while finishing a %s call",
                call.dialect,
                exc_info=True,
            )
            if sink is not None:
                sink.abandon_call(
                    call.rollout_id, call.model_call_id, f"capture_error: {type(exc).__name__}: {exc}"
                )
        finally:
            span.end(end_time=call.end_time_ns)  # None (the finish failed): now
        if finished is None or sink is None:
            return None
        sink.write_call(finished)
        return finished

    async def _wait_durable(self, call: InFlightCall, finished: FinishedCall, sink: CallSink) -> None:
        """Wait until the handed record is durable, failed or past its deadline. Never raises (but a
        cancellation)."""
        future = finished.waiter.future
        deadlines = self._deadlines
        if deadlines is None or deadlines.loop is not finished.waiter.loop:
            deadlines = self._deadlines = _Deadlines(finished.waiter.loop, self.settings.durable_timeout_s)
        deadlines.add(future)
        try:
            # the terminal chunk waits for this: durable, failed or past its deadline (contract D1, D3)
            await future  # resolved with the rest of its batch: one wake-up per batch
        except asyncio.CancelledError:
            raise
        except (
            _NotDurableInTime
        ):  # a stalled writer (a hung disk) never holds the call: answer, mark it failed (contract D6)
            reason = f"capture_error: record not durable within {self.settings.durable_timeout_s:g} s"
            notify(
                _logger, logging.ERROR, "rollout %s, call %s: %s", call.rollout_id, call.model_call_id, reason
            )
            sink.abandon_call(call.rollout_id, call.model_call_id, reason)
        except CaptureFrozenError:  # a late call: its line dropped by the writer
            self._late(call)
        except Exception:  # the sink counted, logged and marked it (after close too: WriterClosedError)
            pass


class _NotDurableInTime(Exception):
    """The durability wait's deadline (``CaptureSettings.durable_timeout_s``) passed."""


class _Deadlines:
    """The durability waits' deadlines on one event loop, behind one timer instead of a timer per call
    (``call_later`` and its ``cancel`` were about 5 % of a captured call's own CPU). Every wait has the same
    length, so deadlines come in the order the waits began: a queue, looked at from its head. A wait that
    ended (durable, failed or cancelled) is dropped when it reaches the head."""

    __slots__ = ("_queue", "_timeout_s", "_timer", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self._timeout_s = timeout_s
        self._queue: deque[tuple[float, asyncio.Future[None]]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, future: asyncio.Future[None]) -> None:
        """From ``loop``'s thread only."""
        queue = self._queue
        while queue and queue[0][1].done():
            queue.popleft()
        queue.append((self.loop.time() + self._timeout_s, future))
        if self._timer is None:
            self._timer = self.loop.call_at(queue[0][0], self._expire)

    def _expire(self) -> None:
        self._timer = None
        queue = self._queue
        now = self.loop.time()
        while queue:
            deadline, future = queue[0]
            if not future.done():
                if deadline > now:
                    self._timer = self.loop.call_at(deadline, self._expire)
                    return
                # the writer resolves it later into the void (it skips done futures)
                future.set_exception(_NotDurableInTime())
            queue.popleft()
