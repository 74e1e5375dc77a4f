"""The record line codec (otel_capture._records.codec) both ways: what the encoder writes is what the
decoder reads, field for field, for every field the schema declares; one splitter and one wording."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from otel_capture._capture.call import InFlightCall
from otel_capture._records import codec
from otel_capture._records.schema import (
    EXTRA_RECORD_FIELDS,
    EXTRA_RECORD_TYPES,
    LINE_KEYS,
    SCHEMA_VERSION,
    ModelCallRecord,
)
from otel_capture._settings import CaptureSettings

SAMPLE: dict[type, Any] = {int: 7, str: "x", bool: True, dict: {"error": {"message": "m"}}}


def _lines() -> list[bytes]:
    """Lines the capture makes: plain, with a session and raw bodies, streamed and cut, failed."""
    plain = InFlightCall("chat", "r", CaptureSettings(service_name="svc"))
    plain.set_request(b'{"model": "m"}')
    plain.on_response_start(200, "application/json")
    plain.on_body(b'{"id": "x", "choices": []}')
    plain.finish()
    odd = InFlightCall("responses", "r", CaptureSettings(max_body_bytes=4), session_id="s")
    odd.set_request(b"not json at all")
    odd.on_response_start(200, "text/event-stream")
    odd.on_body(b"data: {}\n\n")
    odd.finish(exception=ConnectionResetError("gone"))
    return [plain.line(1, 2), odd.line(3, 4)]


def test_the_lines_the_capture_makes_follow_the_schemas_keys_and_order() -> None:
    for line in _lines():
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        keys = list(orjson.loads(line))
        assert [key for key in LINE_KEYS if key in keys] == keys  # only the schema's keys, in its order
        assert orjson.loads(line)["schema_version"] == SCHEMA_VERSION
    assert {"client_session_id", "request_raw", "response_raw", "truncated", "failure"} <= set(
        orjson.loads(_lines()[1])
    )


def test_what_the_capture_writes_the_decoder_reads() -> None:
    record = codec.decode_record_line(_lines()[1].strip(), 0)
    assert (record.rollout_id, record.span_id, record.client_session_id) == ("r", f"{4:016x}", "s")
    assert record.truncated is True and record.failure is not None


@pytest.mark.parametrize("name", [n for n in EXTRA_RECORD_FIELDS if n != "schema_version"])
def test_every_added_field_the_schema_declares_is_written_and_read_back(name: str) -> None:
    value = SAMPLE[EXTRA_RECORD_TYPES[name]]
    line = codec.encode_record_line({"model_call_id": "c", name: value})
    record = codec.decode_record_line(line.strip(), 4)
    assert isinstance(record, ModelCallRecord)
    assert (getattr(record, name), record.call_index, record.model_call_id) == (value, 4, "c")


def test_a_damaged_line_is_worded_one_way() -> None:
    with pytest.raises(codec.DamagedLine, match="invalid JSON"):
        codec.decode_record_line(b"{nope", 0)
    assert codec.parse_record_line(b"[1]", 0) is None
    error = codec.CaptureReadError(__import__("pathlib").Path("/d/r.capture.jsonl"), 3, "invalid JSON: x")
    assert str(error) == "/d/r.capture.jsonl: damaged line 3: invalid JSON: x"
    assert codec.damaged_line(3) == "damaged line 3"


def test_the_tokens_line_carries_its_schema_version_and_ids() -> None:
    response = {"model": "m", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": [3]}]}
    line = codec.tokens_line(response, rollout_id="r", model_call_id="c")
    assert line is not None and orjson.loads(line) == {
        "schema_version": 1,
        "rollout_id": "r",
        "model_call_id": "c",
        "model": "m",
        "prompt_token_ids": [1, 2],
        "generations": [{"index": 0, "token_ids": [3], "log_probs": None}],
    }
    assert codec.tokens_line({"choices": []}, rollout_id="r", model_call_id="c") is None


@given(st.lists(st.sampled_from([b"", b" ", b"\t", b"a", b"{}", b" x "]), max_size=12), st.binary(max_size=4))
def test_the_splitters_agree_on_what_a_line_is_and_its_number(lines: list[bytes], tail: bytes) -> None:
    data = b"".join(line + b"\n" for line in lines) + tail.replace(b"\n", b"")
    complete, rest = codec.split_lines(data)
    assert complete == lines and rest == tail.replace(b"\n", b"")
    from_split = [(n, line) for n, line in enumerate(complete, 1) if line.strip()]
    assert [(n, data[start:end]) for n, start, end in codec.line_spans(data)] == from_split
    assert codec.final_tail(data) == rest


@given(
    st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"\n")), st.lists(st.integers(0, 64), max_size=6)
)
def test_a_file_read_in_chunks_has_the_lines_it_has_read_whole(data: bytes, cuts: list[int]) -> None:
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    chunks = [data[a:b] for a, b in pairwise(bounds)]
    assert list(codec.chunked_lines(chunks)) == codec.split_lines(data)[0]
