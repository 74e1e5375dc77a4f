"""What callers put on :class:`.writer.JsonlWriter`'s queue for its thread, and how the thread ends a call.

A call's line (``_Item``), the begin of a call (``_Begin``, its ``+`` marker due later), a call abandoned or
discarded without a line, and a barrier a ``flush`` waits on. Each call's item carries one completion
route, the caller's :class:`LoopWaiter` (defined here: it is the writer's completion signal); :class:`Completions` resolves them, one
event-loop wake-up per loop per batch. :class:`WriterStats` is what the thread counts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from dataclasses import dataclass

from .weight import WeightStamp


@dataclass(slots=True)
class LoopWaiter:
    """An asyncio future to resolve (on its own loop) when a call's line is durable or has failed."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass(slots=True)
class WriterStats:
    """Counters a user can read to see what the writer did (and what it failed to do)."""

    records_written: int = 0
    batches: int = 0
    fsyncs: int = 0
    failures: int = 0
    last_failure: str | None = None
    late_write_dropped: int = 0
    """Lines of frozen or retired rollouts (or of calls admitted before a retire or delete), dropped."""
    after_close: int = 0
    """Calls handed to the writer after it was closed: each is also in ``failures`` and marked incomplete."""
    unreported: int = 0
    """Lost calls whose incomplete mark is not in their rollout's marker yet (retried) (contract D13)."""


@dataclass(slots=True)
class _Item:
    rollout_id: str
    line: bytes
    model_call_id: str
    tokens_line: bytes | None
    waiter: LoopWaiter
    """The one completion route: resolved by the thread with the rest of its batch."""
    resolved: bool = False
    weight: WeightStamp | None = None
    """(caller's weight version, started_at, completed_at): the declared versions are added to ``line`` in
    its batch (:func:`.weight.stamp_batch`); ``None``: the line is written as it is."""


@dataclass(slots=True)
class _Abandon:
    rollout_id: str
    model_call_id: str
    reason: str


@dataclass(slots=True)
class _Discard:
    rollout_id: str
    model_call_id: str
    marked: bool = True
    """False when the call's ``+`` marker was never written (nothing to end on disk)."""


@dataclass(slots=True)
class _Begin:
    rollout_id: str
    model_call_id: str
    at: float = 0.0
    """``time.monotonic()`` when the call began: its ``+`` marker is due ``marker_delay`` later."""


class _Barrier:
    def __init__(self) -> None:
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()


class Completions:
    """Resolves calls' waiters: each ``resolve`` is queued per event loop and :meth:`flush` wakes each loop
    once (one ``call_soon_threadsafe`` per loop per batch, instead of one per call as
    ``asyncio.wrap_future`` costs). Used by the writer thread, and by a caller's thread only when the
    thread is gone (a call after ``close``)."""

    def __init__(self) -> None:
        self._wakeups: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], BaseException | None]]
        ] = {}

    def resolve(self, item: _Item, error: BaseException | None = None) -> None:
        item.resolved = True
        self._wakeups.setdefault(item.waiter.loop, []).append((item.waiter.future, error))

    def flush(self) -> None:
        wakeups, self._wakeups = self._wakeups, {}
        for loop, entries in wakeups.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(_wake, entries)


def _wake(entries: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    """On the waiters' loop: resolve a whole batch's waiters in one callback."""
    for future, error in entries:
        if future.done():  # the waiting task was cancelled, or its durability deadline passed
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
