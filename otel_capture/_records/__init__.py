"""Records, the bottom of the house: the schema (:mod:`.schema`), the line codec both ways
(:mod:`.codec`: a call's values to its line, a line back to a record, the tokens line, the line splitter,
the wording of a damaged line), the derivation of a record from a line (:mod:`.build`) and the aggregate
over records (:mod:`.aggregate`). Nothing here knows the store; the readers that take one are
:mod:`otel_capture._store.reading`."""

from __future__ import annotations

from .aggregate import aggregate_model_call_records
from .build import build_model_call_record
from .codec import (
    CaptureReadError,
    InvalidLine,
    damaged_line,
    encode_record_line,
    encode_tokens_line,
    parse_record_line,
    tokens_line,
)
from .schema import (
    EXTRA_RECORD_FIELDS,
    GYM_RECORD_FIELDS,
    SCHEMA_VERSION,
    ModelCallRecord,
    ModelServerRef,
    call_failed,
)

__all__ = [
    "EXTRA_RECORD_FIELDS",
    "GYM_RECORD_FIELDS",
    "SCHEMA_VERSION",
    "CaptureReadError",
    "InvalidLine",
    "ModelCallRecord",
    "ModelServerRef",
    "aggregate_model_call_records",
    "build_model_call_record",
    "call_failed",
    "damaged_line",
    "encode_record_line",
    "encode_tokens_line",
    "parse_record_line",
    "tokens_line",
]
