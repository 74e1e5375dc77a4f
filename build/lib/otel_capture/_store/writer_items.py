"""What callers put on :class:`.writer.JsonlWriter`'s queue for its thread: a call's line (``_Item``), the
begin of a call (``_Begin``, its ``+`` marker due later), a call abandoned or discarded without a line, and
a barrier a ``flush`` waits on."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from .._sink import LoopWaiter


@dataclass(slots=True)
class _Item:
    rollout_id: str
    line: bytes
    model_call_id: str
    tokens_line: bytes | None = None
    future: concurrent.futures.Future[None] | None = None
    """None when a ``waiter`` is given (the middleware's route): the thread resolves the waiter alone."""
    waiter: LoopWaiter | None = None
    resolved: bool = False


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
