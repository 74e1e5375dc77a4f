"""The show tables: aligned columns, shortened model paths, '-' for unknowns, per-rollout sums."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from otel_capture import ModelCallRecord, aggregate_model_call_metrics
from otel_capture._cli.show import format_calls_table, format_rollouts_table, short_model
from otel_capture._store.store import CaptureStore


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
    ]
    assert lines[2].split()[1] == "responses"
    assert lines[2].split()[4] == "1234"
    assert lines[2].split()[7] == "-"  # no TTFT
    assert lines[3].split()[-1] == "timeout"
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
    store = CaptureStore(tmp_path)
    store.data_path("r-0").write_text("")
    store.data_path("r-1").write_text("")
    store.incomplete_path("r-1").write_text("")
    records = {
        "r-0": [record(), record(call_index=1, tokens_in=7, tokens_out=3)],
        "r-1": [record(status_code=500, error_category="upstream_error", tokens_in=None, tokens_out=None)],
    }
    table = format_rollouts_table(store, read_records=lambda _store, rid: records[rid])
    lines = [line.split() for line in table.splitlines()]
    assert lines == [
        ["rollout", "calls", "errors", "tokens", "in", "tokens", "out", "incomplete"],
        ["r-0", "2", "0", "20", "19", "no"],
        ["r-1", "1", "1", "0", "0", "yes"],
    ]


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
    errors = format_rollouts_table(store).splitlines()[1].split()[2]
    assert errors == "4"
    assert aggregate_model_call_metrics(store, "r-0")["num_errors"] == 4
