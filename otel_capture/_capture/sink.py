"""Where a finished call's record goes: the ``CallSink`` the capture middleware is bound to.

The record's payloads (exact request and response bodies) never ride on the span: span attributes obey
``OTEL_*`` length and count limits, every other exporter would see raw prompts, and a 50 MB body would be
copied into the span. Instead the middleware is bound to the ``model_call_jsonl`` exporter of its tracer
provider (:func:`find_sink` when it is built; :class:`SinkLookup` on its calls while it has none, so a
provider set later is found), and every call takes the same route through it:

1. ``begin_call`` when the call starts (a freeze meanwhile reports the rollout incomplete);
2. ``write_call`` with the finished line after the span ends, whatever the span processor, the sampler or
   the export delay; ``abandon_call`` instead when the line could not be built; ``discard_call`` instead
   when the answer was a redirect (``3xx``): not the model call, so no line and no incomplete mark, only
   the call's end (the call the client makes next is the model call);
3. the middleware awaits the call's :class:`LoopWaiter`, which the writer resolves with the rest of its
   batch (one event-loop wake-up per batch), before it releases the terminal chunk (contract D1, D3).

See ``docs/architecture.md`` for the whole data path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from opentelemetry import trace

from .._sdk_private import processor_exporter, span_processors
from .._store import LoopWaiter as LoopWaiter  # the writer's completion signal, defined in the store

_logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FinishedCall:
    """One call whose response is complete, with its record line, ready to be written."""

    rollout_id: str
    model_call_id: str
    line: bytes  # one JSON object ending in "\n"
    tokens_line: bytes | None  # the call's <id>.tokens.jsonl line, when the upstream returned tokens
    waiter: LoopWaiter
    # (the caller's weight version, started_at, completed_at): the writer adds the declared weight versions
    # to the line in the batch that writes it (otel_capture._store.weight); None: the line as it is
    weight: tuple[str | None, float | None, float | None] | None = None


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

    The SDK has no public way to list a provider's processors: they are read through
    :mod:`._sdk_private`, whose test pins each attribute against the installed SDK.
    """
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    return _sink_among(span_processors(provider))


def _sink_among(processors: tuple[Any, ...] | None) -> CallSink | None:
    for processor in processors or ():
        exporter = processor_exporter(processor)
        if exporter is not None and isinstance(exporter, CallSink):
            return exporter
    return None


class SinkLookup:
    """The sink of a tracer provider set (or given its exporter) after the middleware was built: looked
    for again on each call until found, then kept. Looking again costs two attribute reads and an identity
    test while nothing changed: the SDK gives its processors a new tuple whenever one is added, and the
    global provider is set once. ``tracer_provider`` ``None`` means the global one."""

    __slots__ = ("_processors", "_provider", "_seen", "sink")

    def __init__(self, tracer_provider: trace.TracerProvider | None) -> None:
        self._provider = tracer_provider
        self._seen: object = None  # the provider looked at last
        self._processors: object = None  # and its processors then
        self.sink: CallSink | None = None

    def find(self) -> CallSink | None:
        """The sink, once a processor of the provider wraps one; ``None`` until then."""
        if self.sink is not None:
            return self.sink
        provider = self._provider if self._provider is not None else trace.get_tracer_provider()
        processors = span_processors(provider)
        if provider is self._seen and processors is self._processors:
            return None
        self._seen, self._processors = provider, processors
        self.sink = _sink_among(processors)
        return self.sink
