"""``ModelCallRecord``: one captured model call as the readers return it, compatible with NeMo Gym 0.7.0.

The fields up to ``latency_ttft_ms`` are Gym's, in its order; the rest (:data:`EXTRA_RECORD_FIELDS`) are
ours and ``None`` on every line Gym writes. This module declares them all, once: the line's keys
(:data:`LINE_KEYS`), the schema versions, the added fields' types. The line both ways is :mod:`.codec`;
how a record's derived fields (token counts, tool calls, finish reason) come from a line is :mod:`.build`.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, Field

__all__ = [
    "EXTRA_RECORD_FIELDS",
    "EXTRA_RECORD_TYPES",
    "GYM_RECORD_FIELDS",
    "LINE_KEYS",
    "REFUSED_OVER_CAPACITY",
    "SCHEMA_VERSION",
    "TOKENS_SCHEMA_VERSION",
    "ModelCallRecord",
    "ModelServerRef",
    "call_failed",
]

_logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1  # of a record line (its ``schema_version``)
TOKENS_SCHEMA_VERSION = 1  # of a tokens line

FAILED_RESPONSE_STATUSES = frozenset({"failed", "error", "cancelled"})
# ``local_response_reason`` of a call the capture proxy answered itself, 503 with ``Retry-After``, because it
# already forwarded ``--max-concurrent-calls`` calls: a retry to come, not a model failure (docs/attachment.md)
REFUSED_OVER_CAPACITY = "proxy_over_capacity"


def call_failed(status_code: int | None, error_category: str | None, response_status: str | None) -> bool:
    """Whether a model call failed: an error category, an HTTP status >= 400, or a Responses ``status`` of
    failed, error or cancelled (NeMo Gym's health-check rule). A 3xx or a missing status alone is not a
    failure. The one definition behind ``show``'s errors, ``num_errors`` and the metrics' successful calls.
    """
    return (
        bool(error_category)
        or (status_code is not None and status_code >= 400)
        or response_status in FAILED_RESPONSE_STATUSES
    )


class ModelServerRef(BaseModel):
    """Gym's reference to the model server that answered (``config_types.ModelServerRef``)."""

    type: Literal["responses_api_models"]
    name: str


class ModelCallRecord(BaseModel):
    """One captured model call. Fields up to ``latency_ttft_ms`` are NeMo Gym 0.7.0's, in its order."""

    model_call_id: str | None = None
    response_id: str | None = None
    client_session_id: str | None = None
    # Durable append order (position among non-blank lines), not the order in which calls started.
    call_index: int
    model_ref: ModelServerRef | None = None
    model: str | None = None
    dialect: str | None = None
    status_code: int | None = None
    response_status: str | None = None
    finish_reason: str | None = None
    upstream_attempted: bool | None = None
    response_source: Literal["upstream", "local"] | None = None
    upstream_status_code: int | None = None
    local_response_reason: str | None = None
    # Wall-clock bounds, UTC Unix seconds; durations are the monotonic latency fields below.
    started_at: float | None = None
    completed_at: float | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    tokens_reasoning: int | None = None
    tokens_total: int | None = None
    request: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    request_raw: str | None = None
    response_raw: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning_content: str | None = None
    cache_hit: bool | None = None
    cached_tokens: int | None = None
    cache_creation_tokens: int | None = None
    error_category: str | None = None
    latency_total_ms: float | None = None
    latency_ttft_ms: float | None = None

    # Ours, ignored by Gym. ``None`` when the line does not carry them (every line Gym writes).
    schema_version: int | None = None
    rollout_id: str | None = None
    trace_id: str | None = None
    span_id: str | None = None
    stream: bool | None = None
    stream_truncated: bool | None = None
    truncated: bool | None = None
    failure: dict[str, Any] | None = None
    # why the token ids or log-probs the request asked for are not all in the answer (docs/tokens.md)
    tokens_missing: str | None = None
    # which token invariant the answer breaks, odd entries, log-probs against ids, ids against the usage
    # (docs/tokens.md, "Token integrity")
    token_mismatch: str | None = None
    # Which server wrote the line (docs/attachment.md, "Writers"): ``{"host", "pid", "layer"}``, ``layer``
    # ``proxy`` or ``in_process``, and for the proxy ``upstream``, the URL it forwarded to (no credentials);
    # and the upstream's ``x-request-id`` response header, when its answer had one.
    writer: dict[str, Any] | None = None
    upstream_request_id: str | None = None
    # The weight (policy) version (docs/attachment.md, "Weight versions"): what the engine reported in its
    # answer; the version in force when the call was admitted (the caller's, else the one declared for the
    # directory); the declared version when it finished, only when that differs (weights changed meanwhile).
    engine_weight_version: str | None = None
    weight_version: str | None = None
    weight_version_at_end: str | None = None

    @property
    def failed(self) -> bool:
        """Whether the call failed (:func:`call_failed`)."""
        return call_failed(self.status_code, self.error_category, self.response_status)

    @property
    def refused(self) -> bool:
        """Whether the capture proxy refused the call for capacity (503, ``Retry-After``): the client's
        retry is the call; counted apart from the failed calls (``num_refused``, not ``num_errors``)."""
        return self.response_source == "local" and self.local_response_reason == REFUSED_OVER_CAPACITY


_FIELDS = tuple(ModelCallRecord.model_fields)
GYM_RECORD_FIELDS: tuple[str, ...] = _FIELDS[: _FIELDS.index("latency_ttft_ms") + 1]
"""NeMo Gym 0.7.0's record fields, in its order."""
EXTRA_RECORD_FIELDS: tuple[str, ...] = _FIELDS[len(GYM_RECORD_FIELDS) :]
"""Ours: every field after Gym's. Adding one to :class:`ModelCallRecord` is all it takes for the line
codec to write it (:data:`LINE_KEYS`) and read it back (:data:`EXTRA_RECORD_TYPES`)."""


def _exact_type(name: str) -> type:
    [annotation] = [a for a in get_args(ModelCallRecord.model_fields[name].annotation) if a is not type(None)]
    origin = get_origin(annotation)
    exact: type = origin if origin is not None else annotation
    return exact


EXTRA_RECORD_TYPES: dict[str, type] = {name: _exact_type(name) for name in EXTRA_RECORD_FIELDS}
"""The exact type of each added field's value on a line that needs no validation (``int``, ``dict``...)."""

# The keys a NeMo Gym 0.7.0 line carries, in the order its writer writes them (``latency_ms`` is
# ``latency_total_ms`` on disk; the derived fields, such as the token counts, are not stored).
_GYM_LINE_KEYS = (
    "model_call_id",
    "dialect",
    "model_ref",
    "started_at",
    "completed_at",
    "latency_ms",
    "latency_ttft_ms",
    "status_code",
    "error_category",
    "request",
    "response",
    "client_session_id",
    "request_raw",
    "response_raw",
    "upstream_attempted",
    "response_source",
    "upstream_status_code",
    "local_response_reason",
)
LINE_KEYS: tuple[str, ...] = _GYM_LINE_KEYS + EXTRA_RECORD_FIELDS
"""The keys of a record line, in the order the codec writes them."""
