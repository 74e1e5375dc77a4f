"""Every private attribute of the OpenTelemetry SDK (and of contrib's instrumentations) this package reads,
in one place.

The SDK has no public way to list a tracer provider's span processors, to reach the exporter a processor
wraps, or to resolve ``OTEL_TRACES_EXPORTER`` and ``OTEL_TRACES_SAMPLER`` as ``opentelemetry-instrument``
does. What is read, and who needs it:

- ``TracerProvider._active_span_processor._span_processors``: the provider's processors (the sink lookup,
  :mod:`._capture.sink`; whether anyone sees a span, :mod:`._telemetry.spans`);
- ``TracerProvider._disabled``: ``OTEL_SDK_DISABLED`` (:mod:`._telemetry.spans`);
- ``SimpleSpanProcessor.span_exporter`` and ``BatchSpanProcessor._batch_processor._exporter`` (older SDKs:
  ``BatchSpanProcessor.span_exporter``): the exporter behind a processor (:mod:`._capture.sink`,
  :mod:`._telemetry.spans`);
- ``opentelemetry.sdk._configuration._get_exporter_names``, ``_get_sampler`` and ``_import_sampler``: the
  SDK's own reading of ``OTEL_TRACES_EXPORTER`` and ``OTEL_TRACES_SAMPLER[_ARG]``
  (:mod:`._telemetry.provider`);
- ``MeterProvider._measurement_consumer._reader_storages``: whether an SDK meter provider has a metric
  reader (a measurement without one goes nowhere), and the metrics API's stand-in
  ``_ProxyMeterProvider._real_meter_provider``: whether a provider was set behind it
  (:class:`otel_capture._telemetry.metrics.MeterGate`);
- the SDK's OTLP span exporters: over HTTP, the method of ``OTLPSpanExporter`` that calls its module's
  ``encode_spans`` (``export``; older releases: ``_serialize_spans``), over gRPC, its ``_translate_data``
  and the ``encode_spans`` and ``ExportTraceServiceRequest`` its module imported: where
  :mod:`._telemetry.otlp` puts its own encoder (the SDK's stays for what that encoder does not write);
- ``ParentBased._root`` and its four ``_*_parent_*`` delegates: whether the provider's sampler is the SDK's
  default (``parentbased_always_on``), whose decision for a span nobody sees is the parent's flag, read
  without the sampler's per-call result object (:mod:`._telemetry.spans`);
- ``CompositePropagator._propagators``: the propagators behind the global one, so the capture writes the
  W3C trace headers itself when they are the SDK's default (:mod:`._capture.propagation`);
- ``Span._attributes`` (a ``BoundedAttributes``: its ``_dict``, ``_lock``, ``maxlen``, ``max_value_len`` and
  ``_immutable``), ``Span._lock`` and ``Span._end_time``: the model-call span's own attributes stored as the
  SDK's ``set_attributes`` stores them, without its check of every value (:func:`set_clean_attributes`);
- ``app._is_instrumented_by_opentelemetry``: the mark contrib's FastAPI/Starlette instrumentation leaves on
  an app it wrapped in its own HTTP server span (:mod:`._instrumentor`).

The one private attribute of another library read elsewhere is FastAPI's ``app._telemetry`` (the config of
``FastAPI(telemetry=...)``), in :mod:`._instrumentor`, which switches FastAPI's own request telemetry off.

``tests/unit/test_sdk_private.py`` pins each against the installed SDK, so a release that renames one fails
the tests loudly instead of leaving a middleware that writes no records (or metrics) and says nothing. At
run time a provider of the SDK's (or the API's) own class that lacks them is logged once, as an error naming
the SDK's version.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.metrics import _internal as metrics_api
from opentelemetry.sdk import _configuration as sdk_configuration
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler

__all__ = [
    "composite_propagators",
    "configured_exporter_names",
    "configured_sampler",
    "grpc_request_class",
    "has_metric_readers",
    "http_encoding_methods",
    "instrumented_by_contrib",
    "is_default_parent_based",
    "is_meter_provider_stand_in",
    "measurement_consumer",
    "meter_provider_pending",
    "processor_exporter",
    "provider_disabled",
    "set_clean_attributes",
    "span_processors",
]

_logger = logging.getLogger(__name__)
_reported: set[str] = set()


_NO_SINK = "model-call records cannot be routed (no sink is found) and every span is built"
_METRICS_ASSUMED = "metrics are recorded as if a reader were there"
_SDK_ENCODER = "spans are encoded by the SDK's OTLP encoder (the same bytes, more CPU)"
_SDK_CHECKS = "span attributes go through the SDK's check of every value (the same attributes, more CPU)"
_PLAIN_VALUES = frozenset((str, bool, int, float))  # kept as they are by the SDK's check (no length limit)
_SEQUENCES = frozenset((list, tuple))  # of plain values: kept as a tuple by the SDK's check
_PLAIN_OR_SEQUENCE = _PLAIN_VALUES | _SEQUENCES
# what set_clean_attributes reads of a BoundedAttributes, in this order, and of the span
_BOUNDED_READ = ("_dict", "_lock", "maxlen", "max_value_len", "_immutable")
_SPAN_LOCK = "_lock"
_READABLE: dict[type, bool] = {}  # span class -> whether its spans keep them where they are read
# The metrics API's stand-in for the provider set later (``metrics.get_meter_provider()`` before a set).
_PROXY_METER_PROVIDER: type | None = getattr(metrics_api, "_ProxyMeterProvider", None)


def _report_missing(what: str, consequence: str = _NO_SINK) -> None:
    if what in _reported:
        return
    _reported.add(what)
    try:
        sdk = version("opentelemetry-sdk")
    except PackageNotFoundError:  # pragma: no cover - the SDK is a dependency
        sdk = "unknown"
    _logger.error(
        "opentelemetry-sdk %s has no %s: %s; otel-capture needs an update for this SDK",
        sdk,
        what,
        consequence,
    )


def span_processors(provider: object) -> tuple[Any, ...] | None:
    """The span processors of an SDK tracer provider, as the tuple the SDK holds (a new tuple each time one
    is added, so identity tells a change); ``None`` for any other provider (the API's proxy or no-op
    provider, a vendor's)."""
    multi = getattr(provider, "_active_span_processor", None)
    processors = getattr(multi, "_span_processors", None)
    if processors is None and isinstance(provider, TracerProvider):
        _report_missing("TracerProvider._active_span_processor._span_processors")
    return processors if isinstance(processors, tuple) else None


def provider_disabled(provider: object) -> bool:
    """Whether an SDK tracer provider was made disabled (``OTEL_SDK_DISABLED``): it hands out no-op spans."""
    return getattr(provider, "_disabled", False) is True


def processor_exporter(processor: object) -> Any:
    """The exporter behind one of the SDK's processors (``None`` when it has none that is known):
    ``SimpleSpanProcessor.span_exporter``, ``BatchSpanProcessor._batch_processor._exporter``, and
    ``BatchSpanProcessor.span_exporter`` where older SDKs keep it."""
    exporter = getattr(processor, "span_exporter", None)
    if exporter is None:
        exporter = getattr(getattr(processor, "_batch_processor", None), "_exporter", None)
    return exporter


# The methods of the OTLP/HTTP span exporter that may call its module's encode_spans, newest release first.
_HTTP_ENCODING_METHODS = ("export", "_serialize_spans")


def http_encoding_methods(exporter_class: type) -> list[str]:
    """The methods of the SDK's OTLP/HTTP ``OTLPSpanExporter`` whose code calls its module's
    ``encode_spans`` (empty, and told once, when none does)."""
    found = [
        name
        for name in _HTTP_ENCODING_METHODS
        if "encode_spans"
        in getattr(getattr(exporter_class.__dict__.get(name), "__code__", None), "co_names", ())
    ]
    if not found:
        _report_missing("OTLP/HTTP OTLPSpanExporter method calling encode_spans", _SDK_ENCODER)
    return found


def grpc_request_class(exporter_class: type) -> Any:
    """The ``ExportTraceServiceRequest`` class the module of the SDK's OTLP/gRPC ``OTLPSpanExporter``
    imported, when its ``_translate_data`` builds the request with that module's ``encode_spans``;
    ``None`` (told once) when not."""
    translate = getattr(exporter_class.__dict__.get("_translate_data"), "__code__", None)
    module = sys.modules.get(exporter_class.__module__)
    request = getattr(module, "ExportTraceServiceRequest", None)
    if translate is None or "encode_spans" not in translate.co_names or request is None:
        _report_missing("OTLP/gRPC OTLPSpanExporter._translate_data calling encode_spans", _SDK_ENCODER)
        return None
    if not callable(getattr(module, "encode_spans", None)):
        _report_missing("encode_spans in the OTLP/gRPC span exporter's module", _SDK_ENCODER)
        return None
    return request


def configured_exporter_names() -> list[str]:
    """``OTEL_TRACES_EXPORTER`` as the SDK resolves it (``otlp`` to its protocol's entry-point name). Raises
    ``RuntimeError`` for a setting the SDK refuses (an unsupported OTLP protocol)."""
    names: list[str] = sdk_configuration._get_exporter_names("traces")
    return names


def configured_sampler() -> Sampler | None:
    """The sampler ``OTEL_TRACES_SAMPLER[_ARG]`` names (``None``: the SDK's default)."""
    sampler: Sampler | None = sdk_configuration._import_sampler(sdk_configuration._get_sampler())
    return sampler


def measurement_consumer(provider: object) -> Any:
    """What an SDK meter provider hands its measurements to (it holds the readers' storages), read once per
    provider; ``None`` for any other provider."""
    consumer = getattr(provider, "_measurement_consumer", None)
    if consumer is None and isinstance(provider, MeterProvider):
        _report_missing("MeterProvider._measurement_consumer", _METRICS_ASSUMED)
    return consumer


def has_metric_readers(consumer: object) -> bool:
    """Whether an SDK meter provider's consumer (:func:`measurement_consumer`) has a reader now; read per
    call, as a reader can be added later."""
    storages = getattr(consumer, "_reader_storages", None)
    if storages is None:
        _report_missing("MeterProvider._measurement_consumer._reader_storages", _METRICS_ASSUMED)
        return True
    return bool(storages)


def is_meter_provider_stand_in(provider: object) -> bool:
    """Whether ``provider`` is the metrics API's stand-in, which forwards to the provider set later."""
    if _PROXY_METER_PROVIDER is None:
        _report_missing("opentelemetry.metrics._internal._ProxyMeterProvider", _METRICS_ASSUMED)
        return False
    return isinstance(provider, _PROXY_METER_PROVIDER)


def meter_provider_pending(stand_in: object) -> bool:
    """Whether no provider is set yet behind the metrics API's stand-in (:func:`is_meter_provider_stand_in`),
    so a measurement goes nowhere; read per call, as the provider can be set later."""
    real = getattr(stand_in, "_real_meter_provider", 0)
    if real == 0:
        _report_missing("_ProxyMeterProvider._real_meter_provider", _METRICS_ASSUMED)
    return real is None


_PARENT_BASED_DEFAULTS = (
    ("_root", ALWAYS_ON),
    ("_remote_parent_sampled", ALWAYS_ON),
    ("_remote_parent_not_sampled", ALWAYS_OFF),
    ("_local_parent_sampled", ALWAYS_ON),
    ("_local_parent_not_sampled", ALWAYS_OFF),
)


def is_default_parent_based(sampler: object) -> bool:
    """Whether ``sampler`` is the SDK's default, ``ParentBased(ALWAYS_ON)`` with the default delegates (the
    SDK's own singletons, by identity): a span is sampled when it has no parent, else when its parent is.
    ``False`` for anything else, or when a delegate is not found where it is read."""
    if type(sampler) is not ParentBased:
        return False
    missing = object()
    for name, default in _PARENT_BASED_DEFAULTS:
        delegate = getattr(sampler, name, missing)
        if delegate is missing:
            _report_missing(f"ParentBased.{name}", "the sampler is asked for every span context")
            return False
        if delegate is not default:
            return False
    return True


def composite_propagators(composite: object) -> tuple[Any, ...] | None:
    """The propagators a ``CompositePropagator`` runs, in order (``None`` when they are not found where
    they are read: the caller then uses the composite as it is)."""
    propagators = getattr(composite, "_propagators", None)
    if propagators is None:
        _report_missing("CompositePropagator._propagators", "the trace headers go through the propagator API")
        return None
    return tuple(propagators)


def instrumented_by_contrib(app: object) -> bool:
    """Whether contrib's FastAPI/Starlette instrumentation wrapped ``app`` in its own HTTP server span."""
    return bool(getattr(app, "_is_instrumented_by_opentelemetry", False))


def set_clean_attributes(span: Any, attributes: Mapping[str, Any]) -> None:
    """``span.set_attributes(attributes)`` for attributes the capture built (each key a non-empty ``str``),
    stored in an SDK span as its ``set_attributes`` stores them (a key set again moves to the end, a list
    becomes a tuple) without its check of every value, which is about half an SDK span's CPU with the
    model-call span's thirty attributes. Only when that check would change nothing: every value a ``str``,
    ``bool``, ``int`` or ``float`` (the exact types), or a list or tuple of them, no value length limit
    (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``: the SDK cuts), room under the count limit, a span not ended.
    Anything else, and any other span, goes through ``set_attributes`` itself."""
    store = _attribute_store(span)
    clean = None if store is None else _clean(attributes)
    if store is None or clean is None:
        span.set_attributes(attributes)
        return
    target, maxlen, span_lock, lock = store
    with span_lock:
        stored = getattr(span, "_end_time", True) is None and (
            maxlen is None or len(target) + len(clean) <= maxlen
        )
        if stored:
            with lock:
                if not target.keys().isdisjoint(clean):
                    for key in clean:
                        target.pop(key, None)
                target.update(clean)
    if not stored:  # ended (the SDK warns), or the count limit reached (it drops the oldest): its own way
        span.set_attributes(attributes)


def _attribute_store(span: Any) -> tuple[dict[str, Any], int | None, Any, Any] | None:
    """An SDK span's ``(attribute dict, count limit, the span's lock, the attributes' lock)`` when values go
    in unchecked there: no value length limit (the SDK cuts), not made immutable. ``None`` for any other
    span, or when this SDK does not keep them where they are read (looked at once per span class, on its
    first span; logged once: a newer SDK renamed one, and its own ``set_attributes`` does the work, never an
    error in a call's path)."""
    bounded = getattr(span, "_attributes", None)
    if type(bounded) is not BoundedAttributes:
        if isinstance(span, SdkSpan):
            _report_missing("Span._attributes (a BoundedAttributes)", _SDK_CHECKS)
        return None
    readable = _READABLE.get(type(span))
    if readable is None:
        readable = _READABLE[type(span)] = (
            isinstance(getattr(bounded, _BOUNDED_READ[0], None), dict)
            and all(hasattr(bounded, name) for name in _BOUNDED_READ[1:])
            and hasattr(span, _SPAN_LOCK)
        )
        if not readable:
            _report_missing(
                f"BoundedAttributes.{', .'.join(_BOUNDED_READ)} or Span.{_SPAN_LOCK}", _SDK_CHECKS
            )
    if not readable or bounded.max_value_len is not None or bounded._immutable is not False:
        return None
    return bounded._dict, bounded.maxlen, span._lock, bounded._lock


def _clean(attributes: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``attributes`` as the SDK's check would leave them, when it would change no more than a list into a
    tuple; ``None`` when it might (another type, a value in a list that is not plain)."""
    types = set(map(type, attributes.values()))
    if types <= _PLAIN_VALUES:
        return attributes
    if not types <= _PLAIN_OR_SEQUENCE:
        return None
    clean = dict(attributes)
    for key in [key for key, value in clean.items() if type(value) in _SEQUENCES]:
        value = clean[key]
        if not set(map(type, value)) <= _PLAIN_VALUES:
            return None
        clean[key] = tuple(value)
    return clean
