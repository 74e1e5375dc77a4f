"""The SSE decoder against the event-stream rules a model client relies on."""

from __future__ import annotations

import pytest

from otel_capture._dialects.sse import DEFAULT_MAX_LINE_BYTES, SSEDecoder, SSEEvent


def decode(*chunks: bytes, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> list[SSEEvent]:
    decoder = SSEDecoder(max_line_bytes=max_line_bytes)
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    return events + decoder.close()


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def test_event_name_and_data() -> None:
    assert decode(b"event: message_start\ndata: {}\n\n") == [SSEEvent("message_start", "{}")]
    assert decode(b"data: {}\n\n") == [SSEEvent(None, "{}")]


def test_data_lines_are_joined_with_lf() -> None:
    assert decode(b"data: a\ndata: b\ndata:\ndata: c\n\n") == [SSEEvent(None, "a\nb\n\nc")]


def test_one_space_after_the_colon_is_removed_and_only_one() -> None:
    assert decode(b"data:x\n\ndata: x\n\ndata:  x\n\n") == [
        SSEEvent(None, "x"),
        SSEEvent(None, "x"),
        SSEEvent(None, " x"),
    ]


def test_empty_data_field_still_dispatches() -> None:
    # "data" with no colon is the field "data" with an empty value (WHATWG).
    assert decode(b"data\n\n") == [SSEEvent(None, "")]
    assert decode(b"event: x\ndata:\n\n") == [SSEEvent("x", "")]


def test_event_without_data_is_dropped() -> None:
    assert decode(b"event: ping\n\nevent: a\nid: 3\nretry: 10\n\ndata: kept\n\n") == [SSEEvent(None, "kept")]


def test_event_name_does_not_leak_into_the_next_event() -> None:
    assert decode(b"event: a\ndata: 1\n\ndata: 2\n\n") == [SSEEvent("a", "1"), SSEEvent(None, "2")]


def test_comments_keep_alives_and_unknown_fields_are_ignored() -> None:
    stream = (
        b": keep-alive\n\n:\n\ndata: a\n: inside an event\nfoo: bar\nid: 7\nretry: 100\ndata: b\n\n: bye\n\n"
    )
    assert decode(stream) == [SSEEvent(None, "a\nb")]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_every_line_ending(eol: bytes) -> None:
    stream = b"event: e" + eol + b"data: 1" + eol + b"data: 2" + eol + eol + b"data: 3" + eol + eol
    expected = [SSEEvent("e", "1\n2"), SSEEvent(None, "3")]
    assert decode(stream) == expected
    assert decode(*bytewise(stream)) == expected


def test_mixed_line_endings() -> None:
    assert decode(b"data: a\r\ndata: b\rdata: c\n\r\n") == [SSEEvent(None, "a\nb\nc")]


def test_crlf_split_across_chunks_is_one_line_end() -> None:
    # Were the CR and LF two line ends, the blank line between them would dispatch "a" alone.
    assert decode(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == [SSEEvent(None, "a\nb")]
    assert decode(b"data: a\r", b"", b"\n", b"data: b\r\n\r\n") == [SSEEvent(None, "a\nb")]


def test_lone_cr_at_a_chunk_end_followed_by_data() -> None:
    assert decode(b"data: a\r", b"data: b\r\r") == [SSEEvent(None, "a\nb")]


def test_multibyte_characters_split_across_chunks_survive() -> None:
    text = "héllo € 😀 \u4e16\u754c"
    stream = f"data: {text}\n\n".encode()
    assert decode(*bytewise(stream)) == [SSEEvent(None, text)]


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert decode(b"data: \xff\xfe ok \xc3\n\n") == [SSEEvent(None, "\ufffd\ufffd ok \ufffd")]


def test_byte_order_mark_is_removed_only_at_the_start() -> None:
    stream = "\ufeffdata: a\n\ndata: \ufeffb\n\n".encode()
    assert decode(stream) == [SSEEvent(None, "a"), SSEEvent(None, "\ufeffb")]
    assert decode(*bytewise(stream)) == [SSEEvent(None, "a"), SSEEvent(None, "\ufeffb")]


def test_close_returns_the_event_left_without_a_blank_line() -> None:
    assert decode(b"data: [DONE]") == [SSEEvent(None, "[DONE]")]
    assert decode(b"data: [DONE]\n") == [SSEEvent(None, "[DONE]")]
    assert decode(b"event: message_stop\ndata: {}\r\n") == [SSEEvent("message_stop", "{}")]


def test_close_without_pending_data() -> None:
    decoder = SSEDecoder()
    assert decoder.close() == []
    assert decoder.feed(b"data: a\n\n") == [SSEEvent(None, "a")]
    assert decoder.close() == []
    assert decode(b"event: only-a-name") == []


def test_feed_returns_only_completed_events_and_keeps_the_tail() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n\ndata: b") == [SSEEvent(None, "a")]
    assert decoder.feed(b"c\n") == []
    assert decoder.feed(b"\n") == [SSEEvent(None, "bc")]


def test_accepts_bytearray_and_memoryview() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(bytearray(b"data: a\n\n")) == [SSEEvent(None, "a")]
    assert decoder.feed(memoryview(b"data: b\n\n")) == [SSEEvent(None, "b")]


def test_an_over_long_complete_line_is_dropped_and_counted() -> None:
    decoder = SSEDecoder(max_line_bytes=16)
    long_line = b"data: " + b"x" * 20  # 26 bytes
    events = decoder.feed(b"data: ok\n\n" + long_line + b"\n\ndata: after\n\n")
    assert events == [SSEEvent(None, "ok"), SSEEvent(None, "after")]
    assert decoder.dropped_bytes == len(long_line)


def test_an_over_long_incomplete_line_is_dropped_while_it_streams() -> None:
    decoder = SSEDecoder(max_line_bytes=16)
    assert decoder.feed(b"data: ") == []
    for _ in range(1000):
        assert decoder.feed(b"x" * 10) == []
        assert decoder.pending_bytes <= 16
    assert decoder.feed(b"\r") == []
    assert decoder.feed(b"\ndata: next\n\n") == [SSEEvent(None, "next")]
    assert decoder.dropped_bytes == 6 + 10_000


def test_an_over_long_tail_at_close_is_not_returned() -> None:
    decoder = SSEDecoder(max_line_bytes=8)
    decoder.feed(b"data: 123456789")
    assert decoder.close() == []
    assert decoder.dropped_bytes == 15


def test_a_line_exactly_at_the_cap_is_kept() -> None:
    assert decode(b"data: 12", b"\n\n", max_line_bytes=8) == [SSEEvent(None, "12")]
    assert decode(b"data: 123\n\n", max_line_bytes=8) == []


def test_an_event_whose_data_outgrows_the_cap_is_dropped() -> None:
    decoder = SSEDecoder(max_line_bytes=32)
    events = decoder.feed(b"data: 0123456789\n" * 10 + b"\ndata: small\n\n")
    assert events == [SSEEvent(None, "small")]
    assert decoder.dropped_bytes == 16 * 10
    assert decoder.pending_bytes == 0


def test_max_line_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_line_bytes"):
        SSEDecoder(max_line_bytes=0)


@pytest.mark.parametrize(
    "chunks",
    [
        [b"data: a\n\n", b"data: {}\n\n", b"data: [DONE]\n\n"],  # one whole event per chunk
        [b"data: a\n\ndata: b\n\n", b"data: \n\n"],  # several per chunk, an empty one
        [b"data: a\n\n", b"event: e\ndata: b\n\n", b"data: c\n\n"],  # a named event between
        [b"data: a\n", b"\ndata: b\n\n", b"data: c\n\n"],  # an event completed by the next chunk
        [b"data: a\n\n", b"data: b\ndata: c\n\n", b"data: d\n\n\n\ndata: e\n\n"],  # two data lines, blanks
        [b"data: a\r\n\r\n", b"data: b\n\n", b"data: \xe2\x82\n\n"],  # CRLF, then invalid UTF-8
        [b"\xef\xbb\xbfdata: a\n\n", b"data: b\n\n"],  # a byte-order mark at the start
        [b"data: a\n\n", b": keep-alive\n\ndata: b\n\n"],
    ],
)
def test_whole_event_chunks_decode_as_byte_by_byte(chunks: list[bytes]) -> None:
    # Chunks of whole `data:` events take a shorter path: the events must be the same as the rules give.
    assert decode(*chunks) == decode(*bytewise(b"".join(chunks)))


def test_whole_event_chunks_respect_the_line_cap() -> None:
    decoder = SSEDecoder(max_line_bytes=8)
    assert decoder.feed(b"data: a\n\n") + decoder.feed(b"data: 1234\n\n") == [SSEEvent(None, "a")]
    assert decoder.dropped_bytes == len(b"data: 1234")


@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_keep_cut_keeps_the_start_of_an_oversized_event_whatever_the_chunking(piece: int) -> None:
    raw = b'data: {"d": "' + b"x" * 200 + b'"}\n\n' + b"data: next\n\n"
    decoder = SSEDecoder(max_line_bytes=64, keep_cut=True)
    events = [e for start in range(0, len(raw), piece) for e in decoder.feed(raw[start : start + piece])]
    events += decoder.close()
    assert events == [SSEEvent(None, '{"d": "' + "x" * (64 - 6 - 7), cut=True), SSEEvent(None, "next")]
    assert decoder.dropped_bytes == len(raw) - len(b"data: next\n\n") - 64 - 2


def test_keep_cut_cuts_an_event_whose_data_lines_add_up_past_the_cap() -> None:
    decoder = SSEDecoder(max_line_bytes=16, keep_cut=True)
    events = decoder.feed(b"data: 0123456789\ndata: abcdefghij\ndata: more\n\n")
    assert events == [SSEEvent(None, "0123456789\n", cut=True)]


def test_a_stream_ending_inside_a_cut_line_keeps_its_start() -> None:
    decoder = SSEDecoder(max_line_bytes=10, keep_cut=True)
    assert decoder.feed(b"data: abcdefghijklmnop") == []
    assert decoder.close() == [SSEEvent(None, "abcd", cut=True)]


def test_close_cut_json_keeps_the_unfinished_string() -> None:
    from otel_capture._dialects.stream import close_cut_json

    assert (
        close_cut_json('{"choices": [{"delta": {"content": "abc')
        == b'{"choices":[{"delta":{"content":"abc"}}]}'
    )
    assert close_cut_json(b'{"a": 1, "b": [true, "x') == b'{"a":1,"b":[true,"x"]}'
    assert close_cut_json("not json") is None


@pytest.mark.parametrize(
    ("batch", "fast"),
    [
        (b'data: {"a":1}\n\ndata: {"b":"\xc3\xa9"}\n\ndata: [DONE]\n\n', True),
        (b"data: \xff\xfe\n\ndata: b\n\n", True),  # not UTF-8: replaced, as line by line
        (b"data: a\n\nevent: x\ndata: b\n\n", False),  # a named event
        (b"data: a\n\ndata: b\ndata: c\n\n", False),  # an event of two data lines
        (b"data: a\n\n: comment\n\ndata: b\n\n", False),
        (b"data: a\n\ndata: b\n\n\ndata: c\n\n", False),  # a third line feed between two events
    ],
)
def test_a_batch_of_whole_events_reads_as_its_events_one_by_one(batch: bytes, fast: bool) -> None:
    """The fast path for a batch (whole_data) gives each event's data as the line-by-line rules do, and
    declines (None: the batch is then fed line by line) any other shape."""
    decoder = SSEDecoder()
    decoder.feed(b"data: x\n\n")  # a stream's first line is looked at for a byte-order mark: never whole
    whole = decoder.whole_data(batch)
    assert (whole is not None) == fast
    if whole is not None:
        assert [SSEEvent(None, data) for data in whole] == decode(b"data: x\n\n" + batch)[1:]
