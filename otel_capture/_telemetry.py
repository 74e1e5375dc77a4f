"""The tracer provider the proxy and the demo use when the host application brings none.

Exporters are found the standard way, by name in the ``opentelemetry_traces_exporter`` entry-point group,
so ``otel_capture`` never imports ``exporters``. The JSONL exporter sits behind a synchronous processor
(its ``export`` only queues, so this costs the event loop nothing); every other exporter named in
``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ...) sits behind the SDK's batch processor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from ._settings import CaptureSettings

_logger = logging.getLogger(__name__)

JSONL_EXPORTER = "model_call_jsonl"
_GROUP = "opentelemetry_traces_exporter"


def load_exporter_class(name: str) -> type[SpanExporter] | None:
    for entry_point in entry_points(group=_GROUP, name=name):
        cls: type[SpanExporter] = entry_point.load()
        return cls
    return None


def build_tracer_provider(
    settings: CaptureSettings, environ: Mapping[str, str] | None = None
) -> TracerProvider:
    env = os.environ if environ is None else environ
    provider = TracerProvider(resource=Resource.create(_resource_attributes(settings)))
    if settings.capture_dir is not None:
        jsonl = load_exporter_class(JSONL_EXPORTER)
        if jsonl is None:
            _logger.error("the %s exporter is not installed: no records will be written", JSONL_EXPORTER)
        else:
            exporter: Any = jsonl(settings.capture_dir)  # type: ignore[call-arg]  # our exporter takes its directory
            provider.add_span_processor(SimpleSpanProcessor(exporter))
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    for name in names:
        if name in (JSONL_EXPORTER, "none"):
            continue
        cls = load_exporter_class(name)
        if cls is None:
            _logger.error("OTEL_TRACES_EXPORTER names %r, which is not installed; ignoring it", name)
            continue
        provider.add_span_processor(BatchSpanProcessor(cls()))
    return provider


def _resource_attributes(settings: CaptureSettings) -> dict[str, Any]:
    if settings.service_name:
        return {"service.name": settings.service_name}
    return {"service.name": "otel-capture"}
