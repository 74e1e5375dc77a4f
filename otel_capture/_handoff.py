"""How a finished call's payload travels from the middleware to the JSONL exporter: an in-process side
channel keyed by span id.

Why not private span attributes: span attributes go through ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`` and
``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`` (a record must keep the exact bodies whatever they say), every other
processor and exporter on the provider would see raw prompts unless each one stripped them, and a 50 MB
body would be copied into the span. The side channel keeps payloads out of OpenTelemetry entirely; only
the ids and the GenAI attributes go on the span.

The path of one call:

1. the middleware builds the record line and *offers* it here under the model-call span's id;
2. it ends the span; when the exporter sits behind a synchronous processor, ``export()`` runs inside
   ``span.end()`` and *claims* the call by span id, handing the line to its writer;
3. right after ``span.end()`` the middleware claims whatever is still unclaimed (the span went to a
   batching processor, or was not sampled) and hands it to the active sink itself, so records never wait
   for an export delay and never depend on trace sampling;
4. the middleware awaits the call's durability future before it releases the terminal chunk.

Before all that, when a call starts, the middleware calls :func:`begin_call`, so that a freeze taken while
the call is in flight reports the rollout incomplete (DESIGN §6). It never raises and never blocks.

``otel_capture`` never imports ``exporters``: exporters register themselves here as the active sink.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import Protocol

_logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoopWaiter:
    """An asyncio future to resolve (on its own loop) when a call's line is durable or has failed."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass(slots=True)
class CapturedCall:
    """One finished call, ready to be written."""

    rollout_id: str
    model_call_id: str
    line: bytes  # one JSON object ending in "\n"
    tokens_line: bytes | None = None  # the call's <id>.tokens.jsonl line, when the upstream returned tokens
    # An asyncio future (and its loop) for the middleware to await. A sink that resolves it itself sets
    # ``waiter_taken`` (our writer resolves a whole batch's waiters with one loop wake-up); otherwise the
    # middleware waits on the sink's concurrent future.
    waiter: LoopWaiter | None = None
    waiter_taken: bool = False


class CallSink(Protocol):
    def write_call(self, call: CapturedCall) -> concurrent.futures.Future[None]: ...


_lock = threading.Lock()
_sinks: list[CallSink] = []
_pending: dict[int, CapturedCall] = {}
_claimed: dict[int, concurrent.futures.Future[None]] = {}


def register_sink(sink: CallSink) -> None:
    """Make ``sink`` the active sink (the most recently registered one wins)."""
    with _lock:
        if sink in _sinks:
            _sinks.remove(sink)
        _sinks.append(sink)


def unregister_sink(sink: CallSink) -> None:
    with _lock:
        if sink in _sinks:
            _sinks.remove(sink)


def active_sink() -> CallSink | None:
    with _lock:
        return _sinks[-1] if _sinks else None


def begin_call(rollout_id: str, model_call_id: str) -> None:
    """Tell the active sink a captured call has started (if it cares). Never raises: a late call of a
    fenced rollout is still answered; its line is dropped when it is written."""
    sink = active_sink()
    begin = getattr(sink, "begin_call", None)
    if begin is None:
        return
    try:
        begin(rollout_id, model_call_id)
    except Exception:
        _logger.debug("begin_call failed for rollout %s", rollout_id, exc_info=True)


def abandon_call(rollout_id: str, model_call_id: str, reason: str) -> None:
    """Tell the active sink a begun call will never have a record (building it failed). Never raises."""
    abandon = getattr(active_sink(), "abandon_call", None)
    if abandon is None:
        return
    try:
        abandon(rollout_id, model_call_id, reason)
    except Exception:
        _logger.debug("abandon_call failed for rollout %s", rollout_id, exc_info=True)


def offer(span_id: int, call: CapturedCall) -> None:
    _pending[span_id] = call


def claim_for_export(span_id: int, sink: CallSink) -> bool:
    """Called by an exporter's ``export()``: write the call offered under ``span_id``, if any."""
    # Under the lock so that settle() sees either the pending call or its future, never neither.
    with _lock:
        call = _pending.pop(span_id, None)
        if call is None:
            return False
        _claimed[span_id] = sink.write_call(call)  # write_call only queues: cheap under the lock
    return True


def settle(span_id: int) -> concurrent.futures.Future[None] | None:
    """Called by the middleware after ``span.end()``: the durability future of the call, writing it
    through the active sink when no exporter claimed it; ``None`` when there is no sink at all."""
    with _lock:
        future = _claimed.pop(span_id, None)
        if future is not None:
            return future
        call = _pending.pop(span_id, None)
        sink = _sinks[-1] if _sinks else None
    if call is None or sink is None:
        return None
    return sink.write_call(call)
