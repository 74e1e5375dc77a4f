"""Model calls served and not recorded, counted in the capture directory itself: calls without a rollout
id, calls whose id breaks the grammar (kind ``invalid_id``), and late calls to a frozen or retired
rollout (kind ``late``, by rollout id: their lines are dropped by the writer) (contract L9).

Such a call cannot be recorded; the middleware logs it, but a host can silence logging (vLLM sets the
root logger to ERROR) and a log is easily missed. So each process that serves them also keeps a count in
the directory, which ``otel-capture check`` and ``ls`` report: one small JSON file per process run,
``.uncorrelated.<host>.<pid>.<start>.json``: ``{"calls": N, "by_dialect": {...}, "first": t, "last": t}``
for the calls without an id (times in Unix seconds), and, when there were any, ``"invalid_id": {"calls": N,
"by_dialect": {...}, "last": t}`` and ``"late": {"calls": N, "by_rollout": {...}, "last": t}``.

Cheap on the call's path: a call only bumps counters in memory; the file is rewritten at most once per
``WRITE_INTERVAL_S`` (a timer on the call's event loop, or a timer thread off a loop, writes what came
meanwhile) and once at exit. It is
a hint, not a record: replaced whole (write to a temporary name, rename) so a reader never sees half a
file, and never synced (a crash may lose the last second's count, never a record). Written as the writer
writes: only into a directory it would accept (:func:`.fs.check_directory`, with the writer's choice for
shared directories) and through the store's no-follow I/O (:func:`.fs.replace_file`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from .dirstate import dir_state
from .fs import check_directory, replace_file
from .names import UNCORRELATED_PREFIX, UNCORRELATED_SUFFIX

_logger = logging.getLogger(__name__)

WRITE_INTERVAL_S = 1.0
NO_ID = "no_id"
INVALID_ID = "invalid_id"
LATE = "late"
# The words each kind's line opens with (after its number): check's answer names the kinds by them.
NO_ID_WORDS = "model call(s) without a rollout id"
INVALID_ID_WORDS = "model call(s) with a rollout id outside the grammar (invalid_id)"
LATE_WORDS = "late model call(s) to a frozen or retired rollout"
_MAX_LATE_ROLLOUTS = 1000  # rollout ids named in one file; past it, late calls are counted, not named


@dataclass
class _Tally:
    """The calls of one kind: how many, by dialect (or by rollout id for late calls), the last one's time."""

    calls: int = 0
    by: dict[str, int] = field(default_factory=dict)
    last: float | None = None

    def add(self, key: str, now: float, limit: int | None = None) -> None:
        self.calls += 1
        if key in self.by or limit is None or len(self.by) < limit:
            self.by[key] = self.by.get(key, 0) + 1
        self.last = now


class UncorrelatedCounter:
    """This process's count for one capture directory (one per directory: :func:`counter_for`)."""

    def __init__(self, directory: Path) -> None:
        host = socket.gethostname().replace("/", "_") or "host"
        self.path = (
            directory / f"{UNCORRELATED_PREFIX}{host}.{os.getpid()}.{time.time_ns()}{UNCORRELATED_SUFFIX}"
        )
        self.calls = 0  # every kind: what the file has is compared with it
        self.by_dialect: dict[str, int] = {}  # the calls without an id
        self.invalid = _Tally()
        self.late = _Tally()
        self.first: float | None = None
        self.last: float | None = None
        self._written = 0  # the count the file has
        self._next_write = 0.0  # monotonic time before which the file is not rewritten
        self._timer = False  # a write is scheduled on an event loop
        self._failed = False
        # why a lock: the timer's write (on the event loop) and the exit's write (atexit, any thread)
        # must not interleave their temporary files or leave the older count last
        self._lock = threading.Lock()
        # why a second one: the event loops count calls and the writer thread counts late ones
        self._count_lock = threading.Lock()

    def count(self, dialect: str, kind: str = NO_ID) -> None:
        """One call served without a rollout id (``kind`` ``no_id``) or with one that breaks the grammar
        (``invalid_id``), on the event loop that served it: counted now, written within a second."""
        with self._count_lock:
            now = self._add()
            if kind == INVALID_ID:
                self.invalid.add(dialect, now)
            else:
                self.by_dialect[dialect] = self.by_dialect.get(dialect, 0) + 1
                self.first = self.first if self.first is not None else now
                self.last = now
        self._schedule()

    def count_late(self, rollout_id: str) -> None:
        """One late call to a frozen or retired rollout, its line dropped (by the writer's thread)."""
        with self._count_lock:
            self.late.add(rollout_id, self._add(), _MAX_LATE_ROLLOUTS)
        self._schedule()

    def _add(self) -> float:
        self.calls += 1
        return time.time()

    def _schedule(self) -> None:
        if self._timer:
            return
        delay = self._next_write - time.monotonic()
        if delay <= 0:
            self.write()
            return
        self._timer = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # counted off a loop (the writer's thread): a timer thread writes it
            timer = threading.Timer(delay, self._timed_write)
            timer.daemon = True  # the exit's write takes what it had not written
            timer.start()
            return
        loop.call_later(delay, self._timed_write)

    def _timed_write(self) -> None:
        self._timer = False
        self.write()

    def write(self) -> None:
        """Replace the file with the current count (nothing when it has it already). Never raises."""
        with self._lock:
            if self.calls == self._written:
                return
            self._next_write = time.monotonic() + WRITE_INTERVAL_S
            with self._count_lock:
                calls = self.calls
                body: dict[str, object] = {
                    "calls": calls - self.invalid.calls - self.late.calls,
                    "by_dialect": dict(self.by_dialect),
                    "first": self.first,
                    "last": self.last,
                }
                if self.invalid.calls:
                    body[INVALID_ID] = _tally_body(self.invalid, "by_dialect")
                if self.late.calls:
                    body[LATE] = _tally_body(self.late, "by_rollout")
            try:
                self._replace(orjson.dumps(body))
            except OSError as exc:
                if not self._failed:
                    self._failed = True
                    _logger.error("could not count uncorrelated model calls in %s: %s", self.path.parent, exc)
                return
            self._written = calls

    def _replace(self, data: bytes) -> None:
        state = dir_state(self.path.parent)
        # the writer's own check, with its choice for a shared directory (UnsafeDirectoryError: not written)
        check_directory(self.path.parent, allow_shared=state.shared_allowed)
        # no record yet, so maybe no directory: made as the writer makes it (0700), since a server whose
        # every call lacks the id is the one that most needs the count
        with state.dirs() as dirs:
            replace_file(dirs.root_fd(), self.path.name, data)


def _tally_body(tally: _Tally, by: str) -> dict[str, object]:
    return {"calls": tally.calls, by: dict(tally.by), "last": tally.last}


_counters: dict[Path, UncorrelatedCounter] = {}
_counters_lock = threading.Lock()  # why: two apps (threads) of one process may meet the same directory


def counter_for(directory: str | os.PathLike[str]) -> UncorrelatedCounter:
    """The process's counter for ``directory``: one file per directory and process, whatever the number of
    middlewares writing there."""
    path = Path(directory)
    with _counters_lock:
        counter = _counters.get(path)
        if counter is None:
            counter = _counters[path] = UncorrelatedCounter(path)
            if len(_counters) == 1:
                atexit.register(_write_all)
        return counter


def _write_all() -> None:
    for counter in list(_counters.values()):
        counter.write()


@dataclass
class UncorrelatedSummary:
    """What a directory's counter files say, all processes together: the calls without a rollout id
    (``calls``, ``by_dialect``), those with an id outside the grammar (``invalid``) and the late calls to a
    frozen or retired rollout (``late``, by rollout id)."""

    calls: int = 0
    processes: int = 0
    by_dialect: dict[str, int] = field(default_factory=dict)
    last: float | None = None
    invalid: _Tally = field(default_factory=_Tally)
    late: _Tally = field(default_factory=_Tally)

    def describe(self) -> str:
        """The line for the calls without a rollout id."""
        dialects = ", ".join(f"{n} {d}" for d, n in sorted(self.by_dialect.items()))
        return (
            f"{self.calls} {NO_ID_WORDS} were served and not recorded ({dialects}; "
            f"{self.processes} process(es), the last at {_when(self.last)}): give each call a rollout id "
            "(see docs/gateways.md)"
        )

    def describe_invalid(self) -> str:
        dialects = ", ".join(f"{n} {d}" for d, n in sorted(self.invalid.by.items()))
        return (
            f"{self.invalid.calls} {INVALID_ID_WORDS} were served and not recorded ({dialects}; the last at {_when(self.invalid.last)}): an id is "
            "1-200 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit (see docs/gateways.md)"
        )

    def describe_late(self, shown: int = 5) -> str:
        rollouts = sorted(self.late.by.items(), key=lambda item: (-item[1], item[0]))
        named = ", ".join(f"{rid}: {n}" for rid, n in rollouts[:shown])
        if len(rollouts) > shown:
            named += f" and {len(rollouts) - shown} more rollout(s)"
        return (
            f"{self.late.calls} {LATE_WORDS} were answered and not recorded ({named or 'rollouts not named'}; the last at {_when(self.late.last)}): a call made "
            "after its rollout was frozen (see docs/lifecycle.md)"
        )

    def lines(self) -> list[str]:
        """One line per kind of call that was served and not recorded (none: ``[]``)."""
        lines = [self.describe()] if self.calls else []
        if self.invalid.calls:
            lines.append(self.describe_invalid())
        if self.late.calls:
            lines.append(self.describe_late())
        return lines


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t is not None else "?"


def read_uncorrelated(directory: str | os.PathLike[str]) -> UncorrelatedSummary:
    """The sum of the directory's counter files; a file that cannot be read or parsed is skipped (it is a
    hint: a torn one cannot happen, a foreign one is not ours to judge)."""
    summary = UncorrelatedSummary()
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if not (entry.name.startswith(UNCORRELATED_PREFIX) and entry.name.endswith(UNCORRELATED_SUFFIX)):
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                body = orjson.loads(Path(entry.path).read_bytes())
                calls, by_dialect, last = body["calls"], body["by_dialect"], body["last"]
            except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
                continue
            if not isinstance(calls, int) or not isinstance(by_dialect, dict):
                continue
            summary.calls += calls
            summary.processes += 1
            _sum_into(summary.by_dialect, by_dialect)
            summary.last = _later(summary.last, last)
            _sum_tally(summary.invalid, body.get(INVALID_ID), "by_dialect")
            _sum_tally(summary.late, body.get(LATE), "by_rollout")
    return summary


def _sum_into(total: dict[str, int], counts: dict[object, object]) -> None:
    for key, n in counts.items():
        if isinstance(n, int):
            total[str(key)] = total.get(str(key), 0) + n


def _later(a: float | None, b: object) -> float | None:
    if isinstance(b, (int, float)) and (a is None or b > a):
        return float(b)
    return a


def _sum_tally(tally: _Tally, body: object, by: str) -> None:
    if not isinstance(body, dict) or not isinstance(body.get("calls"), int):
        return
    tally.calls += body["calls"]
    if isinstance(body.get(by), dict):
        _sum_into(tally.by, body[by])
    tally.last = _later(tally.last, body.get("last"))
