"""The tracer provider the proxy and the demo build when the host application brings none.

It is configured by the OpenTelemetry SDK's own rules, so every standard variable means here what it means
under ``opentelemetry-instrument``: ``OTEL_TRACES_EXPORTER`` (``otlp`` is gRPC or HTTP by
``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``), ``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_BSP_*`` and each exporter's own variables. Exporters are found by name in the
``opentelemetry_traces_exporter`` entry-point group (``otel_capture`` never imports its exporters); those
named in ``OTEL_TRACES_EXPORTER`` sit behind the SDK's batch processor. The records' exporter,
``model_call_jsonl``, is added with the writer settings passed in code when they name a directory.

``otlp`` without its protocol's exporter installed (the base install has none; ``[auto]`` brings both) is
told once, on stderr even where the host silences logging, with the package to install and the protocol
that needs none: the SDK's own word is a bare "not found", and no span leaves the process.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from .._notices import notify
from .._sdk_private import configured_exporter_names, configured_sampler
from .._settings import JSONL_EXPORTER, CaptureSettings, WriterSettings

_logger = logging.getLogger(__name__)

_GROUP = "opentelemetry_traces_exporter"
# What OTEL_TRACES_EXPORTER=otlp resolves to, by protocol, and the distribution that provides it.
_OTLP_PACKAGES = {
    "otlp_proto_grpc": ("grpc", "opentelemetry-exporter-otlp-proto-grpc"),
    "otlp_proto_http": ("http/protobuf", "opentelemetry-exporter-otlp-proto-http"),
}
DEFAULT_SERVICE_NAME = "otel-capture"


def build_tracer_provider(capture: CaptureSettings, writer: WriterSettings) -> TracerProvider:
    """A provider with the records' exporter (when ``writer.directory`` is set) and the SDK's selection of
    other exporters, sampler and resource. A name that cannot be loaded is logged and skipped."""
    sampler = configured_sampler()
    resource = Resource.create({"service.name": capture.service_name or DEFAULT_SERVICE_NAME})
    provider = TracerProvider(sampler=sampler, resource=resource)
    if writer.directory is not None:
        jsonl = _exporter_class(JSONL_EXPORTER)
        if jsonl is None:
            _logger.error("the %s exporter is not installed: no records will be written", JSONL_EXPORTER)
        else:
            # its export() does nothing per span (records go through the middleware's sink): no per-span call
            provider.add_span_processor(SinkOnlyProcessor(jsonl(settings=writer)))  # type: ignore[call-arg]  # ours takes settings
    for name in _standard_exporter_names():
        cls = _exporter_class(name)
        if cls is None:
            _tell_missing(name)
            continue
        try:
            provider.add_span_processor(BatchSpanProcessor(cls()))
        except Exception:  # a broken exporter set-up never stops the proxy
            _logger.exception("could not set up the %r span exporter; ignoring it", name)
    return provider


class SinkOnlyProcessor(SimpleSpanProcessor):
    """Holds the records' exporter on the provider (where ``find_sink`` finds it, and ``force_flush`` and
    ``shutdown`` reach it) without handing it each ended span: its ``export()`` does nothing per span, and
    the SDK's processor would attach a context and count the span for that nothing, twice per call."""

    def on_end(self, span: ReadableSpan) -> None:
        pass


def _standard_exporter_names() -> list[str]:
    """``OTEL_TRACES_EXPORTER`` as the SDK resolves it (``otlp`` to its protocol's entry point), without
    ``model_call_jsonl``, which is configured from the writer settings instead."""
    try:
        names = configured_exporter_names()
    except RuntimeError as exc:  # e.g. an unsupported OTLP protocol
        _logger.error("ignoring OTEL_TRACES_EXPORTER: %s", exc)
        return []
    return [name for name in names if name and name != JSONL_EXPORTER]


def _tell_missing(name: str) -> None:
    """One line saying which exporter is missing and how to get spans out: the package, or (for OTLP)
    the other protocol when its exporter is there."""
    if name not in _OTLP_PACKAGES:
        notify(
            _logger, logging.ERROR, "OTEL_TRACES_EXPORTER names %r, which is not installed; ignoring it", name
        )
        return
    protocol, package = _OTLP_PACKAGES[name]
    other = next((n for n in _OTLP_PACKAGES if n != name and _exporter_class(n) is not None), None)
    instead = ""
    if other is not None:
        instead = (
            f", or set OTEL_EXPORTER_OTLP_PROTOCOL={_OTLP_PACKAGES[other][0]} (its exporter is installed)"
        )
    notify(
        _logger,
        logging.ERROR,
        "OTEL_TRACES_EXPORTER=otlp sends OTLP over %s (OTEL_EXPORTER_OTLP_PROTOCOL, default grpc), whose "
        "exporter is not installed: no spans are exported; install %s "
        "(pip install 'otel-capture[auto]' brings OTLP over gRPC and HTTP)%s",
        protocol,
        package,
        instead,
    )


def _exporter_class(name: str) -> type[SpanExporter] | None:
    for entry_point in entry_points(group=_GROUP, name=name):
        cls: type[SpanExporter] = entry_point.load()
        return cls
    return None
