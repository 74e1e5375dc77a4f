"""Where a finished call's record goes: the ``CallSink`` the capture middleware is bound to when it is built.

The record's payloads (exact request and response bodies) never ride on the span: span attributes obey
``OTEL_*`` length and count limits, every other exporter would see raw prompts, and a 50 MB body would be
copied into the span. Instead the middleware is bound once, when it is built, to the ``model_call_jsonl``
exporter of its tracer provider (:func:`find_sink`), and every call takes the same route through it:

1. ``begin_call`` when the call starts (a freeze meanwhile reports the rollout incomplete);
2. ``write_call`` with the finished line after the span ends, whatever the span processor, the sampler or
   the export delay; ``abandon_call`` instead when the line could not be built; ``discard_call`` instead
   when the answer was a redirect (``3xx``): not the model call, so no line and no incomplete mark, only
   the call's end (the call the client makes next is the model call);
3. the middleware awaits the call's :class:`LoopWaiter`, which the writer resolves with the rest of its
   batch (one event-loop wake-up per batch), before it releases the terminal chunk.

See ``docs/architecture.md`` for the whole data path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from opentelemetry import trace

_logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoopWaiter:
    """An asyncio future to resolve (on its own loop) when a call's line is durable or has failed."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass(slots=True)
class FinishedCall:
    """One call whose response is complete, with its record line, ready to be written."""

    rollout_id: str
    model_call_id: str
    line: bytes  # one JSON object ending in "\n"
    tokens_line: bytes | None  # the call's <id>.tokens.jsonl line, when the upstream returned tokens
    waiter: LoopWaiter


@runtime_checkable
class CallSink(Protocol):
    """What the middleware needs from a record writer. None of the methods blocks or raises."""

    def begin_call(self, rollout_id: str, model_call_id: str) -> None: ...

    def abandon_call(self, rollout_id: str, model_call_id: str, reason: str) -> None: ...

    def discard_call(self, rollout_id: str, model_call_id: str) -> None: ...

    def write_call(self, call: FinishedCall) -> None: ...


def find_sink(tracer_provider: trace.TracerProvider | None = None) -> CallSink | None:
    """The first span exporter of ``tracer_provider`` (the global one by default) that is a
    :class:`CallSink`, whatever processor wraps it; ``None`` when there is none (spans only).

    The SDK has no public way to list a provider's processors, so this reads the SDK's own attributes
    (``TracerProvider._active_span_processor``, ``SimpleSpanProcessor.span_exporter``,
    ``BatchSpanProcessor._batch_processor._exporter``); ``tests/unit/test_sink.py`` pins them.
    """
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    for exporter in _exporters(provider):
        if isinstance(exporter, CallSink):
            return exporter
    return None


def _exporters(provider: Any) -> Iterator[Any]:
    multi = getattr(provider, "_active_span_processor", None)
    for processor in getattr(multi, "_span_processors", ()):
        exporter = getattr(processor, "span_exporter", None)
        if exporter is None:
            exporter = getattr(getattr(processor, "_batch_processor", None), "_exporter", None)
        if exporter is not None:
            yield exporter
