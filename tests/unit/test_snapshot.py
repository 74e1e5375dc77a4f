"""The snapshot a freeze returns is a read model: what a collector needs, as data (``_store/snapshot.py``,
``CaptureSnapshot``), so the attachment is built from it alone."""

from __future__ import annotations

from pathlib import Path

from otel_capture import CaptureStore, InvalidLine, read_available_model_call_records
from otel_capture._store import InMemoryCaptureBackend

LINE = b'{"model_call_id":"c1","dialect":"chat"}\n'


def test_a_snapshot_carries_damage_the_torn_tail_calls_in_flight_and_lost_calls(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.append_now("r", "c0", {"dialect": "chat"})
    with open(tmp_path / "r.capture.jsonl", "ab") as data:
        data.write(b"not json\n" + LINE + b'{"model_call_id":"c2"')  # a damaged line, a record, a torn tail
    store.mark_incomplete("r", "c3", "disk full")
    store.begin_call("r", "c4")
    before = read_available_model_call_records(store, "r")  # what the tolerant reader says

    snapshot = store.freeze_now("r")

    assert [r.model_call_id for r in snapshot.records] == ["c0", "c1"]
    assert list(snapshot.damaged_lines) == before.invalid
    assert snapshot.damaged_lines[0].line_number == 2
    assert snapshot.torn_tail == before.torn_tail_line
    assert isinstance(snapshot.torn_tail, InvalidLine) and snapshot.torn_tail.line_number == 4
    assert snapshot.in_flight == ("c4",)
    assert [(c.model_call_id, c.reason) for c in snapshot.lost_calls] == [("c3", "disk full")]
    assert snapshot.marked and snapshot.unreadable is None


def test_a_clean_snapshot_says_nothing_is_missing(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.append_now("r", "c0", {"dialect": "chat"})
    snapshot = store.freeze_now("r")
    assert (snapshot.damaged_lines, snapshot.torn_tail, snapshot.in_flight, snapshot.lost_calls) == (
        (),
        None,
        (),
        (),
    )
    assert not snapshot.marked and not snapshot.incomplete


def test_a_data_file_that_is_a_directory_makes_the_snapshot_unreadable(tmp_path: Path) -> None:
    (tmp_path / "r.capture.jsonl").mkdir()
    snapshot = CaptureStore(tmp_path).freeze_now("r")
    assert snapshot.unreadable is not None and "IsADirectoryError" in snapshot.unreadable


def test_the_in_memory_backend_s_snapshot_carries_the_same_data() -> None:
    backend = InMemoryCaptureBackend()
    backend.append_now("r", "c0", {"dialect": "chat"})
    backend.mark_incomplete("r", "c3", "disk full")
    backend.begin_call("r", "c4")
    snapshot = backend.freeze_now("r")
    assert snapshot.in_flight == ("c4",)
    assert [(c.model_call_id, c.reason) for c in snapshot.lost_calls] == [("c3", "disk full")]
    assert snapshot.marked
