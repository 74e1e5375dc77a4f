"""Collector side: NeMo Gym's own files give NeMo Gym's own attachment; clearing; gaps; several directories."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from support import FIXTURES

from otel_capture import (
    CaptureStore,
    InvalidRolloutIdError,
    attach_model_call_capture,
    build_model_call_capture,
    clear_model_call_captures,
)

PAYLOADS = {"request", "response", "request_raw", "response_raw"}
LINE = {
    "model_call_id": "a" * 32,
    "dialect": "chat",
    "model_ref": {"type": "responses_api_models", "name": "p"},
    "started_at": 1.0,
    "completed_at": 2.0,
    "latency_ms": 3.5,
    "latency_ttft_ms": 1.25,
    "status_code": 200,
    "error_category": None,
    "request": {"model": "m"},
    "response": {"id": "r", "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
}


def _gym_merged() -> dict[str, Any]:
    merged: dict[str, Any] = json.loads((FIXTURES / "merged_record_0-0.json").read_text())
    return merged


def _gym_dir(path: Path) -> Path:
    """NeMo Gym's capture files under the rollout ids they were written for (0-0 and its retry 0-0-a1)."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / "gym_server_0-0.capture.jsonl", path / "0-0.capture.jsonl")
    shutil.copy(FIXTURES / "retry_0-0-a1.capture.jsonl", path / "0-0-a1.capture.jsonl")
    return path


def _line(**overrides: Any) -> bytes:
    return orjson.dumps({**LINE, **overrides}) + b"\n"


def _write(directory: Path, rollout_id: str, content: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{rollout_id}.capture.jsonl").write_bytes(content)


def _mark_incomplete(directory: Path, rollout_id: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{rollout_id}.capture.incomplete").write_text('{"reason": "disk full"}\n')


# --- NeMo Gym's own files -----------------------------------------------------------------------------


def test_attachment_from_gyms_files_equals_gyms_attachment(tmp_path: Path) -> None:
    merged = _gym_merged()
    gym = merged["ng_model_call_capture"]
    record = {key: value for key, value in merged.items() if key != "ng_model_call_capture"}
    before = copy.deepcopy(record)

    attachment = attach_model_call_capture(record, CaptureStore(_gym_dir(tmp_path)))

    assert record["ng_model_call_capture"] is attachment
    assert {key: value for key, value in record.items() if key != "ng_model_call_capture"} == before
    assert attachment["rollout_id"] == gym["rollout_id"] == "0-0"
    assert "gaps" not in attachment and "gaps" not in gym
    # NeMo Gym's keys with NeMo Gym's values, in its order; ours follow
    assert list(attachment["metrics"])[: len(gym["metrics"])] == list(gym["metrics"])
    assert {key: attachment["metrics"][key] for key in gym["metrics"]} == gym["metrics"]
    assert attachment["metrics"]["num_errors"] == 1
    assert len(attachment["calls"]) == len(gym["calls"]) == 6
    for ours, theirs in zip(attachment["calls"], gym["calls"], strict=False):
        assert list(ours)[: len(theirs)] == list(theirs)
        assert {key: ours[key] for key in theirs} == theirs
        assert not PAYLOADS & set(ours)  # payloads stay in the store
    # the attachment is plain JSON, as a rollout record line needs
    assert json.loads(json.dumps(attachment)) == attachment


def test_retried_attempt_gets_only_its_own_calls(tmp_path: Path) -> None:
    store = CaptureStore(_gym_dir(tmp_path))
    first: dict[str, Any] = {"_ng_task_index": 0, "_ng_rollout_index": 0}
    retry: dict[str, Any] = {"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 1}
    attach_model_call_capture(first, store)
    attach_model_call_capture(retry, store)
    assert retry["ng_model_call_capture"]["rollout_id"] == "0-0-a1"
    [call] = retry["ng_model_call_capture"]["calls"]
    assert call["model_call_id"] == "14a61054520d4b96bf5f1bfdea92d002"
    assert call["call_index"] == 0
    assert call["model_call_id"] not in {c["model_call_id"] for c in first["ng_model_call_capture"]["calls"]}
    assert retry["ng_model_call_capture"]["metrics"]["num_calls"] == 1


def test_payloads_on_request(tmp_path: Path) -> None:
    attachment = build_model_call_capture(_gym_dir(tmp_path), "0-0", include_payloads=True)
    assert attachment["calls"][0]["request"] == {"input": "weather?"}
    assert set(attachment["calls"][0]) >= PAYLOADS


# --- which rollout, and additivity ----------------------------------------------------------------------


def test_explicit_rollout_id_and_explicit_record_id(tmp_path: Path) -> None:
    _write(tmp_path, "run7.task-1-a2", _line())
    record: dict[str, Any] = {"_ng_rollout_id": "run7.task-1", "_ng_attempt_index": 2}
    assert attach_model_call_capture(record, tmp_path)["metrics"]["num_calls"] == 1
    other: dict[str, Any] = {"anything": True}
    attachment = attach_model_call_capture(other, str(tmp_path), rollout_id="run7.task-1-a2")
    assert attachment["rollout_id"] == "run7.task-1-a2"
    assert other["anything"] is True


def test_record_that_names_no_rollout_is_refused(tmp_path: Path) -> None:
    record: dict[str, Any] = {"reward": 1.0}
    with pytest.raises(ValueError, match="names no rollout"):
        attach_model_call_capture(record, tmp_path)
    assert record == {"reward": 1.0}


@pytest.mark.parametrize(
    ("record", "rollout_id"),
    [
        ({"_ng_rollout_id": "../x"}, None),
        ({"_ng_task_index": "a b", "_ng_rollout_index": 0}, None),
        ({}, "a/b"),
    ],
)
def test_invalid_rollout_ids_are_refused(
    tmp_path: Path, record: dict[str, Any], rollout_id: str | None
) -> None:
    with pytest.raises(InvalidRolloutIdError):
        attach_model_call_capture(record, tmp_path, rollout_id=rollout_id)
    assert "ng_model_call_capture" not in record


def test_an_existing_attachment_is_never_replaced(tmp_path: Path) -> None:
    _write(tmp_path, "0-0", _line())
    record: dict[str, Any] = {"_ng_task_index": 0, "_ng_rollout_index": 0, "ng_model_call_capture": {"x": 1}}
    with pytest.raises(ValueError, match="already has"):
        attach_model_call_capture(record, tmp_path)
    assert record["ng_model_call_capture"] == {"x": 1}


# --- gaps -------------------------------------------------------------------------------------------------


def test_gap_no_records_when_nothing_was_captured(tmp_path: Path) -> None:
    attachment = build_model_call_capture(tmp_path / "never-created", "0-0")
    assert attachment["gaps"] == [{"code": "model_call_capture_no_records"}]
    assert attachment["calls"] == [] and attachment["metrics"]["num_calls"] == 0
    assert not (tmp_path / "never-created").exists()  # reading never creates the directory


def test_gap_no_records_for_an_empty_file(tmp_path: Path) -> None:
    _write(tmp_path, "0-0", b"\n\n")
    assert build_model_call_capture(tmp_path, "0-0")["gaps"] == [{"code": "model_call_capture_no_records"}]


def test_gap_records_unreadable_counts_damaged_lines(tmp_path: Path) -> None:
    good = _line()
    _write(tmp_path, "0-0", good + b"{not json\n" + good + _line(model_ref={"type": "x", "name": "n"}) + good)
    attachment = build_model_call_capture(tmp_path, "0-0")
    assert attachment["gaps"] == [{"code": "model_call_capture_records_unreadable", "detail": "count=2"}]
    # NeMo Gym's call_index: the line's position, damaged lines counted
    assert [call["call_index"] for call in attachment["calls"]] == [0, 2, 4]
    assert attachment["metrics"]["num_calls"] == 3


def test_gap_torn_tail_is_reported_and_counted_as_unreadable(tmp_path: Path) -> None:
    good = _line()
    _write(tmp_path, "0-0", good + good + good[:-1])  # the last append lost its newline: never parsed
    attachment = build_model_call_capture(tmp_path, "0-0")
    assert attachment["gaps"] == [
        {"code": "model_call_capture_records_unreadable", "detail": "count=1"},
        {"code": "model_call_capture_torn_tail", "detail": f"{tmp_path}/0-0.capture.jsonl:3"},
    ]
    assert len(attachment["calls"]) == 2


def test_gap_torn_tail_alone_is_not_no_records(tmp_path: Path) -> None:
    _write(tmp_path, "0-0", _line()[:40])
    codes = [gap["code"] for gap in build_model_call_capture(tmp_path, "0-0")["gaps"]]
    assert codes == ["model_call_capture_records_unreadable", "model_call_capture_torn_tail"]


def test_gap_incomplete_with_and_without_records(tmp_path: Path) -> None:
    _write(tmp_path, "0-0", _line())
    _mark_incomplete(tmp_path, "0-0")
    _mark_incomplete(tmp_path, "0-1")
    with_records = build_model_call_capture(tmp_path, "0-0")
    # the gap names what the marker says was lost ("?": its line names no call)
    assert with_records["gaps"] == [{"code": "model_call_capture_incomplete", "detail": "?: disk full"}]
    assert len(with_records["calls"]) == 1
    # the marker says calls were made, so it is not "no records" (as in NeMo Gym)
    assert build_model_call_capture(tmp_path, "0-1")["gaps"] == [
        {"code": "model_call_capture_incomplete", "detail": "?: disk full"}
    ]


def test_gap_unreadable_when_the_read_fails(tmp_path: Path) -> None:
    broken = tmp_path / "node-a"
    (broken / "0-0.capture.jsonl").mkdir(parents=True)  # opening it for reading fails
    good = tmp_path / "node-b"
    _write(good, "0-0", _line())
    record: dict[str, Any] = {"_ng_task_index": 0, "_ng_rollout_index": 0}
    attachment = attach_model_call_capture(record, [broken, good])
    [gap] = attachment["gaps"]
    assert gap["code"] == "model_call_capture_unreadable"
    assert str(broken) in gap["detail"] and "IsADirectoryError" in gap["detail"]
    assert len(attachment["calls"]) == 1  # what could be read is still attached
    # an unreadable directory alone: we cannot say there were no records
    alone = build_model_call_capture(broken, "0-0")
    assert [g["code"] for g in alone["gaps"]] == ["model_call_capture_unreadable"]


def test_gap_unreadable_for_a_retired_rollout(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    _write(tmp_path, "0-0", _line())
    first: dict[str, Any] = {"_ng_task_index": 0, "_ng_rollout_index": 0}
    assert "gaps" not in attach_model_call_capture(first, store)
    store.retire_now(["0-0"])
    # attached again after the retire (a collector processing a result twice): the calls are unknown, not
    # zero, so it is not "no records"
    again: dict[str, Any] = {"_ng_task_index": 0, "_ng_rollout_index": 0}
    assert attach_model_call_capture(again, store)["gaps"] == [
        {"code": "model_call_capture_unreadable", "detail": f"{tmp_path}: retired (its records were removed)"}
    ]


# --- several directories ----------------------------------------------------------------------------------


def test_several_directories_are_merged_in_completion_order(tmp_path: Path) -> None:
    lines = (FIXTURES / "gym_server_0-0.capture.jsonl").read_bytes().splitlines(keepends=True)
    _write(tmp_path / "node-a", "0-0", b"".join(lines[0::2]))
    _write(tmp_path / "node-b", "0-0", b"".join(lines[1::2]))
    gym = _gym_merged()["ng_model_call_capture"]
    attachment = build_model_call_capture([tmp_path / "node-b", tmp_path / "node-a"], "0-0")
    assert "gaps" not in attachment
    assert [c["model_call_id"] for c in attachment["calls"]] == [c["model_call_id"] for c in gym["calls"]]
    assert [c["call_index"] for c in attachment["calls"]] == list(range(6))
    metrics = attachment["metrics"]
    assert {key: metrics[key] for key in gym["metrics"]} == {
        **gym["metrics"],
        "latency_total_ms": pytest.approx(gym["metrics"]["latency_total_ms"]),
    }


def test_merge_keeps_each_files_own_order(tmp_path: Path) -> None:
    # node-a's file was appended in this order even though its clocks say otherwise; a call without
    # completed_at stays right after its predecessor.
    _write(
        tmp_path / "a",
        "r",
        _line(model_call_id="a1", completed_at=10.0)
        + _line(model_call_id="a2", completed_at=5.0)
        + _line(model_call_id="a3", completed_at=None),
    )
    _write(
        tmp_path / "b",
        "r",
        _line(model_call_id="b1", completed_at=7.0) + _line(model_call_id="b2", completed_at=12.0),
    )
    calls = build_model_call_capture([tmp_path / "a", tmp_path / "b"], "r")["calls"]
    assert [c["model_call_id"] for c in calls] == ["b1", "a1", "a2", "a3", "b2"]


def test_gaps_from_several_directories_add_up(tmp_path: Path) -> None:
    _write(tmp_path / "a", "r", _line() + b"oops\n")
    _write(tmp_path / "b", "r", b"[1]\n" + _line())
    _mark_incomplete(tmp_path / "c", "r")
    attachment = build_model_call_capture([tmp_path / "a", tmp_path / "b", tmp_path / "c"], "r")
    assert attachment["gaps"] == [
        {"code": "model_call_capture_records_unreadable", "detail": "count=2"},
        {"code": "model_call_capture_incomplete", "detail": "?: disk full"},
    ]
    assert len(attachment["calls"]) == 2


def test_a_directory_given_twice_is_read_once(tmp_path: Path) -> None:
    _write(tmp_path, "r", _line())
    attachment = build_model_call_capture([tmp_path, CaptureStore(tmp_path), str(tmp_path) + "/"], "r")
    assert attachment["metrics"]["num_calls"] == 1
    assert attachment["calls"][0]["call_index"] == 0


def test_no_directory_or_a_wrong_type_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no capture directory"):
        build_model_call_capture([], "r")
    with pytest.raises(TypeError):
        build_model_call_capture([42], "r")  # type: ignore[list-item]  # the wrong type is the point


# --- clearing before dispatch -------------------------------------------------------------------------------


def test_clear_removes_records_and_markers_in_every_directory(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, "0-0", _line())
    _mark_incomplete(b, "0-0")
    _write(b, "0-1-a1", _line())
    _write(a, "0-1", _line())  # the failed first attempt of 0-1 is kept: only the exact ids are cleared
    result = clear_model_call_captures([a, b], ["0-0", "0-1-a1", "9-9"])
    assert result == {"removed": ["0-0", "0-1-a1"], "absent": ["9-9"], "failed": {}}
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["0-1.capture.jsonl"]
    assert build_model_call_capture([a, b], "0-0")["gaps"] == [{"code": "model_call_capture_no_records"}]
    assert clear_model_call_captures([a, b], ["0-0"]) == {"removed": [], "absent": ["0-0"], "failed": {}}


def test_clear_never_creates_a_directory(tmp_path: Path) -> None:
    assert clear_model_call_captures(tmp_path / "nope", ["0-0"]) == {
        "removed": [],
        "absent": ["0-0"],
        "failed": {},
    }
    assert not (tmp_path / "nope").exists()


def test_clear_validates_the_whole_batch_first(tmp_path: Path) -> None:
    _write(tmp_path, "0-0", _line())
    with pytest.raises(TypeError, match="string"):
        clear_model_call_captures(tmp_path, "0-0")
    with pytest.raises(ValueError, match="invalid rollout id"):
        clear_model_call_captures(tmp_path, ["0-0", "../0-0"])
    assert (tmp_path / "0-0.capture.jsonl").exists()  # nothing was touched


def test_clear_deletes_fences_so_a_retired_id_can_be_used_again(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    _write(tmp_path, "0-0", _line())
    store.retire_now(["0-0"])
    assert store.rollout_state("0-0") == "retired"
    assert clear_model_call_captures(store, ["0-0"]) == {"removed": ["0-0"], "absent": [], "failed": {}}
    assert store.rollout_state("0-0") == "absent"


def test_clear_reports_what_it_could_not_remove(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "0-0.capture.jsonl").mkdir(parents=True)  # cannot be unlinked
    _write(b, "0-0", _line())
    _write(b, "0-1", _line())
    result = clear_model_call_captures([a, b], ["0-0", "0-1"])
    assert result["removed"] == ["0-1"] and result["absent"] == []
    assert list(result["failed"]) == ["0-0"] and result["failed"]["0-0"].startswith(f"{a}: ")
