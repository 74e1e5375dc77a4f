"""The readers of ``<dir>/<rollout_id>.capture.jsonl``, compatible with NeMo Gym 0.7.0: the store's lines
(:mod:`.lines`, under ``flock(LOCK_SH)``) (contract D8) through the record codec.

- :func:`read_model_call_records` is strict, like Gym's: the first damaged line raises
  :class:`CaptureReadError`; unlike Gym, a torn final line is damage too, never parsed (contract D7).
- :func:`read_available_model_call_records` is tolerant: every valid record, and every damaged line,
  the torn tail and the incomplete marker reported.
- :func:`aggregate_model_call_metrics`: Gym's per-rollout totals over the strict reader.

``call_index`` is never stored: it is the line's position among the file's non-blank lines.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from .._records import ModelCallRecord, aggregate_model_call_records
from .._records.codec import (
    TORN_REASON,
    CaptureReadError,
    DamagedLine,
    InvalidLine,
    decode_record_line,
    preview,
)
from .._records.speed import gc_paused
from .store import CaptureStore

__all__ = [
    "AvailableRecords",
    "aggregate_model_call_metrics",
    "iter_model_call_records",
    "read_available_model_call_records",
    "read_model_call_records",
    "scan_available_model_call_records",
]

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AvailableRecords:
    """What the tolerant reader found: valid records, damaged lines, a torn tail, the incomplete marker."""

    records: list[ModelCallRecord]
    invalid: list[InvalidLine] = field(default_factory=list)
    # The file ends with a line that has no newline: a crash mid-write. Reported, never parsed.
    torn_tail: bool = False
    # The ``<id>.capture.incomplete`` marker exists: at least one call of the rollout was not captured.
    incomplete: bool = False
    torn_tail_line: InvalidLine | None = None

    @property
    def damaged(self) -> int:
        """Damaged lines, the torn tail included."""
        return len(self.invalid) + int(self.torn_tail)


def _scan(lines: Iterable[bytes]) -> Generator[tuple[int, bytes, ModelCallRecord | DamagedLine], None, None]:
    """``(physical line number, stripped line, record or why it is damaged)`` for every non-blank line;
    ``call_index`` counts damaged lines too, as Gym's readers do. The collector is paused meanwhile."""
    index = 0
    with gc_paused():
        for number, line in enumerate(lines, 1):
            stripped = line.strip()
            if not stripped:
                continue
            try:
                yield number, stripped, decode_record_line(stripped, index)
            except DamagedLine as exc:
                yield number, stripped, exc
            index += 1


def read_model_call_records(store: CaptureStore, rollout_id: str) -> list[ModelCallRecord]:
    """Every record of a rollout in append order; ``[]`` when there is no data file.

    Raises :class:`CaptureReadError` (a ``ValueError``) at the first damaged line or a torn final line,
    and ``ValueError`` for an invalid rollout id. Reads under ``flock(LOCK_SH)``.
    """
    return list(iter_model_call_records(store, rollout_id))


def iter_model_call_records(store: CaptureStore, rollout_id: str) -> Iterator[ModelCallRecord]:
    """:func:`read_model_call_records` one record at a time, for callers that need not hold them all (the
    aggregates). The file is read whole under the lock first; only the records are made one by one."""
    raw = store.read_lines(rollout_id)
    if raw is None:
        return
    with closing(_scan(raw.lines)) as scan:  # closed at once, so the collector resumes even on a raise
        for number, _, record in scan:
            if isinstance(record, DamagedLine):
                raise CaptureReadError(
                    store.data_path(rollout_id), number, record.reason
                ) from record.__cause__
            yield record
    if raw.tail.strip():
        raise CaptureReadError(store.data_path(rollout_id), len(raw.lines) + 1, TORN_REASON)


def read_available_model_call_records(store: CaptureStore, rollout_id: str) -> AvailableRecords:
    """Every valid record, and a report of what is not (damaged lines, torn tail, incomplete marker).

    ``call_index`` counts every non-blank line, damaged ones included, as Gym's tolerant reader does, so
    indices around a damaged line have a gap. Raises ``ValueError`` only for an invalid rollout id.
    """
    raw = store.read_lines(rollout_id)
    incomplete = store.is_incomplete(rollout_id)
    if raw is None:
        return AvailableRecords(records=[], incomplete=incomplete)
    records: list[ModelCallRecord] = []
    invalid: list[InvalidLine] = []
    for number, stripped, record in _scan(raw.lines):
        if isinstance(record, DamagedLine):
            invalid.append(InvalidLine(number, record.reason, preview(stripped)))
        else:
            records.append(record)
    torn_line = None
    if raw.tail.strip():
        torn_line = InvalidLine(len(raw.lines) + 1, TORN_REASON, preview(raw.tail.strip()))
    return AvailableRecords(
        records=records,
        invalid=invalid,
        torn_tail=torn_line is not None,
        incomplete=incomplete,
        torn_tail_line=torn_line,
    )


def scan_available_model_call_records(
    store: CaptureStore, rollout_id: str
) -> tuple[int, Iterator[ModelCallRecord | InvalidLine]]:
    """:func:`read_available_model_call_records` one line at a time, for callers that print as they read
    (``otel-capture show``): the number of complete lines (so ``call_index`` stays below it), and each
    valid record or the :class:`InvalidLine` of a damaged one, in file order. The torn tail is not reported
    here. The lines are read as they are consumed, from what the file held under the lock
    (:meth:`CaptureStore.stream_lines`): memory stays flat whatever the file's size. ``(0, empty)`` when
    there is no data file."""
    streamed = store.stream_lines(rollout_id)
    if streamed is None:
        return 0, iter(())

    def items() -> Iterator[ModelCallRecord | InvalidLine]:
        with closing(_scan(streamed)) as scan:
            for number, stripped, record in scan:
                if isinstance(record, DamagedLine):
                    yield InvalidLine(number, record.reason, preview(stripped))
                else:
                    yield record

    return streamed.count, items()


def aggregate_model_call_metrics(store: CaptureStore, rollout_id: str) -> dict[str, Any]:
    """:func:`~otel_capture._records.aggregate.aggregate_model_call_records` over the strict reader, as
    Gym does: a damaged line raises :class:`CaptureReadError` rather than giving totals that silently miss
    calls. The records are aggregated as they are parsed, never all held at once."""
    return aggregate_model_call_records(iter_model_call_records(store, rollout_id))
