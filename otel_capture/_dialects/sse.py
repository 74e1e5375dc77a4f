"""Incremental Server-Sent Events decoder: bytes in, :class:`SSEEvent` out.

It follows the WHATWG event-stream parsing rules that matter for model APIs:

- a line ends in CRLF, LF or CR; a CRLF split across two chunks is one line end, not two;
- a blank line dispatches the event; an event with no ``data:`` field is dropped;
- ``data:`` lines are joined with ``"\\n"``; one space after the colon is removed;
- lines starting with ``:`` are comments (keep-alives) and are ignored, as are ``id``, ``retry`` and
  unknown fields; a UTF-8 byte-order mark at the very start of the stream is removed;
- bytes are decoded as UTF-8 with ``errors="replace"``, and only once a line is complete, so a
  multi-byte character split across chunks survives.

It differs from the spec in one place: when the stream ends without a final blank line, :meth:`close`
still returns the pending event (a server that forgets the last blank line has still sent it).

Memory is bounded by ``max_line_bytes``: a line longer than that (complete or not) is discarded and its
length added to :attr:`SSEDecoder.dropped_bytes`; so is the data of an event whose ``data:`` lines add up
to more than that. The result does not depend on how the bytes were chunked. With ``keep_cut=True`` (what
the capture uses) such a line or event is not dropped but cut: its first ``max_line_bytes`` are kept and
the event is dispatched with ``cut=True``, so a record shows what an oversized event began with.

It runs on every chunk of every captured stream, so it works per line with ``bytes.find``/``split``, never
per byte.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_LINE_BYTES", "SSEDecoder", "SSEEvent"]

DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024

_BOM = "\ufeff"


@dataclass(slots=True)
class SSEEvent:
    """One dispatched event: its ``event:`` name (``None`` if absent) and its data lines joined by LF."""

    event: str | None
    data: str
    cut: bool = False  # its data is only the first max_line_bytes of what was sent (keep_cut)


class SSEDecoder:
    """Feed it chunks as they arrive; it returns the events each chunk completed.

    Not thread-safe; one decoder per stream.
    """

    __slots__ = (
        "_data",
        "_data_size",
        "_discarding_line",
        "_event",
        "_event_cut",
        "_event_overflow",
        "_keep_cut",
        "_max_line_bytes",
        "_skip_lf",
        "_started",
        "_tail",
        "dropped_bytes",
    )

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, *, keep_cut: bool = False) -> None:
        if max_line_bytes < 1:
            raise ValueError("max_line_bytes must be at least 1")
        self._max_line_bytes = max_line_bytes
        self._keep_cut = keep_cut
        self._event_cut = False
        self.dropped_bytes = 0
        self._tail = bytearray()  # the incomplete last line, never longer than max_line_bytes
        self._skip_lf = False  # the previous chunk ended in CR: a leading LF completes that CRLF
        self._discarding_line = False  # the current line outgrew the cap; drop bytes up to its end
        self._started = False  # a line has been seen (for the byte-order mark)
        self._event: str | None = None
        self._data: list[str] = []
        self._data_size = 0
        self._event_overflow = False

    @property
    def at_event_boundary(self) -> bool:
        """Nothing of an event is held: no incomplete line, no undispatched data or event name."""
        return not (self._tail or self._data or self._discarding_line or self._event is not None)

    def held(self) -> bytes | None:
        """What is held of an event not yet dispatched: its name, data lines and incomplete last line,
        joined by line feeds (``b""`` at an event boundary); ``None`` while a line over the cap is being
        dropped (what it held is not known)."""
        if self._discarding_line:
            return None
        if self._event is None and not self._data:
            return bytes(self._tail)
        parts = [self._event or "", *self._data]
        return "\n".join(parts).encode("utf-8", "surrogatepass") + b"\n" + self._tail

    @property
    def pending_bytes(self) -> int:
        """Bytes held for the incomplete line and the undispatched event's data."""
        return len(self._tail) + self._data_size

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[SSEEvent]:
        """Decode one chunk; return the events it completed, in order."""
        if not chunk:
            return []
        if type(chunk) is not bytes:
            chunk = bytes(chunk)
        if (
            chunk[-2:] == b"\n\n"
            and chunk[:6] == b"data: "
            and self._started
            and not (self._tail or self._data or self._skip_lf or self._discarding_line)
            and self._event is None
            and b"\r" not in chunk
            and len(chunk) - 2 <= self._max_line_bytes
        ):
            end = chunk.find(b"\n", 6)
            if end == len(chunk) - 2:  # one event: the usual chunk
                return [SSEEvent(None, chunk[6:end].decode("utf-8", "replace"))]
            whole = self._whole_parts(chunk)
            if whole is not None:
                return [SSEEvent(None, data) for data in whole]
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
                if not chunk:
                    return []
        events: list[SSEEvent] = []
        if self._discarding_line:
            chunk = self._discard_to_line_end(chunk)
            if not self._discarding_line and self._tail:  # a cut line ended: its kept start is the line
                line = bytes(self._tail)
                self._tail.clear()
                self._process_line(line, events, cut=True)
            if not chunk:
                return events
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if end < 0:
            self._extend_tail(chunk)
            return events
        if chunk[end] == 0x0D and end == len(chunk) - 1:
            self._skip_lf = True
        if self._tail:
            complete = bytes(self._tail) + chunk[: end + 1]
            self._tail.clear()
        else:
            complete = chunk[: end + 1]
        self._process_lines(complete, events)
        rest = chunk[end + 1 :]
        if rest:
            self._extend_tail(rest)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: return the pending event, if it has data, and reset the decoder."""
        events: list[SSEEvent] = []
        if self._tail:  # kept only when whole, or cut (keep_cut)
            line = bytes(self._tail)
            self._tail.clear()
            self._process_line(line, events, cut=self._discarding_line)
        self._tail.clear()
        self._discarding_line = False
        self._skip_lf = False
        self._dispatch(events)
        return events

    # -- internals ----------------------------------------------------------------------------------

    def whole_data(self, chunk: bytes) -> list[str] | None:
        """The fast path for what model servers send: the data of the events in a chunk of whole
        ``data: <one line>`` events, each ending in a blank line, with nothing pending before it; each
        such event is exactly what the line-by-line rules give (no ``event:`` name, the line after
        ``data: `` as its data), and the decoder's state does not change. ``None`` when the chunk has any
        other shape or something is pending: :meth:`feed` it then."""
        if (
            chunk[-2:] != b"\n\n"
            or chunk[:6] != b"data: "
            or not self._started
            or self._tail
            or self._data
            or self._skip_lf
            or self._discarding_line
            or self._event is not None
            or len(chunk) - 2 > self._max_line_bytes
            or b"\r" in chunk
        ):
            return None
        return self._whole_parts(chunk)

    @staticmethod
    def _whole_parts(chunk: bytes) -> list[str] | None:
        """:meth:`whole_data` once the chunk's ends and the decoder's state are checked."""
        end = chunk.find(b"\n", 6)
        if end == len(chunk) - 2:  # one event: the usual chunk
            return [chunk[6:end].decode("utf-8", "replace")]
        # Many events (a stream's chunks fed at once): every line feed is one of the two that end an event
        # exactly when no part has one, and each event then is one ``data: `` line. The separators are
        # ASCII, so decoding the whole and then splitting gives what decoding each would (a line feed is
        # never part of an invalid sequence the decoding replaces). One look for a line feed in the parts
        # joined again is a memchr, a tenth of the cost of counting the chunk's line feeds.
        parts = chunk[6:-2].decode("utf-8", "replace").split("\n\ndata: ")
        if "\n" in "".join(parts):
            return None
        return parts

    def _extend_tail(self, part: bytes) -> None:
        if len(self._tail) + len(part) > self._max_line_bytes:
            if self._keep_cut:
                room = self._max_line_bytes - len(self._tail)
                self._tail += part[:room]
                self.dropped_bytes += len(part) - room
            else:
                self.dropped_bytes += len(self._tail) + len(part)
                self._tail.clear()
            self._discarding_line = True
        else:
            self._tail += part

    def _discard_to_line_end(self, chunk: bytes) -> bytes:
        """Drop the rest of an over-long line; return what follows its line end."""
        lf = chunk.find(b"\n")
        cr = chunk.find(b"\r")
        if lf < 0 and cr < 0:
            self.dropped_bytes += len(chunk)
            return b""
        end = cr if lf < 0 or (0 <= cr < lf) else lf
        self.dropped_bytes += end
        self._discarding_line = False
        if chunk[end] == 0x0D:
            if end + 1 < len(chunk):
                if chunk[end + 1] == 0x0A:
                    end += 1
            else:
                self._skip_lf = True
        return chunk[end + 1 :]

    def _process_lines(self, complete: bytes, events: list[SSEEvent]) -> None:
        """``complete`` ends with a line terminator; handle every line in it."""
        if b"\r" in complete:
            complete = complete.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = complete.split(b"\n")
        lines.pop()  # the empty string after the final terminator
        cap = self._max_line_bytes
        check = len(complete) > cap
        for line in lines:
            if check and len(line) > cap:
                if self._keep_cut:
                    self.dropped_bytes += len(line) - cap
                    self._process_line(line[:cap], events, cut=True)
                else:
                    self.dropped_bytes += len(line)
                continue
            self._process_line(line, events)

    def _process_line(self, raw: bytes, events: list[SSEEvent], cut: bool = False) -> None:
        if not raw:
            self._started = True
            self._dispatch(events)
            return
        line = raw.decode("utf-8", "replace")
        if not self._started:
            self._started = True
            if line.startswith(_BOM):
                line = line[1:]
                if not line:
                    return
        if line[0] == ":":
            return
        field, _, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if field == "data":
            self._add_data(value, len(raw), cut)
        elif field == "event":
            self._event = value or None

    def _add_data(self, value: str, raw_size: int, cut: bool = False) -> None:
        if self._event_overflow:
            self.dropped_bytes += raw_size
            return
        self._data_size += raw_size
        self._event_cut = self._event_cut or cut
        if self._data_size > self._max_line_bytes and self._keep_cut:
            room = max(self._max_line_bytes - (self._data_size - raw_size), 0)
            self.dropped_bytes += raw_size - room
            self._data.append(value[:room])
            self._data_size = self._max_line_bytes
            self._event_cut = self._event_overflow = True
            return
        if self._data_size > self._max_line_bytes:
            self.dropped_bytes += self._data_size
            self._data.clear()
            self._data_size = 0
            self._event_overflow = True
            return
        self._data.append(value)

    def _dispatch(self, events: list[SSEEvent]) -> None:
        if self._data:
            events.append(SSEEvent(self._event, "\n".join(self._data), self._event_cut))
        self._event_cut = False
        self._event = None
        self._data = []
        self._data_size = 0
        self._event_overflow = False
