"""Per-rollout totals over records, NeMo Gym 0.7.0's aggregate then ours (over a store's rollout:
:func:`otel_capture._store.reading.aggregate_model_call_metrics`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from .schema import ModelCallRecord

__all__ = ["aggregate_model_call_records"]

_logger = logging.getLogger(__name__)


_SUMMED = ("tokens_in", "tokens_out", "tokens_reasoning", "tokens_total", "cached_tokens", "latency_total_ms")


def aggregate_model_call_records(records: Iterable[ModelCallRecord]) -> dict[str, Any]:
    """Gym's aggregate (each value the sum over calls that have it, ``None`` if none do), then ours.

    Gym's keys: ``tokens_in``, ``tokens_out``, ``tokens_reasoning``, ``tokens_total``, ``cached_tokens``,
    ``latency_total_ms``, ``num_calls`` (failed and refused calls included). Ours: ``num_errors`` (the calls
    that :attr:`~.schema.ModelCallRecord.failed`, refused ones apart), ``num_refused`` (the calls the
    capture proxy refused for capacity, :attr:`~.schema.ModelCallRecord.refused`: retries to come, not
    failures), ``cache_creation_tokens`` (a sum),
    ``latency_ttft_ms_mean`` (the mean over calls that have a TTFT), ``num_tokens_missing`` (the calls
    answered without the token ids or log-probs they asked for: ``tokens_missing``), ``weight_versions``
    (the distinct ``weight_version`` values of the calls, in the order first seen; calls without one are
    not counted) and ``num_weight_version_changed`` (calls during which the declared version changed: those
    with a ``weight_version_at_end``). One pass: ``records`` may be an iterator.
    """
    sums: dict[str, Any] = dict.fromkeys((*_SUMMED, "cache_creation_tokens"))
    calls = errors = refused = ttft_count = tokens_missing = 0
    ttft_sum = 0.0
    versions: dict[str, None] = {}
    changed = 0
    for call in records:
        calls += 1
        if call.weight_version is not None:
            versions.setdefault(call.weight_version)
        changed += call.weight_version_at_end is not None
        if call.refused:
            refused += 1
        else:
            errors += call.failed
        tokens_missing += call.tokens_missing is not None
        for attr in sums:
            value = getattr(call, attr)
            if value is not None:
                sums[attr] = value if sums[attr] is None else sums[attr] + value
        if call.latency_ttft_ms is not None:
            ttft_count += 1
            ttft_sum += call.latency_ttft_ms
    return {
        **{attr: sums[attr] for attr in _SUMMED},
        "num_calls": calls,
        "num_errors": errors,
        "num_refused": refused,
        "cache_creation_tokens": sums["cache_creation_tokens"],
        "latency_ttft_ms_mean": ttft_sum / ttft_count if ttft_count else None,
        "num_tokens_missing": tokens_missing,
        "weight_versions": list(versions),
        "num_weight_version_changed": changed,
    }
