"""A captured call's trace context on the way in and out: the caller's context read from the request's
headers (when no span is current), and the call span's ``traceparent`` (and ``tracestate``) put on the
request the app sees, so an app that traces from its headers (vLLM's engine) nests under the call.

Both go through the global propagator (``OTEL_PROPAGATORS``). When it is the W3C one the SDK sets by
default (``tracecontext``, then ``baggage``; or ``tracecontext`` alone), the same headers are written
here without it: the propagator API's per-call dict, setter and baggage walk were about a tenth of the
middleware's own CPU per call. Any other propagator is called as it is.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import Getter, TextMapPropagator
from opentelemetry.trace import SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .._sdk_private import composite_propagators

_TRACEPARENT = "traceparent"
_TRACESTATE = "tracestate"
_BAGGAGE = "baggage"
_TRACEPARENT_NAME = _TRACEPARENT.encode()
_TRACESTATE_NAME = _TRACESTATE.encode()


class _HeadersGetter(Getter[dict[str, list[bytes]]]):
    """The propagators read the request's headers where they are (``headers_by_name``), not from a copy of
    every header decoded per call."""

    def get(self, carrier: dict[str, list[bytes]], key: str) -> list[str] | None:
        values = carrier.get(key)
        return None if values is None else [b",".join(values).decode("latin-1")]

    def keys(self, carrier: dict[str, list[bytes]]) -> list[str]:
        return list(carrier)


HEADERS_GETTER = _HeadersGetter()


def is_w3c(textmap: TextMapPropagator) -> bool:
    """Whether ``textmap`` is W3C trace context first, then at most W3C baggage (those exact classes): what
    the SDK sets by default and under ``OTEL_PROPAGATORS=tracecontext[,baggage]``."""
    propagators = composite_propagators(textmap) if type(textmap) is CompositePropagator else (textmap,)
    if not propagators or type(propagators[0]) is not TraceContextTextMapPropagator:
        return False
    rest = propagators[1:]
    return len(rest) <= 1 and all(type(p) is W3CBaggagePropagator for p in rest)


class _GlobalPropagator:
    """Whether the global propagator is the W3C one (:func:`is_w3c`), looked at again only when another
    is set."""

    __slots__ = ("_textmap", "_w3c")

    def __init__(self) -> None:
        self._textmap: object = None
        self._w3c = False

    def w3c(self) -> bool:
        textmap = propagate.get_global_textmap()
        if textmap is not self._textmap:
            self._textmap, self._w3c = textmap, is_w3c(textmap)
        return self._w3c


_GLOBAL = _GlobalPropagator()


def caller_context(headers: dict[str, list[bytes]]) -> otel_context.Context:
    """The caller's context from the request's headers (by lower-case name), as ``propagate.extract``
    reads it: with the W3C propagator and neither ``traceparent`` nor ``baggage`` sent, an empty context."""
    if _TRACEPARENT not in headers and _BAGGAGE not in headers and _GLOBAL.w3c():
        return otel_context.Context()
    return propagate.extract(headers, getter=HEADERS_GETTER)


def current_trace_fields() -> dict[str, str]:
    """The trace headers the global propagator writes for the current span, without its ``baggage`` (a
    relay passes the caller's as sent): with the W3C propagator written here as
    ``TraceContextTextMapPropagator.inject`` writes them, else by the propagator. The proxy's headers to
    its upstream, whose parent is the proxy's span."""
    if not _GLOBAL.w3c():
        fields: dict[str, str] = {}
        propagate.inject(fields)
        fields.pop(_BAGGAGE, None)
        return fields
    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return {}
    traceparent = f"00-{span.trace_id:032x}-{span.span_id:016x}-{span.trace_flags:02x}"
    if span.trace_state:
        return {_TRACEPARENT: traceparent, _TRACESTATE: span.trace_state.to_header()}
    return {_TRACEPARENT: traceparent}


def with_trace_headers(
    headers: Any, by_name: dict[str, list[bytes]], span: SpanContext, context: otel_context.Context
) -> list[tuple[bytes, bytes]]:
    """The request's ``headers`` with the call span's ``traceparent`` (and the propagators' other trace
    fields, e.g. ``tracestate``, which the span carries from its parent) in place of the caller's. The
    caller's ``baggage`` goes on as it was sent, as the proxy passes it. ``by_name`` is the caller's
    headers by lower-case name (a caller that sent no trace header has none to drop); ``span`` is the
    valid context of the span current in ``context``."""
    if _GLOBAL.w3c():  # what TraceContextTextMapPropagator.inject writes, written here as bytes
        traceparent = b"00-%032x-%016x-%02x" % (span.trace_id, span.span_id, span.trace_flags)
        state = span.trace_state.to_header() if span.trace_state else ""
        if _TRACEPARENT not in by_name and (_TRACESTATE not in by_name or not state):
            kept = list(headers)  # none of the caller's to replace
        else:
            names = {_TRACEPARENT_NAME, _TRACESTATE_NAME} if state else {_TRACEPARENT_NAME}
            kept = [(k, v) for k, v in headers if k.lower() not in names]
        kept.append((_TRACEPARENT_NAME, traceparent))
        if state and "\r" not in state and "\n" not in state:
            kept.append((_TRACESTATE_NAME, state.encode("latin-1")))
        return kept
    fields: dict[str, str] = {}
    propagate.inject(fields, context)
    fields.pop(_BAGGAGE, None)
    names = {name.encode("latin-1") for name in fields}
    kept = [(k, v) for k, v in headers if k.lower() not in names]
    kept += [
        (k.encode("latin-1"), v.encode("latin-1"))
        for k, v in fields.items()
        if "\r" not in v and "\n" not in v
    ]
    return kept
