"""Model calls served without a rollout id, counted in the capture directory itself.

Such a call cannot be recorded (no rollout to file it under); the middleware logs it, but a host can
silence logging (vLLM sets the root logger to ERROR) and a log is easily missed. So each process that
serves them also keeps a count in the directory, which ``otel-capture check``, ``show`` and ``ls`` report:
one small JSON file per process run, ``.uncorrelated.<host>.<pid>.<start>.json``
(``{"calls": N, "by_dialect": {...}, "first": t, "last": t}``, times in Unix seconds).

Cheap on the call's path: a call only bumps counters in memory; the file is rewritten at most once per
``WRITE_INTERVAL_S`` (a timer on the call's event loop writes what came meanwhile) and once at exit. It is
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


class UncorrelatedCounter:
    """This process's count for one capture directory (one per directory: :func:`counter_for`)."""

    def __init__(self, directory: Path) -> None:
        host = socket.gethostname().replace("/", "_") or "host"
        self.path = (
            directory / f"{UNCORRELATED_PREFIX}{host}.{os.getpid()}.{time.time_ns()}{UNCORRELATED_SUFFIX}"
        )
        self.calls = 0
        self.by_dialect: dict[str, int] = {}
        self.first: float | None = None
        self.last: float | None = None
        self._written = 0  # the count the file has
        self._next_write = 0.0  # monotonic time before which the file is not rewritten
        self._timer = False  # a write is scheduled on an event loop
        self._failed = False
        # why a lock: the timer's write (on the event loop) and the exit's write (atexit, any thread)
        # must not interleave their temporary files or leave the older count last
        self._lock = threading.Lock()

    def count(self, dialect: str) -> None:
        """One uncorrelated call (on the event loop that served it): counted now, written within a second."""
        self.calls += 1
        self.by_dialect[dialect] = self.by_dialect.get(dialect, 0) + 1
        now = time.time()
        self.first = self.first if self.first is not None else now
        self.last = now
        if self._timer:
            return
        delay = self._next_write - time.monotonic()
        if delay <= 0:
            self.write()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # counted outside a loop: the exit's write takes it
            return
        self._timer = True
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
            calls = self.calls
            body = {"calls": calls, "by_dialect": self.by_dialect, "first": self.first, "last": self.last}
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
    """What a directory's counter files say, all processes together."""

    calls: int = 0
    processes: int = 0
    by_dialect: dict[str, int] = field(default_factory=dict)
    last: float | None = None

    def describe(self) -> str:
        dialects = ", ".join(f"{n} {d}" for d, n in sorted(self.by_dialect.items()))
        last = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.last)) if self.last is not None else "?"
        return (
            f"{self.calls} model call(s) without a rollout id were served and not recorded ({dialects}; "
            f"{self.processes} process(es), the last at {last}): give each call a rollout id "
            "(see docs/gateways.md)"
        )


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
            for dialect, n in by_dialect.items():
                if isinstance(n, int):
                    summary.by_dialect[str(dialect)] = summary.by_dialect.get(str(dialect), 0) + n
            if isinstance(last, (int, float)) and (summary.last is None or last > summary.last):
                summary.last = float(last)
    return summary
