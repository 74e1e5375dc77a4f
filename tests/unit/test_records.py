"""Reading capture files: NeMo Gym 0.7.0's own files give Gym's own records and aggregate."""

from __future__ import annotations

import fcntl
import gc
import json
import shutil
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import ValidationError
from support import FIXTURES

import otel_capture
import otel_capture.conformance
from otel_capture._records import (
    EXTRA_RECORD_FIELDS,
    GYM_RECORD_FIELDS,
    CaptureReadError,
    ModelCallRecord,
    aggregate_model_call_records,
    build_model_call_record,
)
from otel_capture._store import (
    AvailableRecords,
    CaptureStore,
    aggregate_model_call_metrics,
    read_available_model_call_records,
    read_model_call_records,
)

GYM_METRIC_KEYS = (
    "tokens_in",
    "tokens_out",
    "tokens_reasoning",
    "tokens_total",
    "cached_tokens",
    "latency_total_ms",
    "num_calls",
)
GOOD = {
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
    "response": None,
}


@pytest.fixture
def store(tmp_path: Path) -> CaptureStore:
    return CaptureStore(tmp_path)


def _gym_store(tmp_path: Path) -> CaptureStore:
    for name in ("gym_server_0-0.capture.jsonl", "retry_0-0-a1.capture.jsonl"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    return CaptureStore(tmp_path)


def _write(store: CaptureStore, rollout_id: str, content: bytes) -> Path:
    path = store.data_path(rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def _line(**overrides: Any) -> bytes:
    return orjson.dumps({**GOOD, **overrides}) + b"\n"


# --- NeMo Gym's own files -----------------------------------------------------------------------------


def test_gym_file_gives_gyms_records(tmp_path: Path) -> None:
    expected = json.loads((FIXTURES / "records_0-0.json").read_text())
    records = read_model_call_records(_gym_store(tmp_path), "gym_server_0-0")
    assert len(records) == len(expected) == 6
    for record, gym in zip(records, expected, strict=False):
        assert set(gym) == set(GYM_RECORD_FIELDS)
        dumped = record.model_dump()
        for key in gym:
            assert dumped[key] == gym[key], (record.call_index, key)
            assert type(dumped[key]) is type(gym[key]), (record.call_index, key)
        assert all(dumped[key] is None for key in EXTRA_RECORD_FIELDS)


def test_gym_file_through_the_tolerant_reader(tmp_path: Path) -> None:
    store = _gym_store(tmp_path)
    available = read_available_model_call_records(store, "gym_server_0-0")
    assert available == AvailableRecords(records=read_model_call_records(store, "gym_server_0-0"))
    assert available.damaged == 0


def test_retry_file_reads(tmp_path: Path) -> None:
    [record] = read_model_call_records(_gym_store(tmp_path), "retry_0-0-a1")
    assert (record.call_index, record.request, record.tokens_in, record.cached_tokens) == (
        0,
        {"input": "retry"},
        20,
        8,
    )
    assert record.tool_calls == [
        {"call_id": "call_abc", "name": "get_weather", "arguments": {"city": "Paris"}}
    ]
    assert record.reasoning_content == "I should call the tool."
    assert record.response_status == "completed" and record.finish_reason is None


def test_aggregate_equals_gyms_attachment(tmp_path: Path) -> None:
    merged = json.loads((FIXTURES / "merged_record_0-0.json").read_text())
    gym_metrics = merged["ng_model_call_capture"]["metrics"]
    metrics = aggregate_model_call_metrics(_gym_store(tmp_path), "gym_server_0-0")
    assert {key: metrics[key] for key in gym_metrics} == gym_metrics
    assert list(metrics)[: len(GYM_METRIC_KEYS)] == list(GYM_METRIC_KEYS)
    assert metrics["num_errors"] == 1  # the 422
    assert metrics["cache_creation_tokens"] is None
    assert metrics["latency_ttft_ms_mean"] == pytest.approx((45.09 + 2.38 + 5.02 + 1.64 + 9.64 + 0.91) / 6)


def test_aggregate_takes_the_records_one_at_a_time(tmp_path: Path) -> None:
    """The metrics are summed as the records are parsed (a 100k-call rollout is never held whole): a
    one-pass iterator gives the same totals as the list, and a damaged line still raises."""
    store = _gym_store(tmp_path)
    records = read_model_call_records(store, "gym_server_0-0")
    assert aggregate_model_call_records(iter(records)) == aggregate_model_call_records(records)
    assert aggregate_model_call_metrics(store, "gym_server_0-0") == aggregate_model_call_records(records)
    with store.data_path("gym_server_0-0").open("ab") as handle:
        handle.write(b"not json\n")
    with pytest.raises(CaptureReadError):
        aggregate_model_call_metrics(store, "gym_server_0-0")


def test_attached_calls_match_gyms_attachment(tmp_path: Path) -> None:
    calls = json.loads((FIXTURES / "merged_record_0-0.json").read_text())["ng_model_call_capture"]["calls"]
    records = read_model_call_records(_gym_store(tmp_path), "gym_server_0-0")
    payloads = {"request", "response", "request_raw", "response_raw"}
    for record, gym in zip(records, calls, strict=False):
        dumped = record.model_dump(exclude=payloads)
        assert {key: dumped[key] for key in gym} == gym


# --- aggregate ----------------------------------------------------------------------------------------


def test_aggregate_of_nothing_and_of_errors() -> None:
    empty = aggregate_model_call_records([])
    assert empty["num_calls"] == 0 and empty["num_errors"] == 0
    assert all(empty[key] is None for key in GYM_METRIC_KEYS if key != "num_calls")
    calls = [
        build_model_call_record({"status_code": 500}, call_index=0),
        build_model_call_record({"status_code": 200, "error_category": "stream_truncated"}, call_index=1),
        build_model_call_record({"status_code": 200, "response": {"status": "failed"}}, call_index=2),
        build_model_call_record(
            {
                "status_code": 200,
                "response": {
                    "usage": {"input_tokens": 1, "output_tokens": 2, "cache_creation_input_tokens": 3}
                },
            },
            call_index=3,
        ),
    ]
    metrics = aggregate_model_call_records(calls)
    assert (metrics["num_calls"], metrics["num_errors"], metrics["cache_creation_tokens"]) == (4, 3, 3)
    assert (metrics["tokens_in"], metrics["tokens_total"], metrics["latency_ttft_ms_mean"]) == (4, 6, None)


# --- accepted lines -----------------------------------------------------------------------------------


def test_empty_object_is_a_valid_call() -> None:
    record = build_model_call_record({}, call_index=0)
    assert record.model_dump(include=set(GYM_RECORD_FIELDS)) == {
        **dict.fromkeys(GYM_RECORD_FIELDS),
        "call_index": 0,
        "tool_calls": [],
    }


def test_lax_coercion_and_non_dict_bodies(store: CaptureStore) -> None:
    _write(
        store,
        "r",
        _line(
            status_code="200",
            latency_ms="12.5",
            started_at=7,
            request=["x"],
            response="y",
            dialect="anything",
        ),
    )
    [record] = read_model_call_records(store, "r")
    assert (record.status_code, record.latency_total_ms, record.started_at) == (200, 12.5, 7.0)
    assert type(record.started_at) is float
    assert (record.request, record.response, record.request_raw, record.dialect) == (
        None,
        None,
        None,
        "anything",
    )


def test_our_extra_keys_are_read(store: CaptureStore) -> None:
    extras = {
        "schema_version": 1,
        "rollout_id": "r",
        "trace_id": "0" * 32,
        "span_id": "1" * 16,
        "stream": True,
        "stream_truncated": False,
        "truncated": False,
        "failure": {"reason": "x"},
    }
    _write(store, "r", _line(**extras) + _line())
    first, second = read_model_call_records(store, "r")
    assert {key: getattr(first, key) for key in extras} == extras
    assert all(getattr(second, key) is None for key in extras)
    assert first.model_dump(include=set(GYM_RECORD_FIELDS)) == {
        **second.model_dump(include=set(GYM_RECORD_FIELDS)),
        "call_index": 0,
    }


def test_a_wrongly_typed_extra_key_never_rejects_a_line_gym_reads(store: CaptureStore) -> None:
    _write(store, "r", _line(schema_version="2", stream="maybe", failure="boom", trace_id=5))
    [record] = read_model_call_records(store, "r")
    assert (record.schema_version, record.stream, record.failure, record.trace_id) == (2, None, None, None)


@pytest.mark.parametrize(
    "line",
    [
        GOOD,
        {},
        {**GOOD, "status_code": "200", "latency_ms": 3},
        {**GOOD, "status_code": True, "upstream_attempted": "yes", "response_source": "local"},
        {**GOOD, "model_ref": {"type": "responses_api_models", "name": "p", "extra": 1}},
        {**GOOD, "upstream_status_code": 502.0, "local_response_reason": "context_length_exceeded"},
        {**GOOD, "stream": True, "trace_id": "ab"},
    ],
)
def test_fast_path_builds_what_validation_builds(line: dict[str, Any]) -> None:
    ours = build_model_call_record(line, call_index=3)
    reference = ModelCallRecord.model_validate(
        {
            **ours.model_dump(include=set(GYM_RECORD_FIELDS)),
            **{
                key: line[key]
                for key in (
                    "model_call_id",
                    "model_ref",
                    "status_code",
                    "upstream_attempted",
                    "response_source",
                    "upstream_status_code",
                    "started_at",
                    "completed_at",
                    "error_category",
                    "latency_ttft_ms",
                )
                if key in line
            },
            **({"latency_total_ms": line["latency_ms"]} if "latency_ms" in line else {}),
            **{key: line[key] for key in EXTRA_RECORD_FIELDS if key in line},
        }
    )
    assert ours == reference
    assert ours.model_dump() == reference.model_dump()
    assert ours.model_fields_set == set(GYM_RECORD_FIELDS) | (set(EXTRA_RECORD_FIELDS) & set(line))


# --- rejected lines -----------------------------------------------------------------------------------

REJECTED = [
    pytest.param(
        _line(model_ref={"type": "resources_servers", "name": "p"}), "model_ref", id="model_ref_type"
    ),
    pytest.param(_line(response_source="cache"), "response_source", id="response_source"),
    pytest.param(_line(status_code=200.5), "status_code", id="status_code_fraction"),
    pytest.param(_line(started_at="2026-01-01T00:00:00Z"), "started_at", id="started_at_iso"),
    pytest.param(_line(error_category=5), "error_category", id="error_category_not_str"),
    pytest.param(_line(latency_ms="fast"), "latency_ms", id="latency_ms_on_disk_name"),
    pytest.param(b"[1, 2]\n", "not a JSON object", id="json_array"),
    pytest.param(b'"text"\n', "not a JSON object", id="json_string"),
    pytest.param(b'{"model_call_id": "x", \n', "invalid JSON", id="broken_json"),
    pytest.param(_line(response={"choices": [{"message": {"tool_calls": 7}}]}), "TypeError", id="derivation"),
]


@pytest.mark.parametrize(("bad", "reason"), REJECTED)
def test_strict_reader_raises_at_the_damaged_line(store: CaptureStore, bad: bytes, reason: str) -> None:
    path = _write(store, "r", _line() + b"\n" + bad + _line())
    with pytest.raises(CaptureReadError) as info:
        read_model_call_records(store, "r")
    assert isinstance(info.value, ValueError)
    assert (info.value.path, info.value.line_number) == (path, 3)
    assert reason in info.value.reason
    assert str(info.value).startswith(f"{path}: damaged line 3: ")
    with pytest.raises(CaptureReadError):
        aggregate_model_call_metrics(store, "r")


@pytest.mark.parametrize(("bad", "reason"), REJECTED)
def test_tolerant_reader_reports_the_damaged_line(store: CaptureStore, bad: bytes, reason: str) -> None:
    _write(store, "r", _line() + b"\n" + bad + _line())
    available = read_available_model_call_records(store, "r")
    assert [record.call_index for record in available.records] == [0, 2]  # Gym's gap at the damaged line
    [invalid] = available.invalid
    assert invalid.line_number == 3 and reason in invalid.reason
    assert invalid.raw.startswith(bad.strip().decode()[:200])
    assert (available.torn_tail, available.incomplete, available.damaged) == (False, False, 1)


def test_the_public_api_names_what_the_readers_raise_and_return(store: CaptureStore) -> None:
    _write(store, "r", _line() + b"{not json\n")
    with pytest.raises(otel_capture.CaptureReadError):
        otel_capture.read_model_call_records(store, "r")
    available = otel_capture.read_available_model_call_records(store, "r")
    assert isinstance(available, otel_capture.AvailableRecords)
    assert [type(line) for line in available.invalid] == [otel_capture.InvalidLine]


def test_validation_error_comes_from_pydantic() -> None:
    with pytest.raises(ValidationError):
        build_model_call_record({"response_source": "cache"}, call_index=0)


def test_long_damaged_lines_are_cut_in_the_report(store: CaptureStore) -> None:
    _write(store, "r", b"{" + b"x" * 10_000 + b"\n")
    [invalid] = read_available_model_call_records(store, "r").invalid
    assert len(invalid.raw) < 400 and invalid.raw.endswith("(10001 bytes)")


# --- file shape: blanks, torn tail, marker, ids -------------------------------------------------------


def test_blank_lines_are_skipped_and_do_not_count(store: CaptureStore) -> None:
    _write(store, "r", b"\n  \n" + _line() + b"\r\n\t\n" + _line(model_call_id="b") + b"\n")
    records = read_model_call_records(store, "r")
    assert [(r.call_index, r.model_call_id) for r in records] == [(0, "a" * 32), (1, "b")]


def test_torn_final_line_is_reported_and_never_parsed(store: CaptureStore) -> None:
    torn = _line(model_call_id="torn").rstrip(b"\n")  # valid JSON, but the newline never made it
    path = _write(store, "r", _line() + torn)
    with pytest.raises(CaptureReadError) as info:
        read_model_call_records(store, "r")
    assert (info.value.path, info.value.line_number) == (path, 2) and "torn" in info.value.reason
    available = read_available_model_call_records(store, "r")
    assert [record.model_call_id for record in available.records] == ["a" * 32]
    assert available.torn_tail and available.invalid == [] and available.damaged == 1
    assert available.torn_tail_line is not None and available.torn_tail_line.line_number == 2
    assert "torn" in available.torn_tail_line.raw


def test_whitespace_after_the_last_newline_is_not_a_torn_line(store: CaptureStore) -> None:
    _write(store, "r", _line() + b"  ")
    assert len(read_model_call_records(store, "r")) == 1
    assert not read_available_model_call_records(store, "r").torn_tail


def test_incomplete_marker_is_reported(store: CaptureStore) -> None:
    _write(store, "r", _line())
    store.incomplete_path("r").touch()
    available = read_available_model_call_records(store, "r")
    assert available.incomplete and len(available.records) == 1
    store.data_path("r").unlink()
    assert read_available_model_call_records(store, "r") == AvailableRecords(records=[], incomplete=True)


def test_missing_file_reads_as_no_calls(store: CaptureStore) -> None:
    assert read_model_call_records(store, "nothing") == []
    assert read_available_model_call_records(store, "nothing") == AvailableRecords(records=[])
    assert aggregate_model_call_metrics(store, "nothing")["num_calls"] == 0
    assert not store.root.exists() or list(store.root.iterdir()) == []


@pytest.mark.parametrize("rollout_id", ["", ".hidden", "a/b", "../x", "bad id"])
def test_invalid_rollout_id_raises_value_error(store: CaptureStore, rollout_id: str) -> None:
    with pytest.raises(ValueError, match="rollout id"):
        read_model_call_records(store, rollout_id)
    with pytest.raises(ValueError, match="rollout id"):
        read_available_model_call_records(store, rollout_id)
    with pytest.raises(ValueError, match="rollout id"):
        aggregate_model_call_metrics(store, rollout_id)


def test_reader_waits_for_a_writers_exclusive_lock(store: CaptureStore) -> None:
    path = _write(store, "r", _line())
    result: list[int] = []
    with path.open("ab") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        reader = threading.Thread(target=lambda: result.append(len(read_model_call_records(store, "r"))))
        reader.start()
        writer.write(_line(model_call_id="second"))
        writer.flush()
        reader.join(timeout=0.3)
        assert reader.is_alive() and result == []  # blocked on LOCK_SH while the append is in progress
        fcntl.flock(writer.fileno(), fcntl.LOCK_UN)
    reader.join(timeout=10)
    assert result == [2]


def test_the_garbage_collector_is_restored(store: CaptureStore) -> None:
    _write(store, "r", _line() + b"[]\n")
    assert gc.isenabled()
    read_available_model_call_records(store, "r")
    assert gc.isenabled()
    with pytest.raises(CaptureReadError):
        read_model_call_records(store, "r")
    assert gc.isenabled()
    gc.disable()
    try:
        read_available_model_call_records(store, "r")
        assert not gc.isenabled()
    finally:
        gc.enable()


# --- a freeze hands out the readers' records ----------------------------------------------------------


def test_a_freeze_returns_the_records_the_tolerant_reader_returns(store: CaptureStore) -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 4}
    _write(
        store,
        "r",
        _line(response={"usage": usage}) + b"{damaged\n" + _line(model_call_id="b", status_code="x"),
    )
    _write(store, "r", store.data_path("r").read_bytes() + _line(model_call_id="c"))
    available = read_available_model_call_records(store, "r")
    snapshot = store.freeze_now("r")
    assert snapshot.records == tuple(available.records)
    assert all(isinstance(record, ModelCallRecord) for record in snapshot.records)
    assert [(r.model_call_id, r.call_index) for r in snapshot.records] == [("a" * 32, 0), ("c", 3)]
    assert snapshot.records[0].tokens_in == 3  # derived, as the readers derive it
    assert [call.reason for call in snapshot.incomplete_calls] == [
        "r.capture.jsonl: damaged line 2",
        "r.capture.jsonl: damaged line 3",  # valid JSON, but not a record
    ]


def test_the_in_memory_backend_freezes_to_the_same_records() -> None:
    backend = otel_capture.conformance.InMemoryCaptureBackend()
    backend.append_now("r", "a", {"dialect": "chat", "response": {"usage": {"input_tokens": 5}}})
    backend.append_now("r", "b", {"status_code": "not a status"})
    snapshot = backend.freeze_now("r")
    assert [(r.model_call_id, r.call_index, r.tokens_in) for r in snapshot.records] == [("a", 0, 5)]
    assert [(c.model_call_id, c.reason) for c in snapshot.incomplete_calls] == [("b", "damaged line 2")]
