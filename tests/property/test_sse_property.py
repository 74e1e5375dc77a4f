"""Properties of SSE decoding and reassembly: chunking never matters, nothing raises, memory stays bounded."""

from __future__ import annotations

import itertools
import re
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_capture._dialects.reassembly import accumulator_for
from otel_capture._dialects.sse import SSEDecoder, SSEEvent

# Pieces that make SSE-like byte strings dense in the interesting cases: every line ending, fields, comments,
# a byte-order mark, multi-byte and invalid UTF-8, and long runs that cross a small line cap.
_PIECES = [
    b"data:",
    b"data: ",
    b"event: ",
    b"event:x",
    b"id: 1",
    b"retry: 5",
    b":",
    b": keep-alive",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b" ",
    b"a",
    b"{}",
    b"[DONE]",
    b"\xef\xbb\xbf",
    b"\xc3\xa9",
    b"\xc3",
    b"\xe2\x82",
    b"\xac",
    b"\xf0\x9f\x98\x80",
    b"\xff",
    b"x" * 40,
]
sse_bytes = st.one_of(st.binary(max_size=400), st.lists(st.sampled_from(_PIECES), max_size=80).map(b"".join))
caps = st.sampled_from([1, 5, 16, 64, 1 << 24])


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def _decode(chunks: list[bytes], cap: int) -> tuple[list[SSEEvent], int]:
    decoder = SSEDecoder(max_line_bytes=cap)
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    events += decoder.close()
    return events, decoder.dropped_bytes


def _reference(data: bytes, cap: int) -> list[SSEEvent]:
    """A plain reading of the WHATWG rules on the whole body, with the same cap and end-of-stream rule."""
    lines = re.split(rb"\r\n|\r|\n", data)
    events: list[SSEEvent] = []
    buffer: list[str] = []
    name, size, overflow = None, 0, False
    for number, raw in enumerate(lines):
        if number == len(lines) - 1 and raw == b"":
            break  # the body ended with a line ending
        if len(raw) > cap:
            continue
        line = raw.decode("utf-8", "replace")
        if number == 0 and line.startswith("\ufeff"):
            line = line[1:]
            if not line:
                continue
        if line == "":
            if buffer:
                events.append(SSEEvent(name, "\n".join(buffer)))
            name, buffer, size, overflow = None, [], 0, False
        elif line[0] != ":":
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value or None
            elif field == "data" and not overflow:
                size += len(raw)
                if size > cap:
                    buffer, overflow = [], True
                else:
                    buffer.append(value)
    if buffer:
        events.append(SSEEvent(name, "\n".join(buffer)))
    return events


@given(data=sse_bytes, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=30), cap=caps)
def test_chunking_never_changes_the_events(data: bytes, cuts: list[int], cap: int) -> None:
    whole = _decode([data], cap)
    assert _decode(_split(data, cuts), cap) == whole
    assert _decode([data[i : i + 1] for i in range(len(data))], cap) == whole


@given(data=sse_bytes, cap=caps)
def test_decoding_follows_the_spec(data: bytes, cap: int) -> None:
    assert _decode([data], cap)[0] == _reference(data, cap)


@given(chunks=st.lists(sse_bytes, max_size=20), cap=st.sampled_from([1, 5, 16, 64]))
def test_memory_stays_bounded(chunks: list[bytes], cap: int) -> None:
    decoder = SSEDecoder(max_line_bytes=cap)
    for chunk in chunks:
        decoder.feed(chunk)
        assert decoder.pending_bytes <= 2 * cap  # the incomplete line, and the pending event's data
    # A raw byte decodes to at most one character.
    assert all(len(event.data) <= cap for event in decoder.close())


def test_a_huge_line_streamed_in_small_chunks_is_not_kept() -> None:
    decoder = SSEDecoder(max_line_bytes=1024)
    decoder.feed(b"data: ")
    for _ in range(10_000):
        decoder.feed(b"y" * 1000)
        assert decoder.pending_bytes <= 1024
    assert decoder.feed(b"\n\ndata: ok\n\n") == [SSEEvent(None, "ok")]
    assert decoder.dropped_bytes == 6 + 10_000_000


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=2000))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    events, _ = _decode([data], 64)
    for dialect in ("chat", "responses", "messages"):
        accumulator = accumulator_for(dialect)
        for event in events:
            accumulator.add(event)
        accumulator.result()
        assert accumulator.internal_errors == 0


# Structured payloads: the right `type` values with fields of any JSON type, to reach every branch.
_TYPES = [
    "response.created",
    "response.in_progress",
    "response.completed",
    "response.incomplete",
    "response.failed",
    "error",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
    "response.output_text.delta",
    "response.output_text.done",
    "response.refusal.delta",
    "response.reasoning_text.delta",
    "response.reasoning_summary_text.delta",
    "response.reasoning_summary_part.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_text.annotation.added",
    "response.custom_tool_call_input.delta",
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "ping",
    "text_delta",
    "input_json_delta",
    "thinking_delta",
    "signature_delta",
    "citations_delta",
    "compaction_delta",
    "fallback",
    "tool_use",
    "message",
    "function_call",
    "reasoning",
    "output_text",
]
_KEYS = [
    "type",
    "response",
    "item",
    "output_index",
    "content_index",
    "summary_index",
    "item_id",
    "delta",
    "text",
    "arguments",
    "part",
    "annotation",
    "logprobs",
    "error",
    "code",
    "message",
    "index",
    "content_block",
    "partial_json",
    "thinking",
    "signature",
    "citation",
    "usage",
    "stop_reason",
    "choices",
    "id",
    "model",
    "finish_reason",
    "tool_calls",
    "function",
    "name",
    "content",
    "refusal",
    "reasoning_content",
    "role",
    "output",
    "to",
    "summary",
]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.sampled_from(_TYPES),
)
_json: Any = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.sampled_from(_KEYS), children, max_size=6)
    ),
    max_leaves=25,
)
_payloads = st.dictionaries(st.sampled_from(_KEYS), _json, max_size=8)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(payloads=st.lists(st.tuples(st.sampled_from([None, "error", *_TYPES[:6]]), _payloads), max_size=25))
def test_structured_garbage_never_raises(payloads: list[tuple[str | None, dict[str, Any]]]) -> None:
    events = [SSEEvent(name, orjson.dumps(payload).decode()) for name, payload in payloads]
    events.append(SSEEvent(None, "[DONE]"))
    for dialect in ("chat", "responses", "messages"):
        accumulator = accumulator_for(dialect)
        for event in events:
            assert accumulator.add(event) in (True, False)
        result = accumulator.result()
        assert accumulator.internal_errors == 0, dialect
        assert result is None or isinstance(orjson.dumps(result), bytes)


# -- deferred reassembly (otel_capture._dialects.deferred) ---------------------------------------------

_SPELLINGS = ["error", "message_stop", "response.completed", "response.incomplete", "response.failed", "stop"]


def _spelled(text: str, escape: bool, spaced: bool) -> str:
    """A payload's JSON as servers write it: with spaces after separators, and with the terminal names and
    keys spelled through a JSON escape (``"\\u0065rror"``), which a server may do."""
    if spaced:
        text = text.replace('":', '": ').replace(',"', ', "')
    if escape:
        for name in _SPELLINGS:
            text = text.replace(f'"{name}"', f'"\\u{ord(name[0]):04x}{name[1:]}"')
    return text


_ENDINGS: list[tuple[str | None, dict[str, Any]]] = [
    ("response.completed", {"type": "response.completed", "response": {"output": []}}),
    ("response.incomplete", {"type": "response.incomplete", "response": {}}),
    ("response.failed", {"type": "response.failed", "response": {"error": {"code": "x"}}}),
    ("error", {"type": "error", "error": {"message": "x"}}),
    ("message_stop", {"type": "message_stop"}),
    (None, {"error": {"message": "x"}}),
    ("error", {"message": "x"}),
    (None, {"content": "", "stop": True}),
]
_OUTPUT = [
    {"choices": [{"index": 0, "delta": {"content": "a"}, "text": "a"}]},
    {"type": "response.output_text.delta", "delta": "a"},
    {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}},
]


def _eager(make: Any, chunks: list[bytes]) -> tuple[Any, int | None, int | None]:
    """What the capture did before the reassembly was deferred: every chunk decoded and accumulated as it
    came. ``(accumulator, chunk of the first model output, chunk of the terminal event)``."""
    decoder = SSEDecoder(1 << 24, keep_cut=True)
    accumulator = make()
    first = terminal = None
    for i, chunk in enumerate(chunks):
        for event in decoder.feed(chunk):
            if accumulator.add(event) and first is None:
                first = i
        if terminal is None and accumulator.terminal is not None:
            terminal = i
    for event in decoder.close():
        accumulator.add(event)
    return accumulator, first, terminal


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(
    payloads=st.lists(
        st.tuples(st.sampled_from([None, "error", *_TYPES[:6], "message_stop"]), _payloads), max_size=20
    ),
    done=st.booleans(),
    ending=st.sampled_from([None, *range(8)]),
    at=st.integers(min_value=0, max_value=20),
    named=st.booleans(),
    escape=st.booleans(),
    spaced=st.booleans(),
    crlf=st.booleans(),
    by_event=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=6000), max_size=40),
)
def test_the_deferred_reassembly_is_the_eager_one_whatever_the_chunking_and_spelling(
    payloads: list[tuple[str | None, dict[str, Any]]],
    done: bool,
    ending: int | None,
    at: int,
    named: bool,
    escape: bool,
    spaced: bool,
    crlf: bool,
    by_event: bool,
    cuts: list[int],
) -> None:
    """The answer, the terminal event and its error, the chunk the terminal event completes (the one the
    middleware holds) and the chunk of the first model output (the time to first token) are what decoding
    every chunk as it came gave, for every dialect, however the stream is cut and spelled (``event:`` lines
    or not, JSON spacing, names spelled through escapes, CRLF)."""
    from otel_capture._dialects.deferred import StreamReassembly
    from otel_capture._dialects.table import DIALECTS

    # each dialect's model output first: the reassembly is deferred from there on
    lines = [f"data: {orjson.dumps(first).decode()}\n\n" for first in _OUTPUT]
    if ending is not None:  # a terminal event of some dialect, somewhere in the stream
        payloads = [*payloads[:at], _ENDINGS[ending], *payloads[at:]]
    for name, payload in payloads:
        head = f"event: {name}\n" if named and name is not None else ""
        body = _spelled(orjson.dumps(payload).decode(), escape, spaced)
        lines.append(f"{head}data: {body}\n\n")
    if done:
        lines.append("data: [DONE]\n\n")
    if by_event:  # one event per chunk, as servers flush them, then some cut further
        pieces = [line.encode() for line in lines]
        chunks = [c for piece in pieces for c in _split(piece, cuts[:1]) if c]
    else:
        chunks = [c for c in _split("".join(lines).encode(), cuts) if c]
    if crlf:
        chunks = [c.replace(b"\n", b"\r\n") for c in chunks]
    for dialect, spec in DIALECTS.items():
        reference, first, terminal = _eager(spec.accumulator, chunks)
        reassembly = StreamReassembly(spec.accumulator, 1 << 24)
        got_first = got_terminal = None
        for i, chunk in enumerate(chunks):
            if reassembly.feed(chunk) and got_first is None:
                got_first = i
            if got_terminal is None and reassembly.accumulator.terminal is not None:
                got_terminal = i
        accumulator = reassembly.close()
        assert (got_first, got_terminal) == (first, terminal), dialect
        assert orjson.dumps(accumulator.result()) == orjson.dumps(reference.result()), dialect
        assert (accumulator.terminal, accumulator.error) == (reference.terminal, reference.error), dialect
        assert not reassembly.truncated
