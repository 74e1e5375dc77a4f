"""``LeanServerSpanMiddleware``: the HTTP server span at the cost a model server's hot path can afford.

A drop-in for contrib's ``opentelemetry.instrumentation.asgi.OpenTelemetryMiddleware`` with
``exclude_spans=["receive", "send"]``: the same span (kind ``SERVER``, or ``INTERNAL`` below a span
already current; the caller's W3C ``traceparent`` and ``baggage`` extracted with the global propagator
and current for the app), named by ``default_span_details`` (by default ``METHOD route`` without the
``/ng-rollout/<id>`` prefix), with the same exclusion list and the same response propagator. What
differs, each to save CPU per request:

- the stable HTTP semantic conventions only (as contrib emits with ``OTEL_SEMCONV_STABILITY_OPT_IN=http``),
  computed once and passed to ``start_span`` in one dict; the status code (and ``error.type``) set once,
  when the response ends;
- ``url.query`` with every value ``REDACTED`` (names kept), headers only when the constructor names them,
  credential headers (:data:`otel_capture._settings.SECRET_HEADERS`) always ``[REDACTED]`` (contract D37);
- one metric, ``http.server.request.duration``, recorded once, and only when the meter provider has a
  reader (the distro installs an SDK provider without one under ``OTEL_METRICS_EXPORTER=none``, where
  contrib still records three histograms and two counters per request) or is not the SDK's (a vendor's;
  the API's stand-in counts once a provider is set behind it);
- one context attach per request, no per-message work beyond one type check;
- nothing at all when no processor of the provider would see the span (``otel_capture._telemetry.spans``), no reader
  records the duration and no response propagator sends the span back: the app runs in the caller's
  context (its ``traceparent`` and ``baggage``, extracted as above), and a model call's span (or its context)
  is the caller's child directly.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.instrumentation.propagators import get_global_response_propagator
from opentelemetry.instrumentation.utils import is_http_instrumentation_enabled
from opentelemetry.propagators.textmap import Setter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.http import ExcludeList, parse_excluded_urls

from .. import _attributes as A
from .._asgi import ASGIApp, Message, Receive, Scope, Send
from .._correlation import server_span_details
from .._sdk_private import set_clean_attributes
from .._settings import SECRET_HEADERS
from .._version import __version__
from .metrics import MeterGate
from .spans import SpanGate

_logger = logging.getLogger(__name__)

SpanDetails = Callable[[Scope], tuple[str, dict[str, Any]]]
# RFC 9110 and RFC 5789 methods (and QUERY): any other is "_OTHER", its original in method_original
_KNOWN_METHODS = frozenset(
    {"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY", "TRACE"}
)
_SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_METRIC_KEYS = (A.HTTP_REQUEST_METHOD, A.URL_SCHEME, A.NETWORK_PROTOCOL_VERSION, A.HTTP_ROUTE)


class LeanServerSpanMiddleware:
    """Wraps an ASGI app in an HTTP server span per ``http`` request and ``websocket`` connection.

    The constructor takes what the instrumentor and the proxy give ``OpenTelemetryMiddleware``: providers
    (the global ones by default), ``excluded_urls`` (an ``ExcludeList`` or a comma-separated string, matched
    against the full URL), and ``default_span_details`` (the span's name and extra attributes for a scope).
    Header capture takes header-name patterns (full match, any case); values of headers whose names match
    ``sanitize_headers`` (searched, any case) or :data:`SECRET_HEADERS` read ``[REDACTED]``.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        excluded_urls: ExcludeList | str | None = None,
        default_span_details: SpanDetails | None = None,
        capture_request_headers: Sequence[str] = (),
        capture_response_headers: Sequence[str] = (),
        sanitize_headers: Sequence[str] = (),
    ) -> None:
        self.app = app
        self._tracer = trace.get_tracer(__name__, __version__, tracer_provider, schema_url=_SCHEMA_URL)
        self._spans = SpanGate(tracer_provider)
        self._duration = _DurationMetric(meter_provider)
        self._excluded = (
            parse_excluded_urls(excluded_urls) if isinstance(excluded_urls, str) else excluded_urls
        )
        self._details = default_span_details or server_span_details
        secrets = (*SECRET_HEADERS, *sanitize_headers)
        self._request_headers = _HeaderCapture.of(
            capture_request_headers, secrets, A.HTTP_REQUEST_HEADER_PREFIX
        )
        self._response_headers = _HeaderCapture.of(
            capture_response_headers, secrets, A.HTTP_RESPONSE_HEADER_PREFIX
        )
        self._propagation = _PropagationFields()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or not is_http_instrumentation_enabled():
            await self.app(scope, receive, send)
            return
        headers = _pick_headers(scope, self._propagation.wanted())
        if self._excluded is not None and self._excluded.url_disabled(_full_url(scope, headers)):
            await self.app(scope, receive, send)
            return
        parent: otel_context.Context | None = None
        span_kind = SpanKind.INTERNAL
        if not trace.get_current_span().get_span_context().is_valid:
            span_kind = SpanKind.SERVER
            if not self._propagation.fields.isdisjoint(headers):
                parent = propagate.extract(headers)
        if self._nobody_would_see():
            # the app runs in the caller's context (its traceparent and baggage, when it sent them), with no
            # span of ours between
            if parent is None:
                await self.app(scope, receive, send)
            else:
                await self._in_context(parent, scope, receive, send)
            return
        name, extra = self._details(scope)
        attributes = _request_attributes(scope, headers)
        attributes.update(extra)
        if self._request_headers is not None:
            attributes.update(self._request_headers.attributes(scope.get("headers", ())))
        if self._spans.attributes_after_start():  # the same span, its attributes stored without the check
            span = self._tracer.start_span(name, context=parent, kind=span_kind)
            set_clean_attributes(span, attributes)
        else:
            span = self._tracer.start_span(name, context=parent, kind=span_kind, attributes=attributes)
        exchange = _Exchange(self, span, attributes, send)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            await self.app(scope, receive, exchange.send)
        except Exception as exc:
            exchange.end(exc)
            raise
        finally:
            otel_context.detach(token)
            exchange.end(None)

    def _nobody_would_see(self) -> bool:
        """No processor would see the span, no reader record its duration, no response propagator send it
        back to the client."""
        if not self._spans.unseen() or self._duration.recording:
            return False
        return get_global_response_propagator() is None  # type: ignore[no-untyped-call]  # contrib's, untyped

    async def _in_context(
        self, parent: otel_context.Context, scope: Scope, receive: Receive, send: Send
    ) -> None:
        token = otel_context.attach(parent)
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)


class _Exchange:
    """One request's span from its start to the end of its response: the send wrapper and the end."""

    __slots__ = ("_attributes", "_middleware", "_send", "_started", "_trailers", "ended", "span", "status")

    def __init__(
        self, middleware: LeanServerSpanMiddleware, span: trace.Span, attributes: dict[str, Any], send: Send
    ):
        self._middleware = middleware
        self._attributes = attributes
        self._send = send
        self._started = time.perf_counter()
        self._trailers = False
        self.span = span
        self.status: int | None = None
        self.ended = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._on_response_start(message)
        await self._send(message)
        if kind == "http.response.body":
            if not message.get("more_body", False) and not self._trailers:
                self.end(None)
        elif (kind == "http.response.trailers" and not message.get("more_trailers", False)) or (
            kind == "http.response.pathsend"
        ):
            self.end(None)

    def _on_response_start(self, message: Message) -> None:
        self.status = message["status"]
        self._trailers = bool(message.get("trailers", False))
        middleware = self._middleware
        if middleware._response_headers is not None and self.span.is_recording():
            set_clean_attributes(
                self.span, middleware._response_headers.attributes(message.get("headers", ()))
            )
        propagator = get_global_response_propagator()  # type: ignore[no-untyped-call]  # contrib's, untyped
        if propagator is not None:
            headers = list(message.get("headers", ()))
            propagator.inject(headers, trace.set_span_in_context(self.span), setter=_RESPONSE_HEADERS)
            message["headers"] = headers

    def end(self, exception: BaseException | None) -> None:
        """Set the status code and error once, record the duration, end the span; the first call wins."""
        if self.ended:
            return
        self.ended = True
        span = self.span
        outcome: dict[str, Any] = {}
        if self.status is not None:
            outcome[A.HTTP_RESPONSE_STATUS_CODE] = self.status
        if exception is not None:
            outcome[A.ERROR_TYPE] = _error_type(exception)
            span.record_exception(exception)
            span.set_status(Status(StatusCode.ERROR, f"{type(exception).__name__}: {exception}"))
        elif self.status is not None and self.status >= 500:
            outcome[A.ERROR_TYPE] = str(self.status)
            span.set_status(Status(StatusCode.ERROR))
        if outcome:
            set_clean_attributes(span, outcome)
        self._middleware._duration.record(time.perf_counter() - self._started, self._attributes, outcome)
        span.end()


class _DurationMetric:
    """``http.server.request.duration``, recorded only while the meter provider has a reader."""

    def __init__(self, meter_provider: metrics.MeterProvider | None) -> None:
        provider = meter_provider or metrics.get_meter_provider()
        meter = provider.get_meter(__name__, __version__, schema_url=_SCHEMA_URL)
        self._histogram = meter.create_histogram(
            A.METRIC_HTTP_SERVER_REQUEST_DURATION,
            unit="s",
            description="Duration of HTTP server requests.",
            explicit_bucket_boundaries_advisory=list(A.BUCKETS_HTTP_SERVER_REQUEST_DURATION),
        )
        self._gate = MeterGate(meter_provider)

    @property
    def recording(self) -> bool:
        """False while a measurement would go nowhere (:class:`MeterGate`), where it costs about 10 µs."""
        return self._gate.recording

    def record(self, seconds: float, request: Mapping[str, Any], outcome: Mapping[str, Any]) -> None:
        if not self.recording:
            return
        try:
            attributes = {key: request[key] for key in _METRIC_KEYS if key in request}
            attributes.update(outcome)
            self._histogram.record(max(seconds, 0.0), attributes)
        except Exception:  # telemetry never breaks the host app
            _logger.exception("recording http.server.request.duration failed")


class _HeaderCapture:
    """The ``http.request.header.<name>`` / ``http.response.header.<name>`` attributes of the configured
    headers (names lower-case, as the stable HTTP conventions write them), credentials redacted."""

    def __init__(self, patterns: Sequence[str], secrets: Sequence[str], prefix: str) -> None:
        self._match = re.compile("|".join(patterns), re.IGNORECASE)
        self._secret = re.compile("|".join(secrets), re.IGNORECASE)
        self._prefix = prefix

    @classmethod
    def of(cls, patterns: Sequence[str], secrets: Sequence[str], prefix: str) -> _HeaderCapture | None:
        patterns = [p.strip() for p in patterns if p.strip()]
        return cls(patterns, [s.strip() for s in secrets if s.strip()], prefix) if patterns else None

    def attributes(self, headers: Iterable[tuple[bytes, bytes]]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for raw_name, raw_value in headers:
            name = bytes(raw_name).decode("latin-1").lower()
            if self._match.fullmatch(name):
                value = "[REDACTED]" if self._secret.search(name) else bytes(raw_value).decode("latin-1")
                found.setdefault(self._prefix + name, []).append(value)
        return found


class _PropagationFields:
    """The header names the global propagator reads (``traceparent``, ``tracestate``, ``baggage`` by
    default), recomputed only when another propagator is set."""

    def __init__(self) -> None:
        self._propagator: object = None
        self.fields: frozenset[str] = frozenset()
        self._wanted: frozenset[bytes] = frozenset()

    def wanted(self) -> frozenset[bytes]:
        propagator = propagate.get_global_textmap()
        if propagator is not self._propagator:
            self.fields = frozenset(f.lower() for f in propagator.fields)
            self._wanted = frozenset(f.encode("latin-1") for f in self.fields) | {b"host", b"user-agent"}
            self._propagator = propagator
        return self._wanted


class _ResponseHeaderSetter(Setter[list[tuple[bytes, bytes]]]):
    def set(self, carrier: list[tuple[bytes, bytes]], key: str, value: str) -> None:
        carrier.append((key.lower().encode("latin-1"), value.encode("latin-1")))


_RESPONSE_HEADERS = _ResponseHeaderSetter()


def _pick_headers(scope: Scope, wanted: frozenset[bytes]) -> dict[str, str]:
    """The request headers the span needs, by lower-case name (repeated ones joined with ``,``)."""
    picked: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers", ()):
        name = bytes(raw_name).lower()
        if name in wanted:
            key = name.decode("latin-1")
            value = bytes(raw_value).decode("latin-1")
            picked[key] = f"{picked[key]},{value}" if key in picked else value
    return picked


def _request_attributes(scope: Scope, headers: Mapping[str, str]) -> dict[str, Any]:
    """The stable HTTP server-span attributes a request carries, in one dict."""
    http = scope["type"] == "http"
    scheme: str = scope.get("scheme") or ("http" if http else "ws")
    attributes: dict[str, Any] = {A.URL_SCHEME: scheme, A.URL_PATH: scope.get("path", "")}
    if http:
        original = str(scope.get("method", ""))
        method = original.upper()
        if method in _KNOWN_METHODS:
            attributes[A.HTTP_REQUEST_METHOD] = method
        else:
            attributes[A.HTTP_REQUEST_METHOD] = "_OTHER"
            attributes[A.HTTP_REQUEST_METHOD_ORIGINAL] = original
    query: bytes = scope.get("query_string", b"")
    if query:
        attributes[A.URL_QUERY] = redact_query(query).decode("latin-1")
    version = scope.get("http_version")
    if version:
        attributes[A.NETWORK_PROTOCOL_VERSION] = version
    attributes.update(_server_address(scope, headers.get("host"), scheme))
    client = scope.get("client")
    if client and client[0]:
        attributes[A.CLIENT_ADDRESS] = client[0]
    agent = headers.get("user-agent")
    if agent:
        attributes[A.USER_AGENT_ORIGINAL] = agent
    return attributes


def _server_address(scope: Scope, host: str | None, scheme: str) -> dict[str, Any]:
    """``server.address``/``server.port`` as the client addressed the server (its ``Host`` header), else
    the socket the server listens on."""
    if host:
        host = host.split(",", 1)[0].strip()
        name, sep, port = host.rpartition(":")
        if not sep or "]" in port:  # no port, or a bare IPv6 literal
            name, port = host, ""
        name = name.strip("[]")
        if name:
            if port.isdigit():
                return {A.SERVER_ADDRESS: name, A.SERVER_PORT: int(port)}
            default = _DEFAULT_PORTS.get(scheme)
            return {A.SERVER_ADDRESS: name, A.SERVER_PORT: default} if default else {A.SERVER_ADDRESS: name}
    server = scope.get("server")
    if server and server[0]:
        return (
            {A.SERVER_ADDRESS: server[0], A.SERVER_PORT: server[1]}
            if server[1]
            else {A.SERVER_ADDRESS: server[0]}
        )
    return {}


def _full_url(scope: Scope, headers: Mapping[str, str]) -> str:
    """The URL contrib matches exclusion patterns against: scheme, ``Host`` (else the socket), path."""
    host = headers.get("host")
    if not host:
        server = scope.get("server") or ("0.0.0.0", 80)  # contrib's fallback, only for matching
        host = server[0] if server[1] in (None, 80) else f"{server[0]}:{server[1]}"
    return f"{scope.get('scheme', 'http')}://{host}{scope.get('path', '')}"


def _error_type(exception: BaseException) -> str:
    """The exception's fully qualified class name (``builtins`` left out), as ``error.type`` wants it."""
    cls = type(exception)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def redact_query(query: bytes) -> bytes:
    """``a=1&key=sk-x&flag`` -> ``a=REDACTED&key=REDACTED&flag``."""
    parts = []
    for part in query.split(b"&"):
        name, sep, _value = part.partition(b"=")
        parts.append(name + b"=REDACTED" if sep else part)
    return b"&".join(parts)
