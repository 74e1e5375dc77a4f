"""Per-rollout totals over records, NeMo Gym 0.7.0's aggregate then ours."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .readers import read_model_call_records
from .schema import ModelCallRecord

if TYPE_CHECKING:
    from .._store.store import CaptureStore

__all__ = ["aggregate_model_call_metrics", "aggregate_model_call_records"]

_logger = logging.getLogger(__name__)


def aggregate_model_call_records(records: Sequence[ModelCallRecord]) -> dict[str, Any]:
    """Gym's aggregate (each value the sum over calls that have it, ``None`` if none do), then ours.

    Gym's keys: ``tokens_in``, ``tokens_out``, ``tokens_reasoning``, ``tokens_total``, ``cached_tokens``,
    ``latency_total_ms``, ``num_calls`` (failed calls included). Ours: ``num_errors`` (the calls that
    :attr:`~.schema.ModelCallRecord.failed`),
    ``cache_creation_tokens`` (a sum) and ``latency_ttft_ms_mean`` (the mean over calls that have a TTFT).
    """

    def _sum(attr: str) -> Any:
        values = [value for call in records if (value := getattr(call, attr)) is not None]
        return sum(values) if values else None

    ttfts = [call.latency_ttft_ms for call in records if call.latency_ttft_ms is not None]
    return {
        "tokens_in": _sum("tokens_in"),
        "tokens_out": _sum("tokens_out"),
        "tokens_reasoning": _sum("tokens_reasoning"),
        "tokens_total": _sum("tokens_total"),
        "cached_tokens": _sum("cached_tokens"),
        "latency_total_ms": _sum("latency_total_ms"),
        "num_calls": len(records),
        "num_errors": sum(1 for call in records if call.failed),
        "cache_creation_tokens": _sum("cache_creation_tokens"),
        "latency_ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else None,
    }


def aggregate_model_call_metrics(store: CaptureStore, rollout_id: str) -> dict[str, Any]:
    """:func:`aggregate_model_call_records` over the strict reader, as Gym does: a damaged line raises
    :class:`~.readers.CaptureReadError` rather than giving totals that silently miss calls."""
    return aggregate_model_call_records(read_model_call_records(store, rollout_id))
