"""``ModelCallCaptureMiddleware``: a pure ASGI middleware that turns each model call into a span and a
durable record, without delaying or changing the response.

Per request:

1. ``/ng-rollout/<id>/...`` is stripped before routing (an id that breaks the grammar gets ``400``);
   without a prefix, the W3C ``baggage`` entry ``rollout.id`` correlates the call.
2. Only ``POST`` to ``/v1/responses``, ``/v1/chat/completions``, ``/v1/messages`` (a trailing slash
   tolerated) with a rollout id is captured; everything else goes to the app untouched.
3. Response chunks are forwarded as they come; only the terminal chunk (the final SSE event, or the last
   body message of a JSON response) and what follows it wait until the record is durable.
4. The span (GenAI semconv v1.41.1, ``_semconv``) is a child of the HTTP server span when one is current,
   else of the caller's ``traceparent``; the ``gen_ai.server.*`` metrics are recorded when it ends.

A request is captured at most once: a capture middleware that captures marks the scope, and any other
below it (a mounted sub-app instrumented too) passes through. One that only strips the URL prefix hands
the rollout id down in the scope, so a mounted sub-app whose route is a dialect path still captures it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import unquote

import orjson
from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from . import _attributes as A
from ._asgi import ASGIApp, Message, Receive, Scope, Send
from ._call import InFlightCall
from ._correlation import ROLLOUT_ID_RULE, is_valid_rollout_id, rollout_id_from_baggage, split_rollout_prefix
from ._dialects import DIALECT_PATHS, Dialect
from ._metrics import ServerMetrics
from ._settings import CaptureSettings
from ._sink import CallSink, FinishedCall, LoopWaiter, find_sink
from ._dialects.tokens import tokens_line
from ._version import __version__

_logger = logging.getLogger(__name__)

SCOPE_CAPTURED = "otel_capture.captured"
SCOPE_ROLLOUT_ID = "otel_capture.rollout_id"  # from a URL prefix stripped by an outer capture middleware


class ModelCallCaptureMiddleware:
    """Wraps any ASGI model-server app. Spans go to ``tracer_provider`` and metrics to ``meter_provider``
    (the global ones by default); records go to ``sink``, by default the ``model_call_jsonl`` exporter that
    ``tracer_provider`` has when the middleware is built (none: spans only)."""

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
        self.settings = settings if settings is not None else CaptureSettings.from_environ()
        self._tracer = trace.get_tracer(__name__, __version__, tracer_provider)
        self._metrics = ServerMetrics(meter_provider)
        self._span_kind = span_kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get(SCOPE_CAPTURED):
            await self.app(scope, receive, send)
            return
        rollout_id: str | None = scope.get(SCOPE_ROLLOUT_ID)
        # Split on the raw path: in the decoded one, /ng-rollout/a%2Fb/... would look like id "a".
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        split = split_rollout_prefix(raw_path.decode("latin-1"))
        if split is not None:
            rollout_id, raw_rest = split
            if not is_valid_rollout_id(rollout_id):
                await _send_json(send, 400, _invalid_id_error(rollout_id))
                return
            scope = dict(scope, path=unquote(raw_rest), raw_path=raw_rest.encode("latin-1"))
            scope[SCOPE_ROLLOUT_ID] = rollout_id
        dialect = _dialect_of(scope)
        if dialect is None:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        baggage_id = rollout_id_from_baggage(headers.get("baggage", []))
        source = "url_prefix"
        if rollout_id is None:
            if baggage_id is None:
                await self.app(scope, receive, send)
                return
            if not is_valid_rollout_id(baggage_id):
                # Baggage is ambient context from any upstream system: a bad value must not fail the call.
                _logger.warning("not capturing a call with invalid baggage rollout.id %r", baggage_id[:64])
                await self.app(scope, receive, send)
                return
            rollout_id, source = baggage_id, "baggage"
        scope = dict(scope)
        scope[SCOPE_CAPTURED] = True
        await self._capture(scope, receive, send, dialect, rollout_id, source, baggage_id, headers)

    async def _capture(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        dialect: Dialect,
        rollout_id: str,
        source: str,
        baggage_id: str | None,
        headers: dict[str, list[bytes]],
    ) -> None:
        call = InFlightCall(dialect, rollout_id, self.settings, session_id=_session_id(headers))
        if self.sink is not None:
            self.sink.begin_call(rollout_id, call.model_call_id)  # a freeze meanwhile reports it in flight
        body_messages, disconnected = await _read_request(receive)
        call.set_request(b"".join(m.get("body", b"") for m in body_messages))
        span, attributes = self._start_span(call, scope, headers, source, baggage_id)
        token = otel_context.attach(trace.set_span_in_context(span))
        state = _SendState()
        cancelled = disconnected

        async def replay_receive() -> Message:
            nonlocal cancelled
            if body_messages:
                return body_messages.pop(0)
            message = await receive()
            if message["type"] == "http.disconnect":
                cancelled = True
            return message

        async def capture_send(message: Message) -> None:
            if state.holding:
                if message["type"] == "http.response.body":
                    call.on_body(message.get("body", b""))  # what follows the terminal chunk is captured too
                state.held.append(message)
                return
            kind = message["type"]
            if kind == "http.response.start":
                headers = message.get("headers", ())
                call.on_response_start(message["status"], _header(headers, b"content-type"))
                state.content_length = _content_length(headers)
            elif kind == "http.response.body":
                body = message.get("body", b"")
                state.sent += len(body)
                terminal = call.on_body(body)
                # The end of a response is whichever comes first: the dialect's terminal event, the byte
                # that completes Content-Length (a client may stop reading there, before any final empty
                # message), or the last body message.
                if (
                    terminal
                    or not message.get("more_body", False)
                    or (state.content_length is not None and state.sent >= state.content_length)
                ):
                    state.holding = True
                    state.held.append(message)
                    return
            await send(message)

        exception: BaseException | None = None
        try:
            await self.app(scope, replay_receive, capture_send)
        except BaseException as exc:  # noqa: BLE001  # recorded, then re-raised unchanged
            exception = exc
            if isinstance(exc, asyncio.CancelledError):
                cancelled = True
        finally:
            otel_context.detach(token)
            # A disconnect after the app produced the whole response is not a cancelled call.
            await self._finish(call, span, attributes, exception, cancelled and not state.holding)
            # Capture never changes the response: what was held goes out now, durable or not.
            for message in state.held:
                await send(message)
        if exception is not None:
            raise exception

    def _start_span(
        self, call: InFlightCall, scope: Scope, headers: dict[str, list[bytes]], source: str, baggage_id: str | None
    ) -> tuple[trace.Span, dict[str, Any]]:
        parent = None
        if not trace.get_current_span().get_span_context().is_valid:
            # No HTTP server span around us: continue the caller's trace from its traceparent header.
            parent = propagate.extract({k: b",".join(v).decode("latin-1") for k, v in headers.items()})
        attributes = call.start_attributes()
        attributes[A.MODEL_CALL_ROLLOUT_SOURCE] = source
        if baggage_id is not None and baggage_id != call.rollout_id:
            attributes[A.ROLLOUT_ID_BAGGAGE] = baggage_id
        attributes.update(_server_attributes(scope, headers))
        name = f"{A.OPERATION_CHAT} {call.request_model}" if call.request_model else A.OPERATION_CHAT
        span = self._tracer.start_span(name, context=parent, kind=self._span_kind, attributes=attributes)
        return span, attributes

    async def _finish(
        self,
        call: InFlightCall,
        span: trace.Span,
        attributes: dict[str, Any],
        exception: BaseException | None,
        cancelled: bool,
    ) -> None:
        """End the span exactly once, record the metrics, and wait until the record is durable (or
        failed). Never raises."""
        finished: FinishedCall | None = None
        try:
            call.finish(exception=exception, cancelled=cancelled)
            end_attributes = call.end_attributes()
            span.set_attributes(end_attributes)  # the start attributes are on the span already
            attributes.update(end_attributes)
            if self.settings.content_on_spans:
                span.set_attributes(call.content_attributes(self.settings.content_max_length))
            self._metrics.record(attributes, *call.server_timings(attributes.get(A.GEN_AI_USAGE_OUTPUT_TOKENS)))
            if call.error_category is not None:
                span.set_status(Status(StatusCode.ERROR, call.error_category))
            if exception is not None and not isinstance(exception, asyncio.CancelledError):
                span.record_exception(exception)
            if self.sink is not None:
                context = span.get_span_context()
                loop = asyncio.get_running_loop()
                finished = FinishedCall(
                    call.rollout_id, call.model_call_id, call.line(context.trace_id, context.span_id),
                    tokens_line(call.response_obj, rollout_id=call.rollout_id, model_call_id=call.model_call_id),
                    LoopWaiter(loop, loop.create_future()),
                )
        except Exception as exc:
            _logger.exception("model-call capture failed while finishing a %s call", call.dialect)
            if self.sink is not None:
                self.sink.abandon_call(call.rollout_id, call.model_call_id, f"capture_error: {type(exc).__name__}: {exc}")
        finally:
            span.end()
        if finished is None or self.sink is None:
            return
        self.sink.write_call(finished)
        try:
            await finished.waiter.future  # resolved with the rest of its batch: one wake-up per batch
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001, S110  # the writer logged it, counted it and marked the rollout incomplete
            pass


class _SendState:
    __slots__ = ("content_length", "held", "holding", "sent")

    def __init__(self) -> None:
        self.holding = False
        self.held: list[Message] = []
        self.sent = 0
        self.content_length: int | None = None


async def _read_request(receive: Receive) -> tuple[list[Message], bool]:
    """Every request body message, read before the app runs (it reads the whole JSON body anyway), so the
    span starts with the request's model and parameters."""
    messages: list[Message] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            messages.append(message)
            return messages, True
        messages.append(message)
        if not message.get("more_body", False):
            return messages, False


def _dialect_of(scope: Scope) -> Dialect | None:
    if scope.get("method") != "POST":
        return None
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path + "/"):
        path = path[len(root_path):]  # a mounted app's route path, as Starlette routes it
    if len(path) > 1 and path.endswith("/"):
        path = path[:-1]
    return DIALECT_PATHS.get(path)


def _headers(scope: Scope) -> dict[str, list[bytes]]:
    headers: dict[str, list[bytes]] = {}
    for key, value in scope.get("headers", ()):
        headers.setdefault(key.decode("latin-1").lower(), []).append(value)
    return headers


def _server_attributes(scope: Scope, headers: dict[str, list[bytes]]) -> dict[str, Any]:
    """``server.address``/``server.port`` as the client addressed the server (its ``Host`` header, as the
    HTTP semconv does), else the socket the server listens on."""
    host = headers.get("host")
    if host:
        name, sep, port = host[0].decode("latin-1").strip().rpartition(":")
        if not sep or "]" in port:  # no port, or a bare IPv6 literal
            name, port = host[0].decode("latin-1").strip(), ""
        name = name.strip("[]")
        if name:
            attributes: dict[str, Any] = {A.SERVER_ADDRESS: name}
            if port.isdigit():
                attributes[A.SERVER_PORT] = int(port)
            elif scope.get("scheme") in ("http", "https"):
                attributes[A.SERVER_PORT] = 443 if scope["scheme"] == "https" else 80
            return attributes
    server = scope.get("server")
    if server and server[0]:
        attributes = {A.SERVER_ADDRESS: server[0]}
        if server[1] is not None:
            attributes[A.SERVER_PORT] = server[1]
        return attributes
    return {}


def _session_id(headers: dict[str, list[bytes]]) -> str | None:
    values = {v.decode("latin-1").strip() for v in headers.get("x-session-id", [])} - {""}
    return values.pop() if len(values) == 1 else None


def _header(headers: Any, name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


def _content_length(headers: Any) -> int | None:
    value = _header(headers, b"content-length").strip()
    return int(value) if value.isdigit() else None


def _invalid_id_error(rollout_id: str) -> dict[str, Any]:
    return {
        "error": {
            "type": "invalid_rollout_id",
            "message": f"invalid rollout id {rollout_id[:256]!r} in /ng-rollout/<id>/: {ROLLOUT_ID_RULE}",
            "rule": ROLLOUT_ID_RULE,
        }
    }


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = orjson.dumps(payload)
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    })
    await send({"type": "http.response.body", "body": body})
