"""The incomplete mark: ``<dir>/<rollout_id>.capture.incomplete``, one JSON line per call that was not
captured, ``{"model_call_id", "reason", "at"}``. NeMo Gym only checks that the file exists (its empty
marker says "marked incomplete"). Made here, parsed here: the one place that knows a mark's fields."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import orjson

from .._errors import DamagedEntryError
from .._records.codec import final_tail, line_spans
from .fs import open_file, read_all
from .types import IncompleteCall

UNNAMED_REASON = "marked incomplete"
"""The reason of a mark that gives none, and of NeMo Gym's empty marker."""


def mark_lines(calls: Iterable[tuple[str, str]], at: float | None = None) -> bytes:
    """The marker lines of ``(model_call_id, reason)`` calls, all stamped ``at`` (default: now)."""
    now = time.time() if at is None else at
    return b"".join(
        orjson.dumps({"model_call_id": mcid, "reason": reason, "at": now}, option=orjson.OPT_APPEND_NEWLINE)
        for mcid, reason in calls
    )


def parse_mark(line: bytes) -> IncompleteCall:
    """One line of a marker (``model_call_id`` ``""`` when it names none: NeMo Gym's or a damaged line)."""
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        return IncompleteCall("", UNNAMED_REASON)
    mcid, reason = value.get("model_call_id"), value.get("reason")
    return IncompleteCall(mcid if isinstance(mcid, str) else "", str(reason or UNNAMED_REASON))


def parse_marks(data: bytes) -> tuple[list[IncompleteCall], int]:
    """A marker's calls and its number of complete lines (what they add to the rollout's ``version``). A
    torn last line (a mark cut short) still names a lost call; an empty marker names one unnamed call."""
    calls = [parse_mark(data[start:end]) for _, start, end in line_spans(data)]
    lines = len(calls)
    tail = final_tail(data)
    if tail.strip():
        calls.append(parse_mark(tail))
    return (calls or [IncompleteCall("", UNNAMED_REASON)]), lines


def read_marks(path: Path) -> list[IncompleteCall] | None:
    """The calls a marker names, read without a lock (as NeMo Gym checks it); ``None`` when absent. A
    marker that is not a regular file is not read: it names one unnamed call, saying what it is."""
    try:
        fd, _ = open_file(None, path, os.O_RDONLY, path.name, single_link=False)
    except FileNotFoundError:
        return None
    except DamagedEntryError as exc:
        return [IncompleteCall("", f"{path.name}: {exc.what}: not read")]
    try:
        data = read_all(fd)
    finally:
        os.close(fd)
    return parse_marks(data)[0]
