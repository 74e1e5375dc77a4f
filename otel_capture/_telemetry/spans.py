"""A span no processor would see is not built: only its context is.

An SDK span costs about a third of a captured call's own CPU (the object, every attribute validated, the
processors called at its start and end). With the records' exporter alone on the tracer provider
(``OTEL_TRACES_EXPORTER=model_call_jsonl``, the usual set-up for a training run), that work goes nowhere:
the exporter takes its records from the middleware, not from spans. :class:`SpanGate` tells when every
processor of the provider ignores spans, and :meth:`SpanGate.context_only` then makes what the SDK makes
for a span its sampler drops, a ``NonRecordingSpan``: the trace id continued from the parent (or a new
one), a new span id, and the sampler's flags. That context is current for the app (its outgoing calls
carry it in ``traceparent``) and names the call in its record (``trace_id``, ``span_id``).

A processor ignores spans when it is the proxy's ``SinkOnlyProcessor``, or the SDK's own ``SimpleSpanProcessor``
or ``BatchSpanProcessor`` (those exact classes, not subclasses) around an exporter that says so with
``ignores_spans = True`` (``ModelCallJsonlExporter``). Any other processor (OTLP, an in-memory exporter, a
vendor's) brings the spans back from the next call on: the provider's processors are looked at per call,
by identity, so one added later counts at once.

The same look at the processors puts the capture's OTLP encoder (:mod:`.otlp`, the same bytes for less
CPU) behind each of the SDK's own OTLP span exporters it finds there, whoever built them.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from .._sdk_private import (
    is_default_parent_based,
    processor_exporter,
    provider_disabled,
    span_processors,
)
from .otlp import use_own_encoder
from .provider import SinkOnlyProcessor

IGNORES_SPANS = "ignores_spans"  # an exporter's class attribute: True when its export() does nothing
# processors whose on_start does nothing with the span (the SDK's own, and the proxy's SimpleSpanProcessor)
_PLAIN_START = frozenset((SimpleSpanProcessor, BatchSpanProcessor, SinkOnlyProcessor))


class SpanGate:
    """Whether a tracer provider's spans are seen by anyone, and the span context to use when they are
    not. ``tracer_provider`` ``None`` means the global one, read per call (it may be set later)."""

    __slots__ = (
        "_default_sampler",
        "_plain_start",
        "_processors",
        "_provider",
        "_sampler",
        "_unseen",
    )

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._provider = tracer_provider
        self._processors: object = None  # the provider's processors looked at last (by identity)
        self._unseen = False  # and whether every one of them ignores spans
        self._plain_start = False  # and whether none of them reads a span at its start
        self._sampler: object = None  # the provider's sampler looked at last
        self._default_sampler = False  # and whether it is the SDK's default (is_default_parent_based)

    def _sdk_provider(self) -> Any:
        return self._provider if self._provider is not None else trace.get_tracer_provider()

    def unseen(self) -> bool:
        """True when the provider is the SDK's and every one of its processors ignores spans (or it has
        none). Any other provider (the API's proxy before one is set, a vendor's) decides for itself."""
        return self._looked_at() is not None and self._unseen

    def _looked_at(self) -> Any:
        """The provider when it is the SDK's and enabled, its processors looked at (:meth:`_look_at`);
        ``None`` for any other provider (which decides for itself) or a disabled one."""
        provider = self._sdk_provider()
        processors = span_processors(provider)
        if processors is None or provider_disabled(provider):
            return None
        self._look_at(processors)
        return provider

    def _look_at(self, processors: tuple[Any, ...]) -> None:
        """What the provider's processors mean for a span, looked at again only when one was added."""
        if processors is self._processors:
            return
        unseen = all(ignores_spans(p) for p in processors)
        if not unseen:
            _encode_own(processors)
        self._unseen, self._processors = unseen, processors
        self._plain_start = all(type(p) in _PLAIN_START for p in processors)

    def _default(self, sampler: object) -> bool:
        """Whether ``sampler`` is the SDK's default (:func:`is_default_parent_based`), looked at again only
        when the provider has another."""
        if sampler is not self._sampler:
            self._sampler, self._default_sampler = sampler, is_default_parent_based(sampler)
        return self._default_sampler

    def unread(self) -> bool:
        """:meth:`unseen`, and the span's name decides nothing either: the provider's sampler is the SDK's
        default (parent-based, always on), which :meth:`context_only` does not ask. Then a context-only
        span can be named before the request is read (by its operation alone)."""
        provider = self._looked_at()
        return provider is not None and self._unseen and self._default(provider.sampler)

    def attributes_after_start(self) -> bool:
        """Whether a span's start attributes can be put in just after its start, unseen: the provider is the
        SDK's, its sampler the SDK's default (which decides without them), and each of its processors one of
        the SDK's own (or the proxy's), whose ``on_start`` reads nothing of the span. Then they are stored
        without the SDK's check of every value (:func:`otel_capture._sdk_private.set_clean_attributes`)."""
        provider = self._looked_at()
        return provider is not None and self._plain_start and self._default(provider.sampler)

    def context_only(
        self, name: str, context: otel_context.Context | None, kind: SpanKind
    ) -> NonRecordingSpan:
        """What the SDK's tracer returns for a span its sampler does not record: a ``NonRecordingSpan``
        with the parent's trace id (from ``context``, else the current one) or a new one, a new span id,
        and the flags and trace state of the provider's sampler. The sampler is asked without attributes:
        nothing records them, it only decides the flags the app's outgoing calls carry."""
        provider = self._sdk_provider()
        ids = provider.id_generator
        parent = trace.get_current_span(context).get_span_context()
        if parent.is_valid:
            trace_id = parent.trace_id
            random_id = getattr(parent.trace_flags, "random_trace_id", False)
        else:
            trace_id = ids.generate_trace_id()
            is_random = getattr(ids, "is_trace_id_random", None)  # newer SDKs' generators say
            random_id = is_random is not None and is_random()
        sampler = provider.sampler
        if self._default(sampler):  # what it decides, without its result object: the parent's flag
            sampled = parent.trace_flags.sampled if parent.is_valid else True
            trace_state = parent.trace_state if parent.is_valid else None
        else:
            result = sampler.should_sample(context, trace_id, name, kind, None, ())
            sampled, trace_state = result.decision.is_sampled(), result.trace_state
        flags = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
        if random_id:
            flags |= getattr(TraceFlags, "RANDOM_TRACE_ID", 0)
        return NonRecordingSpan(
            SpanContext(
                trace_id,
                ids.generate_span_id(),
                is_remote=False,
                trace_flags=TraceFlags(flags),
                trace_state=trace_state,
            )
        )


def _encode_own(processors: tuple[Any, ...]) -> None:
    """The capture's encoder behind the SDK's OTLP exporters among the SDK's own processors."""
    for processor in processors:
        kind = type(processor)
        if kind is SimpleSpanProcessor or kind is BatchSpanProcessor:
            use_own_encoder(processor_exporter(processor))


def ignores_spans(processor: object) -> bool:
    """Whether a span processor does nothing with the spans it is given (see the module's docstring)."""
    kind = type(processor)
    if kind is SinkOnlyProcessor:
        return True
    if kind is not SimpleSpanProcessor and kind is not BatchSpanProcessor:
        return False
    # where the SDK keeps the exporter, as the sink lookup reads it (._sdk_private); not found: built
    return getattr(processor_exporter(processor), IGNORES_SPANS, False) is True
