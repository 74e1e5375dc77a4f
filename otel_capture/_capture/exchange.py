"""One captured request and its response, between :class:`~.middleware.ModelCallCaptureMiddleware` and the
app: the request read before the app runs, the response forwarded as it comes but for its terminal chunk,
held until the record is durable (``docs/gateways.md``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace

from .. import _attributes as A
from .._asgi import ASGIApp, Message, Receive, Scope, Send
from .._correlation import Correlation, response_headers, session_id
from .._settings import CaptureSettings
from .._telemetry import ServerMetrics
from .call import InFlightCall
from .engine import Admission, EngineWeights
from .passthrough import SCOPE_RESPONSE_COMPLETE
from .propagation import with_trace_headers
from .sink import CallSink, FinishedCall
from .weight import WEIGHT_VERSION_HEADER, caller_weight_version, without_weight_version_header


class CaptureHost(Protocol):
    """What an exchange asks of the middleware that made it (:class:`~.middleware.ModelCallCaptureMiddleware`)."""

    app: ASGIApp
    settings: CaptureSettings
    engine: EngineWeights
    _metrics: ServerMetrics

    def _start_span(
        self,
        call: InFlightCall,
        scope: Scope,
        headers: dict[str, list[bytes]],
        source: str,
        baggage_id: str | None,
        metrics_recording: bool,
    ) -> tuple[trace.Span, dict[str, Any] | None, otel_context.Context | None]: ...

    def _finish(
        self,
        call: InFlightCall,
        span: trace.Span,
        attributes: dict[str, Any] | None,
        exception: BaseException | None,
        cancelled: bool,
        sink: CallSink | None,
        admission: Admission,
    ) -> FinishedCall | None: ...

    async def _wait_durable(self, call: InFlightCall, finished: FinishedCall, sink: CallSink) -> None: ...


class CapturedExchange:
    """One captured request and its response (starlette's ``GZipResponder`` shape): :meth:`run` reads the
    request, starts the span and runs the app with :meth:`receive` and :meth:`send` in place of the
    server's; the call is finished, and what :meth:`send` held back let out, at the app's final response
    message (the app's teardown is not waited for), or when the app ends without one.

    :meth:`send` forwards each response message as it comes, except the terminal one and what follows it,
    which wait until the record is durable. A redirect (``3xx``) is traced, not recorded; a call it began
    is discarded. The sink hears that the call began (a freeze from then on reports it in flight) once,
    when the app takes the request, by reading it or answering it; a redirect answered by routing alone
    never begins. Per response chunk, :meth:`send` itself allocates nothing and awaits only the server's
    ``send`` (the chunk's parsing is :meth:`InFlightCall.on_body`'s)."""

    __slots__ = (
        "_admission",
        "_attributes",
        "_body_messages",
        "_call",
        "_content_length",
        "_held",
        "_held_at",
        "_middleware",
        "_own",
        "_receive",
        "_scope",
        "_send",
        "_sent",
        "_sink",
        "_span",
        "_started",
        "_timed",
        "begun",
        "cancelled",
        "completed",
        "holding",
        "redirected",
    )

    def __init__(
        self,
        middleware: CaptureHost,
        found: Correlation,
        sink: CallSink | None,
        receive: Receive,
        send: Send,
        started: float,
    ) -> None:
        assert found.dialect is not None and found.rollout_id is not None  # found.captured
        headers = found.headers
        self._middleware = middleware
        self._scope = found.scope_for_capture(mark=sink is not None)
        if WEIGHT_VERSION_HEADER in headers:  # not forwarded, as x-rollout-id is not (no walk when absent)
            self._scope = without_weight_version_header(self._scope)
        self._call = InFlightCall(
            found.dialect,
            found.rollout_id,
            middleware.settings,
            session_id=session_id(headers),
            weight_version=caller_weight_version(headers),
            scope=self._scope,
        )
        self._receive = receive
        self._send = send
        self._sink = sink
        self._body_messages: list[Message] = []
        self.begun = False  # the sink was told the call began
        self.cancelled = False  # the client went away, or the app was cancelled
        self.redirected = False  # a 3xx: not the model call
        self.holding = False  # the terminal message went by: hold the rest until the record is durable
        self._held: list[Message] = []
        self._sent = 0  # body bytes
        self._content_length: int | None = None
        # the capture's own cost, timed only when a metric reader will see it (ServerMetrics.recording)
        self._timed = middleware._metrics.recording
        self._started = started  # when the middleware took the request
        self._own = 0.0  # seconds in the capture's own code so far
        self._held_at: float | None = None  # when the terminal chunk was held
        self.completed = False  # finished and its held messages let out (:meth:`_complete`)
        # what finishing the call needs, set just before the app runs: its span, the span's start
        # attributes and the engine's admission
        self._span: trace.Span | None = None
        self._attributes: dict[str, Any] | None = None
        self._admission: Admission | None = None

    async def run(self, found: Correlation) -> None:
        middleware, scope, sink, call = self._middleware, self._scope, self._sink, self._call
        timed = self._timed
        if timed:
            self._own = time.perf_counter() - self._started
        first = await self._receive()  # waits for the client
        if first["type"] == "http.request" and not first.get("more_body", False):
            messages = [first]  # the whole body in one message (the usual request)
        else:
            messages, self.cancelled = await read_request(self._receive, first)
        self._body_messages = messages
        mark = time.perf_counter() if timed else 0.0
        body = messages[0].get("body", b"") if len(messages) == 1 else None
        call.set_request(body if type(body) is bytes else b"".join(m.get("body", b"") for m in messages))
        if middleware.engine.unready:  # the first call (the read at start), or the info route is asked
            if timed:
                self._own += time.perf_counter() - mark
            await middleware.engine.ready(middleware.app, scope)  # waits for the app
            mark = time.perf_counter() if timed else 0.0
        admission = middleware.engine.admit()  # the engine's version as the app takes the call
        span, attributes, parent = middleware._start_span(
            call, scope, found.headers, found.source, found.baggage_id, timed
        )
        # in the caller's context when there is no server span (its baggage too), else in the current one
        span_context = trace.set_span_in_context(span, parent)
        token = otel_context.attach(span_context)
        context = span.get_span_context()
        if context.is_valid:
            # An app that traces from the request's headers (vLLM's engine) nests its span under this call.
            scope["headers"] = with_trace_headers(
                scope.get("headers", ()), found.headers, context, span_context
            )
        if timed:
            self._own += time.perf_counter() - mark
        self._span, self._attributes, self._admission = span, attributes, admission
        exception: BaseException | None = None
        try:
            await middleware.app(scope, self.receive, self.send)
        except BaseException as exc:  # recorded, then re-raised unchanged
            exception = exc
            if isinstance(exc, asyncio.CancelledError):
                self.cancelled = True
        finally:
            otel_context.detach(token)
            if self.redirected:
                # traced (with its status), not recorded and not counted as a model call
                if call.status_code is not None:
                    span.set_attribute(A.HTTP_RESPONSE_STATUS_CODE, call.status_code)
                span.end()
                if self.begun and sink is not None:
                    sink.discard_call(call.rollout_id, call.model_call_id)
                for message in self._held:  # capture never changes the response (contract D5)
                    await self._send(message)
            elif not self.completed:  # the app ended without its last message, or before it was let out
                await self._complete(exception)
        if exception is not None:
            raise exception

    async def _complete(self, exception: BaseException | None) -> None:
        """Finish the call, wait until its record is durable (or failed, or past its deadline), then let out
        what :meth:`send` held. Once per call: at the app's last response message (the response is whole:
        its teardown, a loop iteration or more on a busy server, is not waited for), or when the app ends
        without one (an error, a cancellation, a cut stream)."""
        self.completed = True
        middleware, call, sink, timed = self._middleware, self._call, self._sink, self._timed
        mark = time.perf_counter() if timed else 0.0
        self.begin()
        # A disconnect after the app produced the whole response is not a cancelled call.
        cancelled = self.cancelled and not self.holding
        span, admission = self._span, self._admission
        assert span is not None and admission is not None  # set before the app runs, the only sender
        finished = middleware._finish(call, span, self._attributes, exception, cancelled, sink, admission)
        if timed:
            self._own += time.perf_counter() - mark
        if finished is not None and sink is not None:
            await middleware._wait_durable(call, finished, sink)
        if timed:
            held_at = self._held_at
            wait = None if held_at is None else time.perf_counter() - held_at
            middleware._metrics.record_capture_cost(call.dialect, self._own, wait)
        # Capture never changes the response: what was held goes out now, durable or not (contract D5).
        held, self._held = self._held, []
        for message in held:
            await self._send(message)

    def begin(self) -> None:
        """Tell the sink, once, that the call has begun."""
        if not self.begun:
            self.begun = True
            if self._sink is not None:
                self._sink.begin_call(self._call.rollout_id, self._call.model_call_id)

    async def receive(self) -> Message:
        """The request's body messages read before the app ran, then the server's ``receive``."""
        self.begin()
        if self._body_messages:
            return self._body_messages.pop(0)
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.cancelled = True
        return message

    def send(self, message: Message) -> Awaitable[None]:
        """The ``send`` the app is given. A body chunk that passes (every event of a stream but its terminal
        one) is handed to the server's ``send`` as it is: what is returned is the server's own awaitable,
        with no coroutine of the capture's in between (ASGI's ``send`` is any callable whose result is
        awaited). Everything else goes through :meth:`_send_other`."""
        if self.holding or message["type"] != "http.response.body":
            return self._send_other(message)
        call = self._call
        body = message.get("body", b"")
        sent = self._sent = self._sent + len(body)
        if self._timed:
            mark = time.perf_counter()
            terminal = call.on_body(body)
            self._own += time.perf_counter() - mark
        else:
            terminal = call.on_body(body)
        # The end of a response is whichever comes first: the dialect's terminal event, the byte that
        # completes Content-Length (a client may stop reading there, before any final empty message), or the
        # last body message. It is held until the record is durable (contract D1); every chunk before it
        # went out as it came (contract D2).
        content_length = self._content_length
        if (
            terminal
            or not message.get("more_body", False)
            or (content_length is not None and sent >= content_length)
        ):
            return self._hold(message)
        return self._send(message)

    async def _hold(self, message: Message) -> None:
        """Hold the response's end (its terminal chunk) until the record is durable."""
        self.holding = True
        if self._timed:
            self._held_at = time.perf_counter()
        self._held.append(message)
        if self._call.stream_complete:
            self._scope[SCOPE_RESPONSE_COMPLETE] = True
        if not message.get("more_body", False) and not self.redirected:
            await self._complete(None)  # the response is whole

    async def _send_other(self, message: Message) -> None:
        """The response's start, and every message once its end is held."""
        call = self._call
        if self.holding:
            if self.completed:  # nothing follows the last message; the server says so, not the capture
                await self._send(message)
                return
            self._held.append(message)
            if message["type"] == "http.response.body":
                call.on_body(message.get("body", b""))  # what follows the terminal chunk is captured too
                if not message.get("more_body", False) and not self.redirected:
                    await self._complete(None)  # the response is whole
            return
        if message["type"] == "http.response.start":
            # 3xx: routing redirected it (a trailing slash; then the call never began), or the app or
            # the upstream did after reading it; the call the client makes next is the model call
            self.redirected = 300 <= message["status"] < 400
            if not self.redirected:
                self.begin()
            content_type, content_encoding, self._content_length = response_headers(
                message.get("headers", ())
            )
            call.on_response_start(message["status"], content_type, content_encoding)
        await self._send(message)


async def read_request(receive: Receive, first: Message) -> tuple[list[Message], bool]:
    """Every request body message from ``first`` on (``receive`` gives the rest), read before the app runs
    (it reads the whole JSON body anyway), so the span starts with the request's model and parameters; and
    whether the client went away (an ``http.disconnect``, kept last)."""
    messages: list[Message] = []
    message = first
    while True:
        if message["type"] == "http.disconnect":
            messages.append(message)
            return messages, True
        messages.append(message)
        if not message.get("more_body", False):
            return messages, False
        message = await receive()
