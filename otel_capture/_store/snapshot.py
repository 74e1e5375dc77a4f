"""What a freeze reads: a rollout's files, parsed as the readers parse them, and kept as bytes
(:class:`.lazy.LazyLines`) so that a snapshot costs about the files' size. Read under the rollout's stripe,
each file under ``flock(LOCK_SH)``; a freeze also syncs every file it read."""

from __future__ import annotations

import errno
import os
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from .._errors import DamagedEntryError
from .._records import ModelCallRecord, damaged_line, parse_record_line
from .._records.codec import (
    TORN_REASON,
    DamagedLine,
    InvalidLine,
    decode_record_line,
    final_tail,
    line_spans,
    preview,
)
from .._records.speed import gc_paused
from .fs import DirFds, read_locked
from .lazy import LazyLines, LineParser, empty_lines
from .marker import parse_marks
from .names import CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX
from .sync import Fsync
from .types import IncompleteCall


@dataclass
class Contents:
    """A rollout's files as a freeze reads them: records and token lines are kept as the files' bytes and
    parsed on access (:class:`.lazy.LazyLines`), so a snapshot costs about the files' size."""

    records: LazyLines[ModelCallRecord] = field(default_factory=lambda: empty_lines(parse_record_line))
    tokens: LazyLines[dict[str, Any]] = field(default_factory=lambda: empty_lines(_json_object))
    incomplete: list[IncompleteCall] = field(default_factory=list)
    """Everything that makes the rollout incomplete, in prose (a snapshot's ``incomplete_calls``)."""
    marker_exists: bool = False
    marks: list[IncompleteCall] = field(default_factory=list)
    """What the marker names (a damaged marker: one call saying what it is)."""
    damaged_lines: list[InvalidLine] = field(default_factory=list)
    torn_tail: InvalidLine | None = None
    unreadable: str | None = None
    version: int = 0
    record_ids: set[str] = field(default_factory=set)

    def call_ids(self) -> set[str]:
        ids = self.record_ids | {c.model_call_id for c in self.incomplete}
        return {i for i in ids if isinstance(i, str)}


def _read(dirs: DirFds, name: str, contents: Contents, fsync: Fsync | None) -> bytes | None:
    try:
        return read_locked(dirs.root_fd(), name, name, fsync, dirs.lock_timeout)
    except DamagedEntryError as exc:
        contents.incomplete.append(IncompleteCall("", f"{exc.label}: {exc.what}: not read"))
        if name.endswith(INCOMPLETE_SUFFIX):
            contents.marks.append(IncompleteCall("", f"{exc.label}: {exc.what}: not read"))
        elif name.endswith(CAPTURE_SUFFIX) and exc.what.startswith("a directory"):
            # the readers' open fails at once on a directory (a link or a FIFO they skip, as not there)
            error = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(dirs.root / name))
            contents.unreadable = f"{type(error).__name__}: {error}"
        return None


def _json_object(line: bytes, _index: int) -> dict[str, Any] | None:
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _parse_lines(
    dirs: DirFds,
    name: str,
    contents: Contents,
    fsync: Fsync | None,
    parse: LineParser = _json_object,
    seen: Callable[[Any], None] | None = None,
) -> LazyLines[Any] | None:
    """The file's non-blank lines that ``parse(line, index)`` accepts, kept as bytes (``None`` from
    ``parse`` is damage, reported in ``contents``); each parsed value is handed to ``seen`` and dropped."""
    data = _read(dirs, name, contents, fsync)
    if data is None:
        return None
    spans = array("q")
    for index, (number, start, end) in enumerate(line_spans(data)):
        contents.version += 1
        value = parse(data[start:end], index)
        if value is not None:
            spans.extend((start, end, index))
            if seen is not None:
                seen(value)
        else:
            contents.incomplete.append(IncompleteCall("", f"{name}: {damaged_line(number)}"))
            if name.endswith(CAPTURE_SUFFIX):
                contents.damaged_lines.append(_invalid_record(data[start:end], number, index))
    tail = final_tail(data).strip()
    if tail:
        contents.incomplete.append(IncompleteCall("", f"{name}: {TORN_REASON}"))
        if name.endswith(CAPTURE_SUFFIX):
            contents.torn_tail = InvalidLine(data.count(b"\n") + 1, TORN_REASON, preview(tail))
    return LazyLines(data, spans, parse)


def _invalid_record(line: bytes, number: int, index: int) -> InvalidLine:
    """A damaged data line as the tolerant reader reports it (decoded again for its reason: damage is rare)."""
    stripped = line.strip()
    try:
        decode_record_line(stripped, index)
        reason = "damaged"  # not reached: parse_record_line refused it
    except DamagedLine as exc:
        reason = exc.reason
    return InvalidLine(number, reason, preview(stripped))


def _record_id(contents: Contents) -> Callable[[ModelCallRecord], None]:
    def seen(record: ModelCallRecord) -> None:
        if isinstance(record.model_call_id, str):
            contents.record_ids.add(record.model_call_id)

    return seen


def read_contents(dirs: DirFds, rollout_id: str, *, fsync: Fsync | None = None) -> Contents:
    """A rollout's files, parsed (under its stripe; each file under ``flock(LOCK_SH)``, as the readers do,
    so a NeMo Gym writer's line is never read half-written). ``fsync`` (the freeze) makes every file read
    durable, so a snapshot never hands out a record that a crash could still take back. An entry that is
    not a regular file is not read: it makes the rollout incomplete, with the reason."""
    contents = Contents()
    with gc_paused():
        # validated as the readers parse it (the same records, call_index counting damaged lines too),
        # then kept as bytes: each record is parsed again when the snapshot's user asks for it
        name = rollout_id + CAPTURE_SUFFIX
        records = _parse_lines(dirs, name, contents, fsync, parse_record_line, _record_id(contents))
        if records is not None:
            contents.records = records
        tokens = _parse_lines(dirs, rollout_id + TOKENS_SUFFIX, contents, fsync)
        if tokens is not None:
            contents.tokens = tokens
        data = _read(dirs, rollout_id + INCOMPLETE_SUFFIX, contents, fsync)
    if data is None:
        return contents
    contents.marker_exists = True
    marks, lines = parse_marks(data)
    contents.incomplete.extend(marks)
    contents.marks.extend(marks)
    contents.version += lines
    return contents


def count_version(dirs: DirFds, rollout_id: str) -> int:
    """The rollout's ``version`` (its durable lines) without parsing them: what retire and drop need."""
    total = 0
    for suffix in (CAPTURE_SUFFIX, TOKENS_SUFFIX, INCOMPLETE_SUFFIX):
        data = _read(dirs, rollout_id + suffix, Contents(), None)
        if data is not None:
            total += sum(1 for _ in line_spans(data))  # the durable lines, not parsed
    return total
