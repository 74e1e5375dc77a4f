"""``SpanGate.context_only`` (a span nobody sees: only its context) decides the flags and trace state the
provider's sampler would, with the SDK's default sampler read without asking it, and any other asked."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState

from otel_capture._sdk_private import is_default_parent_based
from otel_capture._telemetry import SpanGate
from otel_capture._telemetry.provider import SinkOnlyProcessor

_STATE = TraceState([("vendor", "value")])


def _parents() -> list[trace.Context | None]:
    contexts: list[trace.Context | None] = [None]
    for remote in (True, False):
        for flags in (TraceFlags(TraceFlags.SAMPLED), TraceFlags(TraceFlags.DEFAULT)):
            parent = SpanContext(0x1234, 0x5678, is_remote=remote, trace_flags=flags, trace_state=_STATE)
            contexts.append(trace.set_span_in_context(NonRecordingSpan(parent)))
    return contexts


def test_the_sdks_default_sampler_is_told_from_any_other() -> None:
    assert is_default_parent_based(TracerProvider().sampler)
    assert is_default_parent_based(DEFAULT_ON) and is_default_parent_based(ParentBased(ALWAYS_ON))
    assert not is_default_parent_based(ParentBased(ALWAYS_OFF))
    assert not is_default_parent_based(ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON))
    assert not is_default_parent_based(ALWAYS_ON)
    assert not is_default_parent_based(TraceIdRatioBased(0.5))


@pytest.mark.parametrize(
    "sampler",
    [
        DEFAULT_ON,
        ParentBased(ALWAYS_OFF),
        ALWAYS_OFF,
        ParentBased(ALWAYS_ON, local_parent_not_sampled=ALWAYS_ON),
    ],
    ids=["default", "parentbased_always_off", "always_off", "custom_parent_based"],
)
def test_the_context_has_the_flags_and_state_the_sampler_decides(sampler: Sampler) -> None:
    provider = TracerProvider(sampler=sampler)
    gate = SpanGate(provider)
    for context in _parents():
        span = gate.context_only("chat m", context, SpanKind.INTERNAL)
        made = span.get_span_context()
        parent = trace.get_current_span(context).get_span_context()
        expected = sampler.should_sample(context, made.trace_id, "chat m", SpanKind.INTERNAL, None, ())
        assert made.trace_flags.sampled is expected.decision.is_sampled()
        assert made.trace_state == (expected.trace_state or TraceState())
        assert not made.is_remote and made.span_id != parent.span_id
        if parent.is_valid:
            assert made.trace_id == parent.trace_id


def test_a_sampler_set_on_the_provider_later_is_asked_from_then_on() -> None:
    provider = TracerProvider()
    gate = SpanGate(provider)
    assert gate.context_only("chat m", None, SpanKind.INTERNAL).get_span_context().trace_flags.sampled
    provider.sampler = ALWAYS_OFF  # type: ignore[misc]  # a provider whose sampler is replaced
    assert not gate.context_only("chat m", None, SpanKind.INTERNAL).get_span_context().trace_flags.sampled


def test_start_attributes_wait_until_after_the_start_only_where_nobody_reads_them_there() -> None:
    """``SpanGate.attributes_after_start``: the SDK's default sampler and the SDK's own processors only (the
    proxy's too); a processor of anyone else's, added now or later, or another sampler, reads them at the
    start: they go in with it."""
    provider = TracerProvider()
    gate = SpanGate(provider)
    assert gate.attributes_after_start()  # no processor at all
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    provider.add_span_processor(SinkOnlyProcessor(InMemorySpanExporter()))
    assert gate.attributes_after_start()
    provider.add_span_processor(SpanProcessor())  # not known to read nothing at the start
    assert not gate.attributes_after_start()
    assert not SpanGate(TracerProvider(sampler=TraceIdRatioBased(0.5))).attributes_after_start()
    assert not SpanGate(trace.NoOpTracerProvider()).attributes_after_start()
