"""A model call nothing will read, passed through: no record sink, no span processor that sees its span,
no metric reader (the middleware decides per call, :meth:`ModelCallCaptureMiddleware.unread`).

Such a call costs what the caller would notice anyway and no more: the request goes to the app unbuffered
and unparsed, the response back message by message, unparsed. What stays is what the app and the client
see of the capture: the scope the capture hands down (the ``/ng-rollout/<id>/`` prefix in ``root_path``,
``x-rollout-id`` and ``x-weight-version`` removed), the call's span context current and in the request's
trace headers (a context-only span, as on the full path when no processor sees the span), and the end of
an event stream told to a relaying app (``SCOPE_RESPONSE_COMPLETE``) (contract D29), for which the stream's
events are decoded, as they are on the full path.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from .._asgi import ASGIApp, Message, Receive, Scope, Send
from .._correlation import Correlation, response_headers
from .._dialects import DIALECTS
from .._dialects.deferred import StreamReassembly
from .._dialects.reassembly import StreamAccumulator
from .._telemetry import SpanGate
from .propagation import caller_context, with_trace_headers
from .weight import WEIGHT_VERSION_HEADER, without_weight_version_header

# Set in the app's scope once a captured stream's last event has gone to `send`: an app still relaying
# (the proxy) may stop reading its source and end the body, so the client's end of stream never waits for
# an upstream that holds its response open.
SCOPE_RESPONSE_COMPLETE = "otel_capture.response_complete"


async def pass_through(
    app: ASGIApp,
    found: Correlation,
    spans: SpanGate,
    span_kind: SpanKind,
    max_body_bytes: int,
    receive: Receive,
    send: Send,
) -> None:
    """Serve one call nothing reads (``found.captured``; the scope not marked captured, as no record is
    written)."""
    assert found.dialect is not None
    headers = found.headers
    scope = found.scope_for_capture(mark=False)
    if WEIGHT_VERSION_HEADER in headers:
        scope = without_weight_version_header(scope)
    parent = None
    if not trace.get_current_span().get_span_context().is_valid:
        parent = caller_context(headers)  # no server span around us: the caller's traceparent
    spec = DIALECTS[found.dialect]
    span = spans.context_only(spec.operation_name, parent, span_kind)  # the name is not read (unread)
    span_context = trace.set_span_in_context(span, parent)
    token = otel_context.attach(span_context)
    scope["headers"] = with_trace_headers(
        scope.get("headers", ()), headers, span.get_span_context(), span_context
    )
    try:
        await app(scope, receive, _StreamEnd(scope, spec.accumulator, max_body_bytes, send).send)
    finally:
        otel_context.detach(token)


class _StreamEnd:
    """Forwards every response message as it comes; for an event stream, watches for its last event (a
    completed, incomplete or failed terminal event, as :attr:`InFlightCall.stream_complete` says) and
    then sets ``SCOPE_RESPONSE_COMPLETE`` before the message goes out. A compressed stream is not decoded:
    a relay reads the flag only for an uncompressed one."""

    __slots__ = ("_make", "_max_bytes", "_reassembly", "_scope", "_send")

    def __init__(
        self, scope: Scope, make: Callable[[], StreamAccumulator], max_bytes: int, send: Send
    ) -> None:
        self._scope = scope
        self._make = make
        self._max_bytes = max_bytes
        self._send = send
        self._reassembly: StreamReassembly | None = None

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            content_type, content_encoding, _ = response_headers(message.get("headers", ()))
            if content_type.lower().lstrip().startswith("text/event-stream") and (
                content_encoding.strip().lower() in ("", "identity")
            ):
                self._reassembly = StreamReassembly(self._make, self._max_bytes)
        elif self._reassembly is not None and kind == "http.response.body":
            body = message.get("body", b"")
            reassembly = self._reassembly
            if body:
                reassembly.feed(body)
            terminal = reassembly.accumulator.terminal
            if terminal is not None and terminal != "error":
                self._scope[SCOPE_RESPONSE_COMPLETE] = True
                self._reassembly = None  # nothing more to watch
        await self._send(message)
