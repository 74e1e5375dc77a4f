"""A frozen snapshot holds its lines as bytes and parses them on access (issue 15, item 10: memory at scale):
it behaves as the tuple of parsed records it replaced, and holds no parsed record itself."""

from __future__ import annotations

import gc
import pickle
from pathlib import Path

import orjson
import pytest

from otel_capture import CaptureStore, ModelCallRecord, read_available_model_call_records

LINES = 40


def _store_with_lines(tmp_path: Path, n: int = LINES) -> CaptureStore:
    store = CaptureStore(tmp_path / "calls")
    store.root.mkdir()
    lines = [
        orjson.dumps(
            {"model_call_id": f"c{i}", "dialect": "chat", "response": {"usage": {"prompt_tokens": i}}}
        )
        for i in range(n)
    ]
    lines.insert(3, b"")  # a blank line: not a record, and not counted by call_index
    lines.insert(7, b"{damaged")  # a damaged line: not a record, but counted by call_index
    (store.root / "r.capture.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    tokens = b"".join(
        orjson.dumps({"model_call_id": f"c{i}", "prompt_token_ids": [i]}) + b"\n" for i in range(n)
    )
    (store.root / "r.tokens.jsonl").write_bytes(tokens)
    return store


def _live_records() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, ModelCallRecord))


def test_a_snapshot_holds_no_parsed_record_until_one_is_asked_for(tmp_path: Path) -> None:
    store = _store_with_lines(tmp_path)
    before = _live_records()
    snap = store.freeze_now("r")
    assert len(snap.records) == LINES and len(snap.tokens) == LINES
    assert _live_records() == before  # a tuple of ModelCallRecords held all of them
    first = snap.records[0]
    assert isinstance(first, ModelCallRecord) and _live_records() == before + 1
    del first
    assert _live_records() == before


def test_a_snapshot_reads_as_the_tuple_of_records_the_readers_parse(tmp_path: Path) -> None:
    store = _store_with_lines(tmp_path)
    expected = tuple(read_available_model_call_records(store, "r").records)
    snap = store.freeze_now("r")
    records = snap.records
    assert [r.call_index for r in records][:8] == [0, 1, 2, 3, 4, 5, 7, 8]  # the damaged line counts
    assert records == expected and records == list(expected) and expected == records
    assert records != expected[:-1] and records != expected[::-1]
    assert records[-1] == expected[-1] and records[5] == expected[5]
    assert records[2:9] == expected[2:9] and records[::-3] == expected[::-3] and records[100:] == ()
    assert list(reversed(records)) == list(reversed(expected))
    assert records.index(expected[4]) == 4 and expected[6] in records and records.count(expected[1]) == 1
    with pytest.raises(IndexError):
        records[LINES]
    with pytest.raises(TypeError):
        records[0] = expected[0]  # type: ignore[index]  # read-only: the assignment must fail
    assert [t["prompt_token_ids"] for t in snap.tokens] == [[i] for i in range(LINES)]
    assert store.freeze_now("r") == snap  # a repeat is equal, record for record
    assert pickle.loads(pickle.dumps(snap)) == snap
    # the damaged line named by its line number in the file, as the tolerant reader names it
    [damaged] = read_available_model_call_records(store, "r").invalid
    assert damaged.line_number == 8
    assert snap.incomplete and any(
        f"damaged line {damaged.line_number}" in c.reason for c in snap.incomplete_calls
    )


def test_an_empty_snapshot_equals_empty_tuples(tmp_path: Path) -> None:
    snap = CaptureStore(tmp_path / "calls").freeze_now("r")
    assert snap.records == () and snap.tokens == () and not snap.records and repr(snap.records) == "()"
