"""Correlation: which rollout a model call belongs to. This is its face: outside ``_correlation/``, code
imports from here, never from its modules.

- :mod:`.ids`: the rollout id's grammar, its carriers' names and the current rollout (``rollout_context``);
- :mod:`.routing`: the one decision per request (:func:`correlate`: a :class:`Correlation`, never a
  refusal), and the request and response header helpers the capture and the server span share;
- :mod:`.agent`: the helpers an agent framework calls to put its rollout id on a model call;
- :mod:`.baggage`: the rollout id as W3C baggage on an instrumented HTTP client's requests.

Below it are only the flat bottom floor and :mod:`otel_capture._dialects`.
"""

from __future__ import annotations

from .._rollout_id import ROLLOUT_ID_PATTERN, is_valid_rollout_id, validate_rollout_id
from .agent import (
    base_url_for_run,
    capture_correlation_enabled,
    maybe_rollout_id_from_run_body,
    resolve_model_base_url,
    rollout_context_for_run,
    rollout_headers,
    rollout_id_from_run,
    url_path_for_request,
    url_path_for_run,
)
from .baggage import (
    async_rollout_baggage_hook,
    inject_rollout_baggage,
    instrument_http_client,
    rollout_baggage_hook,
)
from .ids import (
    BAGGAGE_ROLLOUT_KEY,
    ROLLOUT_ID_HEADER,
    RolloutRules,
    current_rollout_id,
    rollout_context,
)
from .routing import (
    SCOPE_CAPTURED,
    Correlation,
    correlate,
    invalid_id_notice,
    name_server_span,
    response_headers,
    server_attributes,
    server_span_details,
    session_id,
    unprefixed_raw_path,
    warn_ignored_carriers,
)

__all__ = [
    "BAGGAGE_ROLLOUT_KEY",
    "ROLLOUT_ID_HEADER",
    "ROLLOUT_ID_PATTERN",
    "SCOPE_CAPTURED",
    "Correlation",
    "RolloutRules",
    "async_rollout_baggage_hook",
    "base_url_for_run",
    "capture_correlation_enabled",
    "correlate",
    "current_rollout_id",
    "inject_rollout_baggage",
    "instrument_http_client",
    "invalid_id_notice",
    "is_valid_rollout_id",
    "maybe_rollout_id_from_run_body",
    "name_server_span",
    "resolve_model_base_url",
    "response_headers",
    "rollout_baggage_hook",
    "rollout_context",
    "rollout_context_for_run",
    "rollout_headers",
    "rollout_id_from_run",
    "server_attributes",
    "server_span_details",
    "session_id",
    "unprefixed_raw_path",
    "url_path_for_request",
    "url_path_for_run",
    "validate_rollout_id",
    "warn_ignored_carriers",
]
