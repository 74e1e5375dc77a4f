"""Every private attribute of the OpenTelemetry SDK this package reads, in one place.

The SDK has no public way to list a tracer provider's span processors, to reach the exporter a processor
wraps, or to resolve ``OTEL_TRACES_EXPORTER`` and ``OTEL_TRACES_SAMPLER`` as ``opentelemetry-instrument``
does. What is read, and who needs it:

- ``TracerProvider._active_span_processor._span_processors``: the provider's processors (the sink lookup,
  :mod:`._sink`; whether anyone sees a span, :mod:`._spans`);
- ``TracerProvider._disabled``: ``OTEL_SDK_DISABLED`` (:mod:`._spans`);
- ``SimpleSpanProcessor.span_exporter`` and ``BatchSpanProcessor._batch_processor._exporter`` (older SDKs:
  ``BatchSpanProcessor.span_exporter``): the exporter behind a processor (:mod:`._sink`, :mod:`._spans`);
- ``opentelemetry.sdk._configuration._get_exporter_names``, ``_get_sampler`` and ``_import_sampler``: the
  SDK's own reading of ``OTEL_TRACES_EXPORTER`` and ``OTEL_TRACES_SAMPLER[_ARG]`` (:mod:`._telemetry`).

``tests/unit/test_sdk_private.py`` pins each against the installed SDK, so a release that renames one fails
the tests loudly instead of leaving a middleware that writes no records and says nothing. At run time a
provider of the SDK's own class that lacks them is logged once, as an error naming the SDK's version.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from opentelemetry.sdk import _configuration as sdk_configuration
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import Sampler

__all__ = [
    "configured_exporter_names",
    "configured_sampler",
    "processor_exporter",
    "provider_disabled",
    "span_processors",
]

_logger = logging.getLogger(__name__)
_reported: set[str] = set()


def _report_missing(what: str) -> None:
    if what in _reported:
        return
    _reported.add(what)
    try:
        sdk = version("opentelemetry-sdk")
    except PackageNotFoundError:  # pragma: no cover - the SDK is a dependency
        sdk = "unknown"
    _logger.error(
        "opentelemetry-sdk %s has no %s: model-call records cannot be routed (no sink is found) and every "
        "span is built; otel-capture needs an update for this SDK",
        sdk,
        what,
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


def configured_exporter_names() -> list[str]:
    """``OTEL_TRACES_EXPORTER`` as the SDK resolves it (``otlp`` to its protocol's entry-point name). Raises
    ``RuntimeError`` for a setting the SDK refuses (an unsupported OTLP protocol)."""
    names: list[str] = sdk_configuration._get_exporter_names("traces")
    return names


def configured_sampler() -> Sampler | None:
    """The sampler ``OTEL_TRACES_SAMPLER[_ARG]`` names (``None``: the SDK's default)."""
    sampler: Sampler | None = sdk_configuration._import_sampler(sdk_configuration._get_sampler())
    return sampler
