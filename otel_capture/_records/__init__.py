"""Records: the schema, one line to one record, the readers, the aggregates (re-exports only)."""

from __future__ import annotations

from .aggregate import aggregate_model_call_metrics, aggregate_model_call_records
from .build import build_model_call_record
from .readers import (
    AvailableRecords,
    CaptureReadError,
    InvalidLine,
    parse_record_line,
    read_available_model_call_records,
    read_model_call_records,
)
from .schema import EXTRA_RECORD_FIELDS, GYM_RECORD_FIELDS, ModelCallRecord, ModelServerRef, call_failed

__all__ = [
    "EXTRA_RECORD_FIELDS",
    "GYM_RECORD_FIELDS",
    "AvailableRecords",
    "CaptureReadError",
    "InvalidLine",
    "ModelCallRecord",
    "ModelServerRef",
    "aggregate_model_call_metrics",
    "aggregate_model_call_records",
    "build_model_call_record",
    "call_failed",
    "parse_record_line",
    "read_available_model_call_records",
    "read_model_call_records",
]
