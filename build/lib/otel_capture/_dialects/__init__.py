"""The dialects: one table saying what each means (:mod:`.table`), SSE decoding, stream reassembly, and
what is derived from the bodies. Re-exports only."""

from __future__ import annotations

from .stream import StreamAccumulator
from .table import (
    DIALECT_PATHS,
    DIALECTS,
    Dialect,
    DialectSpec,
    finish_reasons,
    shape_dialect,
)

__all__ = [
    "DIALECTS",
    "DIALECT_PATHS",
    "Dialect",
    "DialectSpec",
    "StreamAccumulator",
    "finish_reasons",
    "shape_dialect",
]
