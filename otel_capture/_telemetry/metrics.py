"""The GenAI server metrics (semconv v1.41.1): request duration, time to first token, time per output
token, as histograms with the spec's explicit bucket boundaries.

They go through the OpenTelemetry metrics API, so whatever ``MeterProvider`` is set (by
``opentelemetry-instrument`` from ``OTEL_METRICS_EXPORTER``, or by the host app) exports them; with none
set they cost nothing. Their attributes are the low-cardinality span attributes only
(:data:`otel_capture._attributes.METRIC_ATTRIBUTES`), never the rollout id.

Two histograms of ours, by dialect, say what the capture itself costs, so its overhead shows in production
and not only in benchmarks (``docs/performance.md``): ``otel_capture.capture.duration``, the time a call
spent in the capture's own code on the request path (correlation, teeing and parsing each chunk, the span,
the record line; not the time waiting for the app, the client or the disk), and
``otel_capture.durability_wait.duration``, from the app's terminal chunk until the capture let it out (the
record durable, failed or past its deadline) (contract D1, D6).

Counters of ours, by dialect: ``otel_capture.uncorrelated_calls``, model calls served without a usable
rollout id (none, or one outside the grammar; so not recorded): a missing prefix or header shows there at
once (``docs/gateways.md``); ``otel_capture.late_calls``, calls to a frozen or retired rollout, answered
and their records dropped (``docs/lifecycle.md``);
``otel_capture.tokens_missing_calls``, calls answered without the token ids or log-probs they asked for,
and ``otel_capture.token_mismatch_calls``, calls whose token ids and log-probs break an invariant
(``docs/tokens.md``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics

from .. import _attributes as A
from .._sdk_private import (
    has_metric_readers,
    is_meter_provider_stand_in,
    measurement_consumer,
    meter_provider_pending,
)
from .._version import __version__

_logger = logging.getLogger(__name__)

UNCORRELATED_CALLS = "otel_capture.uncorrelated_calls"
LATE_CALLS = "otel_capture.late_calls"
CAPTURE_DURATION = "otel_capture.capture.duration"
DURABILITY_WAIT_DURATION = "otel_capture.durability_wait.duration"
# the capture's own time per call is microseconds to milliseconds; the wait, one batch's fsync and more
_BUCKETS_CAPTURE = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)
_BUCKETS_DURABILITY_WAIT = (
    1e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
TOKENS_MISSING_CALLS = "otel_capture.tokens_missing_calls"
TOKEN_MISMATCH_CALLS = "otel_capture.token_mismatch_calls"
_MAX_ATTRIBUTE_SETS = 1024  # past it (many models or hosts), further sets are built per call


class MeterGate:
    """Whether measurements on a meter provider go anywhere now, looked at per call (a reader, or the real
    provider behind the API's stand-in, can come later). Not for an SDK provider without a reader (the
    distro's under ``OTEL_METRICS_EXPORTER=none``), the API's stand-in before a provider is set, or the no-op
    provider; any other provider (a vendor's) is assumed to record. What it reads of the SDK and the API is
    private (:mod:`otel_capture._sdk_private`)."""

    __slots__ = ("_consumer", "_noop", "_stand_in")

    def __init__(self, meter_provider: metrics.MeterProvider | None = None) -> None:
        provider = meter_provider or metrics.get_meter_provider()
        # an SDK provider keeps its readers in its measurement consumer
        self._consumer = measurement_consumer(provider)
        # the API's stand-in forwards to the provider set later: until then, nothing is recorded
        self._stand_in = provider if is_meter_provider_stand_in(provider) else None
        self._noop = isinstance(provider, metrics.NoOpMeterProvider)

    @property
    def recording(self) -> bool:
        if self._consumer is not None and not has_metric_readers(self._consumer):
            return False
        return not (self._noop or (self._stand_in is not None and meter_provider_pending(self._stand_in)))


class ServerMetrics:
    """The three ``gen_ai.server.*`` histograms of one meter."""

    def __init__(self, meter_provider: metrics.MeterProvider | None = None) -> None:
        meter = metrics.get_meter("otel_capture", __version__, meter_provider)
        self._gate = MeterGate(meter_provider)
        # One attribute set per distinct combination of values (dialect, model, server, error type), made
        # once: a handful per process, never the rollout id.
        self._attribute_sets: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.request_duration = meter.create_histogram(
            A.METRIC_SERVER_REQUEST_DURATION,
            unit="s",
            description="Generative AI server request duration, to the last byte of the response.",
            explicit_bucket_boundaries_advisory=list(A.BUCKETS_REQUEST_DURATION),
        )
        self.time_to_first_token = meter.create_histogram(
            A.METRIC_SERVER_TIME_TO_FIRST_TOKEN,
            unit="s",
            description="Time to generate the first token, for successful streamed responses.",
            explicit_bucket_boundaries_advisory=list(A.BUCKETS_TIME_TO_FIRST_TOKEN),
        )
        self.time_per_output_token = meter.create_histogram(
            A.METRIC_SERVER_TIME_PER_OUTPUT_TOKEN,
            unit="s",
            description="Time per output token generated after the first, for successful streamed responses.",
            explicit_bucket_boundaries_advisory=list(A.BUCKETS_TIME_PER_OUTPUT_TOKEN),
        )
        self.capture_duration = meter.create_histogram(
            CAPTURE_DURATION,
            unit="s",
            description="Time a model call spent in the capture's own code on the request path, not waiting "
            "for the app, the client or the disk.",
            explicit_bucket_boundaries_advisory=list(_BUCKETS_CAPTURE),
        )
        self.durability_wait = meter.create_histogram(
            DURABILITY_WAIT_DURATION,
            unit="s",
            description="Time from the app's terminal chunk until the capture let it out: the record durable, "
            "failed or past its deadline.",
            explicit_bucket_boundaries_advisory=list(_BUCKETS_DURABILITY_WAIT),
        )
        self._dialect_sets: dict[str, dict[str, str]] = {}
        self.uncorrelated_calls = meter.create_counter(
            UNCORRELATED_CALLS,
            unit="{call}",
            description="Model calls served without a rollout id, so not recorded.",
        )
        self.late_calls = meter.create_counter(
            LATE_CALLS,
            unit="{call}",
            description="Model calls to a frozen or retired rollout, answered and not recorded.",
        )
        self.tokens_missing_calls = meter.create_counter(
            TOKENS_MISSING_CALLS,
            unit="{call}",
            description="Model calls answered without all the token ids or log-probs they asked for.",
        )
        self.token_mismatch_calls = meter.create_counter(
            TOKEN_MISMATCH_CALLS,
            unit="{call}",
            description="Model calls whose token ids or log-probs break an invariant (token_mismatch).",
        )

    @property
    def recording(self) -> bool:
        """Whether a measurement would go anywhere now (:class:`MeterGate`)."""
        return self._gate.recording

    def record(
        self,
        span_attributes: Mapping[str, Any],
        duration: float | None,
        time_to_first_token: float | None,
        time_per_output_token: float | None,
    ) -> None:
        """Record one call. Never raises (telemetry never breaks the host app). Nothing is done for an SDK
        meter provider without a reader (the distro's under ``OTEL_METRICS_EXPORTER=none``), where the
        attribute set and one histogram record cost about 10 µs for nothing."""
        if not self.recording:
            return
        try:
            key = tuple(map(span_attributes.get, A.METRIC_ATTRIBUTES))
            attributes = self._attribute_sets.get(key)
            if attributes is None:
                attributes = {k: v for k, v in zip(A.METRIC_ATTRIBUTES, key, strict=True) if v is not None}
                if len(self._attribute_sets) < _MAX_ATTRIBUTE_SETS:
                    self._attribute_sets[key] = attributes
            if duration is not None:
                self.request_duration.record(duration, attributes)
            if time_to_first_token is not None:
                self.time_to_first_token.record(time_to_first_token, attributes)
            if time_per_output_token is not None:
                self.time_per_output_token.record(time_per_output_token, attributes)
        except Exception:
            _logger.exception("recording the gen_ai.server metrics failed")

    def record_capture_cost(self, dialect: str, capture: float, durability_wait: float | None) -> None:
        """Record one call's own capture time and its durability wait (``None``: no terminal chunk was
        held). Never raises. The caller times the call only when :attr:`recording` said so at its start."""
        try:
            attributes = self._dialect_sets.get(dialect)
            if attributes is None:
                attributes = self._dialect_sets.setdefault(dialect, {A.MODEL_CALL_DIALECT: dialect})
            self.capture_duration.record(capture, attributes)
            if durability_wait is not None:
                self.durability_wait.record(durability_wait, attributes)
        except Exception:
            _logger.exception("recording the capture's own cost failed")

    def count_uncorrelated(self, dialect: str) -> None:
        """Count one model call that had no rollout id. Never raises."""
        try:
            self.uncorrelated_calls.add(1, {A.MODEL_CALL_DIALECT: dialect})
        except Exception:
            _logger.exception("counting an uncorrelated model call failed")

    def count_late(self, dialect: str) -> None:
        """Count one late call to a frozen or retired rollout. Never raises."""
        try:
            self.late_calls.add(1, {A.MODEL_CALL_DIALECT: dialect})
        except Exception:
            _logger.exception("counting a late model call failed")

    def count_tokens_missing(self, dialect: str) -> None:
        """Count one call answered without the tokens it asked for. Never raises."""
        try:
            self.tokens_missing_calls.add(1, {A.MODEL_CALL_DIALECT: dialect})
        except Exception:
            _logger.exception("counting a call without its tokens failed")

    def count_token_mismatch(self, dialect: str) -> None:
        """Count one call whose tokens break an invariant. Never raises."""
        try:
            self.token_mismatch_calls.add(1, {A.MODEL_CALL_DIALECT: dialect})
        except Exception:
            _logger.exception("counting a call with mismatched tokens failed")
