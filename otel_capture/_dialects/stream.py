"""Shared pieces of stream reassembly: the accumulator interface, its fail-safe shell, the JSON helpers
the dialect accumulators (:mod:`.responses`, :mod:`.chat`, :mod:`.messages`, :mod:`.completions`) use, and
the chunk handling Chat Completions and the legacy Completions share (:class:`_ChoicesAccumulator`).

See :mod:`otel_capture._dialects.reassembly` for the rules every accumulator follows.
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

import orjson
from pydantic_core import from_json

from .sse import SSEEvent

__all__ = ["JsonDict", "StreamAccumulator", "TerminalKind", "loads_nonstandard"]

_logger = logging.getLogger(__name__)

TerminalKind = Literal["completed", "incomplete", "failed", "error"]
JsonDict = dict[str, Any]

_ChoiceT = TypeVar("_ChoiceT")


class StreamAccumulator(Protocol):
    """One streamed call's reassembly: events in, the non-streaming response object out."""

    terminal: TerminalKind | None
    error: JsonDict | None
    internal_errors: int  # events skipped because reassembly itself failed (a bug, logged at DEBUG)

    def add(self, event: SSEEvent) -> bool: ...

    def add_data(self, datas: list[str]) -> None: ...

    def result(self) -> JsonDict | None: ...


_NONSTANDARD = ("NaN", "Infinity")


def loads_nonstandard(data: str | bytes) -> Any:
    """A JSON text that strict JSON (orjson) refused, read again allowing ``NaN``, ``Infinity`` and
    ``-Infinity`` (what Python's ``json.dumps`` writes for a NaN or infinite float, e.g. a log-prob):
    the value with those as floats, or ``None`` when it does not contain them or is still not JSON. The
    caller writes them back as ``null`` (orjson does), never the text ``NaN`` that no JSON reader takes
    (``docs/tokens.md``, "Odd entries")."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    if not any(word in text for word in _NONSTANDARD):
        return None
    try:
        return json.loads(text, parse_int=_int64)
    except (ValueError, RecursionError):
        return None


def _int64(digits: str) -> int | float:
    """An integer as orjson reads it: past 64 bits a float (which orjson can write back; a larger int it
    cannot, and the record line would fail)."""
    value = int(digits)
    return value if -(2**63) <= value < 2**64 else float(value)


def _loads(data: str) -> JsonDict | None:
    try:
        obj = orjson.loads(data)
    except ValueError:  # orjson.JSONDecodeError, and surrogates that are not valid UTF-8
        obj = loads_nonstandard(data)
    return obj if isinstance(obj, dict) else None


def close_cut_json(raw: str | bytes) -> bytes | None:
    """A JSON text cut at a size cap, closed where it was cut: the unfinished string keeps what it had
    (``{"delta": {"content": "abc`` gives ``{"delta": {"content": "abc"}}``), open arrays and objects
    are closed, a value cut before it could be read is dropped. ``None`` when it does not begin as JSON.
    jiter's partial parse (in pydantic-core, which the Messages accumulator already uses for cut tool
    input) does it; an older pydantic-core without ``trailing-strings`` drops the unfinished string."""
    text = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    try:
        try:
            value = from_json(text, allow_partial="trailing-strings")
        except TypeError:  # pydantic-core before 2.22
            value = from_json(text, allow_partial=True)
    except ValueError:
        return None
    return orjson.dumps(value)


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

    def add_data(self, datas: list[str]) -> None:
        """Feed the data of events without an ``event:`` name, in order (the deferred reassembly's batch);
        what each carried is not told. An accumulator may read the usual shape faster here."""
        event = SSEEvent(None, "")  # one event object carries each event's data in turn: add never keeps it
        add = self.add
        for event.data in datas:
            add(event)

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
        tail = text.tail  # _Text.add, inlined: this runs for nearly every event of a stream
        tail.append(piece)
        if len(tail) >= _Text._GROUP:
            text.groups.append("".join(tail))
            tail.clear()

    def _set(self, container: JsonDict, key: str, value: object) -> None:
        """``container[key] = value``, replacing any streamed pieces of that field."""
        self._texts.pop((id(container), key), None)
        container[key] = value

    def _chunk_payload(self, event: SSEEvent) -> JsonDict | None:
        """An OpenAI-style chunk's JSON object (Chat Completions, the legacy Completions, vLLM's and
        SGLang's generate), ``None`` for anything else: ``data: [DONE]`` completes the stream, and an
        ``error`` key or an ``event: error`` ends it as ``"error"``, the error kept."""
        data = event.data
        if len(data) < 16 and data.strip() == "[DONE]":
            self._finish("completed")
            return None
        payload = _loads(data)
        if payload is None:
            return None
        error = payload.get("error")
        if error is not None or event.event == "error":
            self._finish("error")
            self._record_error(error if error is not None else payload)
        return payload

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


# top-level keys of an OpenAI chunk whose latest non-null value wins (for the others, the first non-null)
_LATEST_TOP = frozenset({"system_fingerprint", "service_tier"})


class _ChoicesAccumulator(_Accumulator, Generic[_ChoiceT]):
    """An OpenAI chunk stream (Chat Completions, the legacy Completions): ``data: [DONE]`` completes it,
    an ``error`` (or an ``event: error``) ends it as ``"error"``, the top-level keys but ``_SKIPPED_TOP`` are
    kept (the first non-null value, the latest for :data:`_LATEST_TOP`), the last ``usage`` wins, and each
    ``choices[i]`` goes to :meth:`_add_choice`, which keeps that choice's state in ``_choices``. The result
    is an ``_OBJECT`` object whose choices :meth:`_choice_result` builds."""

    _OBJECT: ClassVar[str]
    _SKIPPED_TOP: ClassVar[frozenset[str]]
    # What a chunk ending the stream contains (.deferred): ``data: [DONE]``, an ``error`` (key or event
    # name), or a JSON escape (through which the key could be spelled)
    TERMINAL_MARKERS: ClassVar[tuple[bytes, ...]] = (b"[DONE]", b"error", b"\\u")

    def __init__(self) -> None:
        super().__init__()
        self._top: JsonDict = {}
        self._choices: dict[int, _ChoiceT] = {}
        self._usage: object = None
        self._seen = False
        # read on every event: an instance attribute is a faster load than a class one (CPython 3.11)
        self._skipped_top = self._SKIPPED_TOP
        # top-level keys a later chunk cannot change: skipped, or holding their first non-null value (the
        # latest-wins ones are then only looked up): most chunks have no other key, and skip the walk
        self._settled_top: set[str] = set(self._SKIPPED_TOP)

    def _add(self, event: SSEEvent) -> bool:
        payload = self._chunk_payload(event)
        if payload is None:
            return False
        self._seen = True
        top = self._top
        if self._settled_top.issuperset(payload):
            for key in _LATEST_TOP:
                value = payload.get(key)
                if value is not None:
                    top[key] = value
        else:
            self._add_top(payload)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        choices = payload.get("choices")
        if isinstance(choices, list):
            carried = False
            for choice in choices:
                if isinstance(choice, dict) and self._add_choice(choice):
                    carried = True
            return carried
        if "choices" not in payload:
            self._add_without_choices(payload)
        return False

    def _add_top(self, payload: JsonDict) -> None:
        top = self._top
        skipped = self._skipped_top
        settled = self._settled_top
        for key, value in payload.items():
            if key in skipped:
                continue
            if top.get(key) is None or (key in _LATEST_TOP and value is not None):
                top[key] = value
            if top[key] is not None:
                settled.add(key)

    def _add_choice(self, choice: JsonDict) -> bool:
        """Merge one ``choices[i]`` into its state; True if it carried model output."""
        raise NotImplementedError

    def _add_without_choices(self, payload: JsonDict) -> None:
        """A payload with no ``choices`` key at all (after its top-level keys, error and usage were kept)."""

    def _result(self) -> JsonDict | None:
        if not self._seen:
            return None
        top = self._top
        result: JsonDict = {
            "id": top.get("id"),
            "object": self._OBJECT,
            "created": top.get("created"),
            "model": top.get("model"),
        }
        for key, value in top.items():
            result.setdefault(key, value)
        choices = self._choices
        result["choices"] = [self._choice_result(index, choices[index]) for index in sorted(choices)]
        if self._usage is not None:
            result["usage"] = self._usage
        return result

    def _choice_result(self, index: int, state: _ChoiceT) -> JsonDict:
        raise NotImplementedError
