"""The captured call's trace headers (otel_capture._capture.propagation): with the W3C propagator they are
written without the propagator API, and must be what the API writes, for every caller; any other
propagator goes through the API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_capture._capture.propagation import caller_context, is_w3c, with_trace_headers
from otel_capture._correlation.routing import headers_by_name

CALLER_PARENT = (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
CALLER_STATE = (b"tracestate", b"caller=1")
CALLER_BAGGAGE = (b"baggage", b"rollout.id=r1,k=v")
PLAIN = [(b"host", b"example"), (b"content-type", b"application/json")]

CALLERS = {
    "no trace headers": PLAIN,
    "traceparent": [*PLAIN, CALLER_PARENT],
    "traceparent and tracestate": [CALLER_PARENT, *PLAIN, CALLER_STATE],
    "tracestate alone": [*PLAIN, CALLER_STATE],
    "names in capitals": [(b"Traceparent", CALLER_PARENT[1]), (b"TraceState", b"a=b"), *PLAIN],
    "two traceparents": [CALLER_PARENT, *PLAIN, CALLER_PARENT],
    "baggage": [*PLAIN, CALLER_BAGGAGE],
}
SPANS = {
    "sampled": SpanContext(0xABC, 0xDEF, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)),
    "not sampled": SpanContext(1 << 120, 7, is_remote=False, trace_flags=TraceFlags(0)),
    "with trace state": SpanContext(
        0xABC, 0xDEF, is_remote=False, trace_flags=TraceFlags(1), trace_state=TraceState([("v", "1")])
    ),
}


@pytest.fixture
def textmap() -> Iterator[Any]:
    """Sets the global propagator for a test; the one before is set back after it."""
    before = propagate.get_global_textmap()
    yield propagate.set_global_textmap
    propagate.set_global_textmap(before)


def _through_the_api(headers: list[tuple[bytes, bytes]], context: otel_context.Context) -> list[Any]:
    """What the propagator API writes: the injected fields (baggage left as sent) in place of the caller's."""
    fields: dict[str, str] = {}
    propagate.inject(fields, context)
    fields.pop("baggage", None)
    names = {name.encode("latin-1") for name in fields}
    kept = [(k, v) for k, v in headers if k.lower() not in names]
    return kept + [(k.encode("latin-1"), v.encode("latin-1")) for k, v in fields.items()]


def _w3c_textmaps() -> list[Any]:
    return [
        CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()]),
        CompositePropagator([TraceContextTextMapPropagator()]),
        TraceContextTextMapPropagator(),
    ]


@pytest.mark.parametrize("caller", sorted(CALLERS))
@pytest.mark.parametrize("span_name", sorted(SPANS))
@pytest.mark.parametrize("w3c", range(3))
def test_the_w3c_trace_headers_are_what_the_propagator_api_writes(
    textmap: Any, caller: str, span_name: str, w3c: int
) -> None:
    textmap(_w3c_textmaps()[w3c])
    headers, span = CALLERS[caller], SPANS[span_name]
    context = trace.set_span_in_context(NonRecordingSpan(span), baggage.set_baggage("k", "v"))
    ours = with_trace_headers(list(headers), headers_by_name({"headers": headers}), span, context)
    assert ours == _through_the_api(headers, context)


def test_another_propagator_writes_through_the_api(textmap: Any) -> None:
    class Custom(TraceContextTextMapPropagator):
        def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
            carrier["x-custom-trace"] = "t"

    textmap(CompositePropagator([Custom(), W3CBaggagePropagator()]))
    span = SPANS["sampled"]
    context = trace.set_span_in_context(NonRecordingSpan(span))
    headers = CALLERS["traceparent"]
    ours = with_trace_headers(list(headers), headers_by_name({"headers": headers}), span, context)
    assert ours == [*headers, (b"x-custom-trace", b"t")]


def test_only_trace_context_first_and_baggage_after_it_is_w3c() -> None:
    trace_context, w3c_baggage = TraceContextTextMapPropagator(), W3CBaggagePropagator()
    assert all(is_w3c(t) for t in _w3c_textmaps())
    assert not is_w3c(w3c_baggage)
    assert not is_w3c(CompositePropagator([w3c_baggage, trace_context]))  # baggage first extracts otherwise
    assert not is_w3c(CompositePropagator([trace_context, w3c_baggage, w3c_baggage]))
    assert not is_w3c(CompositePropagator([]))

    class Subclass(TraceContextTextMapPropagator):
        pass

    assert not is_w3c(CompositePropagator([Subclass(), w3c_baggage]))


@pytest.mark.parametrize("caller", sorted(CALLERS))
@pytest.mark.parametrize("w3c", range(3))
def test_the_callers_context_is_what_the_propagator_api_extracts(textmap: Any, caller: str, w3c: int) -> None:
    textmap(_w3c_textmaps()[w3c])
    headers = headers_by_name({"headers": CALLERS[caller]})
    token = otel_context.attach(baggage.set_baggage("current", "1"))  # not the caller's: never read
    try:
        plain = propagate.extract({k: b",".join(v).decode("latin-1") for k, v in headers.items()})
        ours = caller_context(headers)
    finally:
        otel_context.detach(token)
    assert set(ours) == set(plain)  # nothing of the current context either way
    assert trace.get_current_span(ours).get_span_context() == trace.get_current_span(plain).get_span_context()
    assert baggage.get_all(ours) == baggage.get_all(plain)
