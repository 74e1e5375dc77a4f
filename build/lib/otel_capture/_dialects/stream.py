"""Shared pieces of stream reassembly: the accumulator interface, its fail-safe shell and the JSON
helpers the three dialect accumulators (:mod:`.responses`, :mod:`.chat`, :mod:`.messages`) use.

See :mod:`otel_capture._dialects.reassembly` for the rules every accumulator follows.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol

import orjson

from .sse import SSEEvent

__all__ = ["JsonDict", "StreamAccumulator", "TerminalKind"]

_logger = logging.getLogger(__name__)

TerminalKind = Literal["completed", "incomplete", "failed", "error"]
JsonDict = dict[str, Any]


class StreamAccumulator(Protocol):
    """One streamed call's reassembly: events in, the non-streaming response object out."""

    terminal: TerminalKind | None
    error: JsonDict | None
    internal_errors: int  # events skipped because reassembly itself failed (a bug, logged at DEBUG)

    def add(self, event: SSEEvent) -> bool: ...

    def result(self) -> JsonDict | None: ...


def _loads(data: str) -> JsonDict | None:
    try:
        obj = orjson.loads(data)
    except ValueError:  # orjson.JSONDecodeError, and surrogates that are not valid UTF-8
        return None
    return obj if isinstance(obj, dict) else None


def _event_type(payload: JsonDict, event: SSEEvent) -> str | None:
    kind = payload.get("type")
    return kind if isinstance(kind, str) else event.event


class _Text:
    """One text field being streamed, kept as pieces: ``str + str`` copies the whole text on every delta,
    which made a long stream quadratic (minutes of event-loop time for a 50 MB stream). Pieces are joined
    in groups, so every character is copied about twice, and written back when the result is read."""

    __slots__ = ("container", "groups", "key", "tail")

    _GROUP = 256

    def __init__(self, container: JsonDict, key: str) -> None:
        self.container = container
        self.key = key
        old = container.get(key)
        self.groups: list[str] = [old] if isinstance(old, str) and old else []
        self.tail: list[str] = []

    def add(self, piece: str) -> None:
        tail = self.tail
        tail.append(piece)
        if len(tail) >= self._GROUP:
            self.groups.append("".join(tail))
            tail.clear()

    def write_back(self) -> None:
        if self.tail:
            self.groups.append("".join(self.tail))
            self.tail.clear()
        if len(self.groups) > 1:
            self.groups[:] = ["".join(self.groups)]
        self.container[self.key] = self.groups[0] if self.groups else ""


def _merge(old: object, new: object) -> object:
    """Merge a delta value of a field we do not know: strings append, dicts merge, lists extend."""
    if new is None:
        return old
    if isinstance(old, str) and isinstance(new, str):
        return old + new
    if isinstance(old, dict) and isinstance(new, dict):
        merged = dict(old)
        for key, value in new.items():
            merged[key] = _merge(merged.get(key), value)
        return merged
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    return new


def _as_error(value: object) -> JsonDict:
    return value if isinstance(value, dict) else {"message": str(value)}


class _Accumulator:
    """The fail-safe shell: ``add``/``result`` never raise; subclasses implement ``_add``/``_result``."""

    def __init__(self) -> None:
        self.terminal: TerminalKind | None = None
        self.error: JsonDict | None = None
        self.internal_errors = 0
        self._texts: dict[tuple[int, str], _Text] = {}  # (id(container), key) -> its streamed text

    def add(self, event: SSEEvent) -> bool:
        """Feed one event; True if it carried model output (for time to first chunk)."""
        try:
            return self._add(event)
        except Exception:  # telemetry never breaks the host app; the tests assert this stays at 0
            self.internal_errors += 1
            _logger.debug("skipped a stream event that could not be reassembled", exc_info=True)
            return False

    def result(self) -> JsonDict | None:
        """The reassembled response so far; None when nothing usable arrived."""
        try:
            for text in self._texts.values():
                text.write_back()
            return self._result()
        except Exception:
            self.internal_errors += 1
            _logger.debug("could not build the reassembled response", exc_info=True)
            return None

    def _append(self, container: JsonDict, key: str, piece: str) -> None:
        """``container[key] += piece`` (a missing or non-string value counts as ``""``), in time linear in
        the piece; ``container[key]`` is brought up to date by :meth:`result`."""
        slot = (id(container), key)  # the _Text holds the container, so its id is not reused meanwhile
        text = self._texts.get(slot)
        if text is None:
            text = self._texts[slot] = _Text(container, key)
        text.add(piece)

    def _set(self, container: JsonDict, key: str, value: object) -> None:
        """``container[key] = value``, replacing any streamed pieces of that field."""
        self._texts.pop((id(container), key), None)
        container[key] = value

    def _finish(self, kind: TerminalKind) -> None:
        if self.terminal is None:
            self.terminal = kind

    def _record_error(self, value: object) -> None:
        if self.error is None and value is not None:
            self.error = _as_error(value)

    def _add(self, event: SSEEvent) -> bool:
        raise NotImplementedError

    def _result(self) -> JsonDict | None:
        raise NotImplementedError
