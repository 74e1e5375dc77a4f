"""Telemetry: the OpenTelemetry side of a captured call. This is its face: outside ``_telemetry/``, code
imports from here, never from its modules.

- :mod:`.semconv`: a call's GenAI semantic-convention attributes (request, response, content);
- :mod:`.spans`: :class:`SpanGate`, whether any processor would see a span (else only its context is made);
- :mod:`.metrics`: :class:`ServerMetrics`, the ``gen_ai.server.*`` metrics and the uncorrelated-call count;
- :mod:`.server_span`: :class:`LeanServerSpanMiddleware`, the HTTP server span of the proxy and the
  zero-code server;
- :mod:`.provider`: :func:`build_tracer_provider`, the proxy's tracer provider from its settings.

Below it are only the flat bottom floor, :mod:`otel_capture._dialects` and :mod:`otel_capture._correlation`;
it knows nothing of the store or the capture.
"""

from __future__ import annotations

from .metrics import ServerMetrics
from .provider import build_tracer_provider
from .semconv import content_attributes, request_attributes, response_attributes
from .server_span import LeanServerSpanMiddleware
from .spans import SpanGate

__all__ = [
    "LeanServerSpanMiddleware",
    "ServerMetrics",
    "SpanGate",
    "build_tracer_provider",
    "content_attributes",
    "request_attributes",
    "response_attributes",
]
