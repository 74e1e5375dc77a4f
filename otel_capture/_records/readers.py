"""The readers of ``<dir>/<rollout_id>.capture.jsonl``, compatible with NeMo Gym 0.7.0.

- :func:`read_model_call_records` is strict, like Gym's: the first damaged line raises
  :class:`CaptureReadError` naming the file and the line. Unlike Gym, a torn final line (no trailing
  newline: a writer died mid-append) is damage too, never parsed as a record.
- :func:`read_available_model_call_records` is tolerant: it returns every valid record and reports every
  damaged line, the torn tail and the incomplete marker, hiding nothing.

``call_index`` is never stored: it is the line's position among the file's non-blank lines. Both read
under ``flock(LOCK_SH)`` through :meth:`CaptureStore.read_lines`; see ``docs/durability.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import orjson
from pydantic import ValidationError

from .build import build_model_call_record
from .schema import ModelCallRecord
from .speed import gc_paused

if TYPE_CHECKING:  # the store hands snapshots of these records out, so it imports this package
    from .._store.store import CaptureStore

__all__ = [
    "AvailableRecords",
    "CaptureReadError",
    "InvalidLine",
    "iter_model_call_records",
    "parse_record_line",
    "read_available_model_call_records",
    "read_model_call_records",
    "scan_available_model_call_records",
]

_logger = logging.getLogger(__name__)

_PREVIEW_BYTES = 300


class CaptureReadError(ValueError):
    """A damaged line in a capture file, found by the strict reader."""

    def __init__(self, path: Path, line_number: int, reason: str) -> None:
        super().__init__(f"{path}:{line_number}: {reason}")
        self.path = path
        self.line_number = line_number
        self.reason = reason


class InvalidLine(NamedTuple):
    """A damaged line: 1-based physical line number, why it was refused, and its start (decoded)."""

    line_number: int
    reason: str
    raw: str


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


class _DamagedLine(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _validation_reason(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        loc = ".".join(str(part) for part in error["loc"])
        if loc == "latency_total_ms":
            loc = "latency_ms"  # name the key as it is on disk
        parts.append(f"{loc}: {error['msg']}")
    return "invalid record: " + "; ".join(parts)


def _record_from_line(stripped: bytes, call_index: int) -> ModelCallRecord:
    try:
        obj = orjson.loads(stripped)
    except orjson.JSONDecodeError as exc:
        raise _DamagedLine(f"invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise _DamagedLine(f"not a JSON object but {type(obj).__name__}")
    try:
        return build_model_call_record(obj, call_index=call_index)
    except ValidationError as exc:
        raise _DamagedLine(_validation_reason(exc)) from exc
    except Exception as exc:  # Gym counts any failure to build a record as a damaged line
        raise _DamagedLine(f"cannot derive record: {type(exc).__name__}: {exc}") from exc


def parse_record_line(line: bytes, call_index: int) -> ModelCallRecord | None:
    """One non-blank line as the readers read it; ``None`` when it is damaged (what a freeze reports)."""
    try:
        return _record_from_line(line.strip(), call_index)
    except _DamagedLine:
        return None


def _scan(lines: Iterable[bytes]) -> Generator[tuple[int, bytes, ModelCallRecord | _DamagedLine], None, None]:
    """``(physical line number, stripped line, record or why it is damaged)`` for every non-blank line;
    ``call_index`` counts damaged lines too, as Gym's readers do. The collector is paused meanwhile."""
    index = 0
    with gc_paused():
        for number, line in enumerate(lines, 1):
            stripped = line.strip()
            if not stripped:
                continue
            try:
                yield number, stripped, _record_from_line(stripped, index)
            except _DamagedLine as exc:
                yield number, stripped, exc
            index += 1


def _preview(line: bytes) -> str:
    if len(line) <= _PREVIEW_BYTES:
        return line.decode("utf-8", "replace")
    return line[:_PREVIEW_BYTES].decode("utf-8", "replace") + f"... ({len(line)} bytes)"


_TORN_REASON = "torn final line (no trailing newline): an append was cut short; not parsed"


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
            if isinstance(record, _DamagedLine):
                raise CaptureReadError(
                    store.data_path(rollout_id), number, record.reason
                ) from record.__cause__
            yield record
    if raw.tail.strip():
        raise CaptureReadError(store.data_path(rollout_id), len(raw.lines) + 1, _TORN_REASON)


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
        if isinstance(record, _DamagedLine):
            invalid.append(InvalidLine(number, record.reason, _preview(stripped)))
        else:
            records.append(record)
    torn_line = None
    if raw.tail.strip():
        torn_line = InvalidLine(len(raw.lines) + 1, _TORN_REASON, _preview(raw.tail.strip()))
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
                if isinstance(record, _DamagedLine):
                    yield InvalidLine(number, record.reason, _preview(stripped))
                else:
                    yield record

    return streamed.count, items()
