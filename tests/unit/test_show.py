"""The show tables: aligned columns, shortened model paths, '-' for unknowns, per-rollout sums."""

from __future__ import annotations

import io
import json
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest

from otel_capture import ModelCallRecord, aggregate_model_call_metrics, read_available_model_call_records
from otel_capture._cli.main import main
from otel_capture._cli.show import format_calls_table, format_rollouts_table, short_model
from otel_capture._records import InvalidLine, codec
from otel_capture._store import CaptureStore
from otel_capture._store import lines as store_module


def record(**fields: Any) -> ModelCallRecord:
    base: dict[str, Any] = {
        "call_index": 0,
        "dialect": "chat",
        "model": "/root/.cache/otel-capture/gemma-3-270m-q4_k_m.gguf",
        "status_code": 200,
        "tokens_in": 13,
        "tokens_out": 16,
        "latency_total_ms": 212.345,
        "latency_ttft_ms": 31.0,
        "error_category": None,
        "finish_reason": "length",
    }
    return ModelCallRecord(**{**base, **fields})


def test_calls_table_has_a_header_and_one_aligned_line_per_call() -> None:
    table = format_calls_table(
        [
            record(),
            record(call_index=1, dialect="responses", tokens_in=1234, latency_ttft_ms=None),
            record(
                call_index=2, dialect="messages", status_code=504, tokens_out=None, error_category="timeout"
            ),
        ]
    )
    lines = table.splitlines()
    assert lines[0].split() == [
        "#",
        "dialect",
        "model",
        "status",
        "tokens",
        "in",
        "tokens",
        "out",
        "latency",
        "ms",
        "ttft",
        "ms",
        "error",
        "weight",
    ]
    assert lines[1].split() == [
        "0",
        "chat",
        "gemma-3-270m-q4_k_m.gguf",
        "200",
        "13",
        "16",
        "212.3",
        "31.0",
        "-",
        "-",
    ]
    assert lines[2].split()[1] == "responses"
    assert lines[2].split()[4] == "1234"
    assert lines[2].split()[7] == "-"  # no TTFT
    assert lines[3].split()[-2] == "timeout"
    assert lines[3].split()[5] == "-"  # no output tokens
    # Numbers are right-aligned: the tokens-in column ends at the same place on every line.
    end = lines[0].index("tokens in") + len("tokens in")
    assert [line[end - 2 : end] for line in lines[1:]] == ["13", "34", "13"]


def test_calls_table_of_no_calls_is_just_the_header() -> None:
    assert format_calls_table([]).splitlines() == [format_calls_table([])]


def test_short_model_keeps_only_the_file_name_of_paths() -> None:
    assert short_model("/tmp/x/gemma.gguf") == "gemma.gguf"
    assert short_model("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert short_model("gpt-4o") == "gpt-4o"
    assert short_model(None) == "-"


def test_rollouts_table_sums_each_rollout_and_flags_incomplete(tmp_path: Path) -> None:
    # ls gained latency and damage columns (issue 33, item 12 and 8): the first columns are as before
    store = CaptureStore(tmp_path)
    store.data_path("r-0").write_text("")
    store.data_path("r-1").write_text("")
    store.incomplete_path("r-1").write_text("")
    records = {
        "r-0": [record(), record(call_index=1, tokens_in=7, tokens_out=3, latency_total_ms=100.0)],
        "r-1": [record(status_code=500, error_category="upstream_error", tokens_in=None, tokens_out=None)],
    }
    table = format_rollouts_table(store, read_records=lambda _store, rid: records[rid])
    lines = [line.split() for line in table.splitlines()]
    assert lines == [
        [
            "rollout",
            "state",
            "calls",
            "errors",
            "tokens",
            "in",
            "tokens",
            "out",
            "model",
            "s",
            "p50",
            "ms",
            "max",
            "ms",
            "ttft",
            "ms",
            "refused",
            "incomplete",
            "damaged",
        ],
        ["r-0", "live", "2", "0", "20", "19", "0.31", "156.2", "212.3", "31.0", "0", "no", "-"],
        ["r-1", "live", "1", "1", "0", "0", "0.21", "212.3", "212.3", "31.0", "0", "yes", "-"],
    ]


def test_rollouts_table_marks_unknown_tokens_and_damaged_lines(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    for rid in ("some", "none"):
        store.data_path(rid).write_text("")
    no_usage = record(call_index=1, tokens_in=None, tokens_out=None, stream=True, latency_ttft_ms=11.0)
    items: dict[str, list[Any]] = {
        "some": [record(stream=False), InvalidLine(2, "invalid JSON", "{"), no_usage],
        "none": [no_usage],
    }
    table = format_rollouts_table(store, read_records=lambda _store, rid: items[rid])
    _, none, some = (line.split() for line in table.splitlines())
    assert none[:6] == ["none", "live", "1", "0", "?", "?"]  # unknown, not zero
    assert some[:6] == ["some", "live", "2", "0", "13+?", "16+?"]
    assert some[9] == "11.0"  # the mean TTFT of the streamed calls only
    assert some[-2:] == ["1", "line"] and none[-1] == "-"


def test_show_counts_as_errors_exactly_the_calls_num_errors_counts(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    lines = [
        {"status_code": 200},
        {"status_code": 307},  # a redirect is not a failed model call
        {"status_code": None},  # no status alone is not one either
        {"status_code": 200, "response": {"status": "failed", "output": []}},
        {"status_code": 200, "error_category": "stream_truncated"},
        {"status_code": 422, "error_category": "client_error"},
        {"status_code": 500},
    ]
    store.data_path("r-0").write_text("".join(json.dumps(line) + "\n" for line in lines))
    errors = format_rollouts_table(store).splitlines()[1].split()[3]
    assert errors == "4"
    assert aggregate_model_call_metrics(store, "r-0")["num_errors"] == 4


# --- otel-capture show DIR ID prints as it reads (issue 15, item 10) -----------------------------------

FIXTURE = Path(__file__).parents[1] / "fixtures" / "nemo_gym" / "gym_server_0-0.capture.jsonl"
FIXTURE_TABLE = """\
#  dialect    model        status  tokens in  tokens out  latency ms  ttft ms  error         weight
0  responses  fake-model      200         20          12        45.2     45.1  -             -
1  responses  fake-model      200         20          12         4.0      2.4  -             -
2  chat       fake-model      200         30           7         5.1      5.0  -             -
3  chat       fake-model      200         30           7         3.7      1.6  -             -
4  messages   claude-fake     200         20          12        12.9      9.6  -             -
5  responses  -               422          -           -         1.0      0.9  client_error  -
"""


def _show(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(["show", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_show_prints_nemo_gyms_fixture_exactly_as_before(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "gym.capture.jsonl").write_bytes(FIXTURE.read_bytes())
    assert _show(capsys, str(tmp_path), "gym") == (0, FIXTURE_TABLE, "")
    code, out, _ = _show(capsys, str(tmp_path), "gym", "--trace-url", "http://j:16686")
    assert code == 0 and out.splitlines()[0] == FIXTURE_TABLE.splitlines()[0] + "  trace"


def test_show_of_a_long_rollout_is_what_sizing_from_every_row_gives(tmp_path: Path, capsys: Any) -> None:
    lines = [line for line in FIXTURE.read_bytes().splitlines() if line.strip()]
    body = [lines[i % len(lines)] for i in range(2500)]  # past the 1,000-row sample
    body.insert(700, b"not json")  # reported after the table, as before
    body.insert(900, b"")  # blank: no call_index
    (tmp_path / "long.capture.jsonl").write_bytes(b"\n".join(body) + b"\n")
    store = CaptureStore(tmp_path)
    every_row = format_calls_table(read_available_model_call_records(store, "long").records)
    code, out, err = _show(capsys, str(tmp_path), "long")
    assert code == 1 and out == every_row + "\n"
    assert out.splitlines()[-1].startswith("2500  ")  # the '#' column is sized from the last line
    assert err.startswith("1 damaged line(s):\n  line 701: invalid JSON: ") and err.count("\n") == 2


def test_show_holds_one_record_at_a_time_not_the_rollout(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [line for line in FIXTURE.read_bytes().splitlines() if line.strip()]
    (tmp_path / "r.capture.jsonl").write_bytes(b"".join(lines[i % len(lines)] + b"\n" for i in range(60)))
    made: list[weakref.ref[ModelCallRecord]] = []
    build = codec.build_model_call_record

    def tracked(*args: Any, **kwargs: Any) -> ModelCallRecord:
        record = build(*args, **kwargs)
        made.append(weakref.ref(record))
        return record

    alive: list[int] = []

    class Counting(io.StringIO):
        def write(self, text: str) -> int:
            alive.append(sum(ref() is not None for ref in made))
            return super().write(text)

    monkeypatch.setattr(codec, "build_model_call_record", tracked)
    monkeypatch.setattr(sys, "stdout", Counting())
    assert main(["show", str(tmp_path), "r"]) == 0
    assert len(sys.stdout.getvalue().splitlines()) == 61  # type: ignore[attr-defined]  # our Counting
    assert len(made) == 60 and max(alive) <= 1  # the whole table at once held all 60


def test_show_reads_the_lines_the_file_held_under_its_lock_chunk_by_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "STREAM_CHUNK", 7)  # lines longer than a chunk, and cut anywhere
    store = CaptureStore(tmp_path)
    lines = [b'{"model_call_id": "a-long-one"}', b"", b"x", b'{"model_call_id": "b"}']
    store.data_path("r").write_bytes(b"\n".join(lines) + b"\n" + b'{"torn')
    streamed = store.stream_lines("r")
    assert streamed is not None and streamed.count == 4
    with store.data_path("r").open("ab") as late:  # appended after the lock was let go: not read
        late.write(b'": 1}\n{"model_call_id": "c"}\n')
    assert list(streamed) == lines
    assert store.stream_lines("absent") is None
