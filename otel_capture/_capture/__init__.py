"""The capture: each model call through an ASGI app as a span and a durable record. This is its face:
outside ``_capture/``, code imports from here, never from its modules.

- :mod:`.middleware`: :class:`ModelCallCaptureMiddleware`, the pure ASGI middleware, and
  ``SCOPE_RESPONSE_COMPLETE``, the scope key that tells a relaying app the captured stream has ended;
- :mod:`.sink`: :class:`CallSink`, where a finished call goes (the ``model_call_jsonl`` exporter), the
  :class:`FinishedCall` it receives and the :class:`LoopWaiter` that wakes the call when it is durable;
- :mod:`.propagation`: :func:`current_trace_fields`, the trace headers a relay sends upstream for the
  current span (the proxy's);
- :mod:`.call` (one call's bytes in, its record line out), :mod:`.content_encoding` and :mod:`.weight` are
  the middleware's own.

Below it are the store, :mod:`otel_capture._telemetry`, :mod:`otel_capture._correlation`, the records and
the dialects.
"""

from __future__ import annotations

from .call import SCOPE_LOCAL_RESPONSE, SCOPE_UPSTREAM, SCOPE_UPSTREAM_REQUEST_ID
from .middleware import ModelCallCaptureMiddleware
from .passthrough import SCOPE_RESPONSE_COMPLETE
from .propagation import current_trace_fields
from .sink import CallSink, FinishedCall, LoopWaiter

__all__ = [
    "SCOPE_LOCAL_RESPONSE",
    "SCOPE_RESPONSE_COMPLETE",
    "SCOPE_UPSTREAM",
    "SCOPE_UPSTREAM_REQUEST_ID",
    "CallSink",
    "FinishedCall",
    "LoopWaiter",
    "ModelCallCaptureMiddleware",
    "current_trace_fields",
]
