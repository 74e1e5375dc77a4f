"""A captured stream's reassembly, done when it is needed rather than event by event as the stream passes.

The capture needs three things from each chunk of a stream while it flows: the bytes (kept by the caller),
the time of the first event that carries model output (``latency_ttft_ms``), and whether the dialect's
terminal event has arrived (the middleware holds that chunk until the record is durable). So
:class:`StreamReassembly` decodes and accumulates eagerly only until the first event with model output,
then keeps the chunks (the caller's own bytes objects, not a copy) and feeds them to the same decoder and
accumulator at once, when one of them may hold the terminal event or when the stream ends. Until then a
stream passing through costs one copy of its bytes (the record's), not a second, parsed one as well: what a
slow client's call holds is halved (contract D45). The decoder and the accumulator see the same bytes in
the same order either way, so the reassembled answer does not depend on when they were fed (the decoder's
result does not depend on how its input is chunked).

Whether a chunk may hold the terminal event is told from its bytes: it contains one of the accumulator's
``TERMINAL_MARKERS`` (``[DONE]``, ``error``, ``response.completed``, ``message_stop``, ... and ``\\u``, the
start of any JSON escape, through which a server could spell a type name), also across the boundary with the
previous chunk. Every way a terminal event can be written contains one of them, in its ``event:`` line or
its JSON; a marker that is only in the text (the word "error") costs a feed that would happen anyway. After
a feed, while the decoder still holds an undispatched event with a marker in what it holds, the next chunk
is fed at once too (the event may be completed by its blank line alone); one without is not (a chunk cut in
the middle of an event, as a proxy relays them, does not make the next one wait less).

The reassembly is bounded by the body cap (``OTEL_CAPTURE_MAX_BODY_BYTES``): events are accumulated while
their data adds up to at most the cap (an event over the cap alone is cut there, its JSON closed, contract
D36); after that, an event that carries model output is counted out (``truncated``) and only the others
(finish reasons, usage, the terminal event, an error) are kept, so a stream of any length reassembles into
at most about the cap, and still says how it ended. Past the cap the chunks are fed as they come (nothing
is kept for later).
"""

from __future__ import annotations

from collections.abc import Callable

from .sse import SSEDecoder, SSEEvent
from .stream import StreamAccumulator, close_cut_json

__all__ = ["StreamReassembly"]

# What is decoded at once when kept chunks are fed (measured in bench_hotpath and on 64 KiB pieces)
_BATCH = 256 * 1024
_MARKERS: dict[object, tuple[tuple[tuple[bytes, bytes], ...], int]] = {}


def _prefilter(marker: bytes) -> bytes:
    """The byte looked for first (``bytes.find`` of one byte is a ``memchr``, ~50x faster than CPython's
    search for a longer needle): a backslash or a capital (rare in a stream's JSON) when the marker has
    one, else the whole marker."""
    for byte in marker:
        if byte == 0x5C or 0x41 <= byte <= 0x5A:
            return bytes((byte,))
    return marker


def _markers_of(make: Callable[[], StreamAccumulator]) -> tuple[tuple[tuple[bytes, bytes], ...], int]:
    """An accumulator class's terminal markers, each with the byte looked for first, and the longest
    one's length less one, once per class."""
    found = _MARKERS.get(make)
    if found is None:
        markers: tuple[bytes, ...] = getattr(make, "TERMINAL_MARKERS", None) or ()
        found = _MARKERS[make] = (
            tuple((_prefilter(m), m) for m in markers),
            max((len(m) for m in markers), default=1) - 1,
        )
    return found


class StreamReassembly:
    """One stream's decoder and accumulator, fed eagerly until the first model output, then in batches.

    ``make`` builds the dialect's accumulator (its class); its ``TERMINAL_MARKERS`` (bytes) say what a
    chunk holding the terminal event must contain; without them every chunk is fed as it comes."""

    __slots__ = (
        "_armed",
        "_budget",
        "_decoder",
        "_eager",
        "_last",
        "_make",
        "_markers",
        "_max_bytes",
        "_overlap",
        "_pending",
        "_pending_size",
        "_unsure",
        "_whole",
        "accumulator",
        "truncated",
    )

    def __init__(self, make: Callable[[], StreamAccumulator], max_bytes: int) -> None:
        self._make = make
        self.accumulator = make()
        self._decoder = SSEDecoder(max_bytes, keep_cut=True)  # an event over the cap: cut there
        self._max_bytes = max_bytes
        self._markers, self._overlap = _markers_of(make)
        self._whole = bool(self._markers)  # the chunks may wait: a terminal event is told from their bytes
        self._eager = True  # until the first event with model output (its time is the time to first token)
        self._armed = False  # a marker was fed and its event is not yet dispatched: feed the next chunk
        self._unsure = False  # a chunk was fed without a look for markers: armed if mid-event
        self._last = b""  # the previous chunk's last bytes, for a marker cut between two chunks
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._budget = max_bytes  # event data the accumulator still takes in full
        self.truncated = False  # an event was cut at the cap, or model output past the cap left out

    def feed(self, chunk: bytes) -> bool:
        """One chunk of the stream; True when it completed the first event that carries model output
        (only looked for until then). ``accumulator.terminal`` is up to date after each call."""
        if not chunk:
            return False
        if self._eager or not self._whole:
            if self._pending:
                self._flush()
            carried = self._dispatch(self._decoder.feed(chunk))
            if self._whole:
                if carried:
                    self._eager = False
                # an event the decoder still holds may be the terminal one, its marker not looked for: the
                # next scanned chunk is fed if a marker is in what the decoder holds (the edge is kept too)
                self._armed, self._unsure = False, True
                self._last = b""
                self._keep_edge(chunk)
            return carried
        # does it hold a terminal marker? (inlined: this and the append are all a chunk costs here)
        hit = False
        for first, marker in self._markers:
            # not ``in``: that first tries the needle as an integer, 2x the cost
            if chunk.find(first) >= 0 and (first is marker or chunk.find(marker) >= 0):
                hit = True
                break
        if self._last or chunk[-1] not in (0x0A, 0x0D):  # a marker may be cut by a chunk boundary
            hit = self._at_edge(chunk) or hit
        if self._pending_size + len(chunk) > self._max_bytes:
            # past the cap: nothing is kept for later, every chunk is fed as it comes
            self._flush()
            self._whole = False
            self._dispatch(self._decoder.feed(chunk))
            return False
        self._pending.append(chunk)
        self._pending_size += len(chunk)
        if self._unsure:
            self._unsure = False
            self._armed = self._armed or self._held_marker()
        if hit or self._armed:
            self._flush()
            self._armed = self._held_marker()
        return False

    def close(self) -> StreamAccumulator:
        """The end of the stream: everything still held is fed, the decoder's last event too."""
        self._flush()
        self._dispatch(self._decoder.close())
        return self.accumulator

    # -- internals ----------------------------------------------------------------------------------

    def _at_edge(self, chunk: bytes) -> bool:
        """Whether a marker lies across the boundary between ``chunk`` and the stream before it."""
        last = self._last
        self._keep_edge(chunk)
        if not last:
            return False
        edge = last + chunk[: self._overlap]
        return any(edge.find(marker) >= 0 for _, marker in self._markers)

    def _held_marker(self) -> bool:
        """Whether the event the decoder still holds (not yet dispatched) has a marker: then the next
        chunk is fed at once, as it may complete that event (by its blank line alone)."""
        held = self._decoder.held()
        if held is None:
            return True
        return bool(held) and any(held.find(marker) >= 0 for _, marker in self._markers)

    def _keep_edge(self, chunk: bytes) -> None:
        """The stream's last bytes, where a marker cut by the next chunk begins (none after a line end:
        no marker holds one)."""
        if chunk[-1] in (0x0A, 0x0D):
            self._last = b""
        elif len(chunk) >= self._overlap:
            self._last = chunk[-self._overlap :]
        else:
            self._last = (self._last + chunk)[-self._overlap :]

    def _flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        self._pending_size = 0
        if len(pending) == 1:
            self._feed_data(pending[0])
            return
        # joined a batch at a time: one join of a whole long stream costs more (a copy out of the caches)
        group: list[bytes] = []
        size = 0
        for chunk in pending:
            group.append(chunk)
            size += len(chunk)
            if size >= _BATCH:
                self._feed_data(b"".join(group))
                group.clear()
                size = 0
        if group:
            self._feed_data(b"".join(group))

    def _feed_data(self, data: bytes) -> None:
        decoder = self._decoder
        if data[-2:] == b"\n\n" and decoder.at_event_boundary:
            self._feed_whole(data)
            return
        # chunks cut in the middle of events (a proxy relays pieces of 64 KiB): the event begun before them
        # and the one they end in go through the decoder line by line, the whole events between at once
        start = 0
        if not decoder.at_event_boundary:
            start = data.find(b"\n\n") + 2
            if start == 1:
                self._dispatch(decoder.feed(data))
                return
            self._dispatch(decoder.feed(data[:start]))
        end = data.rfind(b"\n\n") + 2
        if end > start:
            self._feed_whole(data[start:end] if start or end < len(data) else data)
        if end < len(data):
            self._dispatch(decoder.feed(data[max(start, end) :]))

    def _feed_whole(self, data: bytes) -> None:
        """Whole events: the decoder's fast path when they are what model servers send."""
        whole = self._decoder.whole_data(data)
        if whole is None:
            self._dispatch(self._decoder.feed(data))
            return
        # the usual shape (only ``data:`` lines): read in one call while the cap is not reached
        size = sum(map(len, whole))
        if size < self._budget:
            self._budget -= size
            self.accumulator.add_data(whole)
            return
        event = SSEEvent(None, "")  # one event object carries each event's data in turn (never kept)
        add = self.accumulator.add
        for event.data in whole:
            if self._budget > 0:
                self._budget -= len(event.data)
                add(event)
            else:
                self._past_cap(event)

    def _dispatch(self, events: list[SSEEvent]) -> bool:
        carried = False
        add = self.accumulator.add
        for event in events:
            if event.cut:  # over the cap alone: its first max_bytes, the JSON closed there (contract D36)
                self.truncated = True
                closed = close_cut_json(event.data)
                if closed is not None:
                    event.data = closed.decode()
            if self._budget > 0:
                self._budget -= len(event.data)
                if add(event):
                    carried = True
            elif self._past_cap(event):
                carried = True
        return carried

    def _past_cap(self, event: SSEEvent) -> bool:
        """An event after the cap was reached: kept when it carries no model output (a finish reason,
        usage, the end); else left out, its terminal kind and error still taken."""
        probe = self._make()  # read this event alone: what it carries, how it ends the stream
        if not probe.add(event):
            self.accumulator.add(event)
            return False
        self.truncated = True
        accumulator = self.accumulator
        if accumulator.terminal is None and probe.terminal is not None:
            accumulator.terminal = probe.terminal
        if accumulator.error is None and probe.error is not None:
            accumulator.error = probe.error
        return True
