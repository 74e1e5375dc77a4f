"""The declared weight version (store, writer, CLI) and the caller's and engine's versions of a call."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from support import submit

from otel_capture import CaptureStore, read_model_call_records
from otel_capture._capture.weight import (
    caller_weight_version,
    engine_weight_version,
    without_weight_version_header,
)
from otel_capture._cli.main import main
from otel_capture._records import encode_record_line
from otel_capture._records.codec import stamp_record_line
from otel_capture._store import DamagedEntryError, DeclaredVersions, JsonlWriter


def _line(model_call_id: str = "a" * 32, **values: Any) -> bytes:
    return encode_record_line(
        {"model_call_id": model_call_id, "dialect": "chat", "started_at": 1.0, "completed_at": 2.0, **values}
    )


# --- declaring -------------------------------------------------------------------------------------------


def test_declarations_are_durable_and_every_view_reads_the_version_in_force_at_a_time(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    assert store.weight_version() is None
    before = time.time()
    store.set_weight_version("7")
    between = time.time()
    CaptureStore(tmp_path).set_weight_version(8)  # another store object; an int is its decimal text
    view = DeclaredVersions(tmp_path)  # a fresh view, as another process has
    view.refresh()
    assert view.current == "8" and store.weight_version() == "8"
    assert (view.at(before - 1), view.at(between), view.at(time.time()), view.at(None)) == (
        None,
        "7",
        "8",
        None,
    )
    lines = (tmp_path / ".otel-capture" / "weight_versions").read_bytes().splitlines()
    assert [orjson.loads(line)["version"] for line in lines] == ["7", "8"]


@pytest.mark.parametrize("bad", ["", " 7", "7\n", "x" * 201, "\x00"])
def test_an_unusable_version_is_refused_and_nothing_is_written(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid weight version"):
        CaptureStore(tmp_path).set_weight_version(bad)
    with pytest.raises(TypeError):
        CaptureStore(tmp_path).set_weight_version(None)  # type: ignore[arg-type]
    assert not (tmp_path / ".otel-capture" / "weight_versions").exists()


def test_a_damaged_or_torn_declaration_is_skipped_and_the_next_one_read(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.set_weight_version("7")
    path = tmp_path / ".otel-capture" / "weight_versions"
    with path.open("ab") as handle:
        handle.write(b'{"version": 3}\n{"version": "torn", "at"')  # a damaged line, then a torn one
    store.set_weight_version("9")  # terminates the torn line first
    view = DeclaredVersions(tmp_path)
    view.refresh()
    assert view.current == "9" and len(path.read_bytes().splitlines()) == 4


def test_a_link_planted_as_the_declarations_file_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("")
    capture = tmp_path / "calls"
    (capture / ".otel-capture").mkdir(parents=True)
    os.symlink(outside, capture / ".otel-capture" / "weight_versions")
    with pytest.raises(DamagedEntryError):
        CaptureStore(capture).set_weight_version("7")
    assert outside.read_text() == ""
    assert CaptureStore(capture).weight_version() is None  # logged, not read


# --- the writer stamps each line in its batch --------------------------------------------------------------


def test_the_writer_stamps_the_versions_in_force_at_the_calls_start_and_end(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path)
    store.set_weight_version("7")
    started = time.time()
    store.set_weight_version("8")  # the weights changed while the call ran
    finished = time.time()
    writer = JsonlWriter(tmp_path)
    try:
        futures = [
            submit(writer, "r", _line("1" * 32), "1" * 32, weight=(None, started, finished)),
            submit(
                writer, "r", _line("2" * 32, weight_version="5"), "2" * 32, weight=("5", started, finished)
            ),
            submit(writer, "r", _line("3" * 32), "3" * 32, weight=(None, finished, finished)),
            submit(writer, "r", _line("4" * 32), "4" * 32),  # no stamp asked: written as it is
        ]
        for future in futures:
            future.result(10)
    finally:
        writer.close()
    records = read_model_call_records(store, "r")
    assert [(r.weight_version, r.weight_version_at_end) for r in records] == [
        ("7", "8"),
        ("5", "8"),  # the caller's version, and the weights still changed while it ran
        ("8", None),
        (None, None),
    ]


def test_a_stamped_line_keeps_its_bytes_and_gains_its_keys_last() -> None:
    line = _line(request=orjson.Fragment(b'{"model": "m",  "n": 1.0}'))
    stamped = stamp_record_line(line, {"weight_version": "7", "weight_version_at_end": "8"})
    assert stamped == line[:-2] + b',"weight_version":"7","weight_version_at_end":"8"}\n'
    assert b'"n": 1.0' in stamped  # the body as sent
    assert stamp_record_line(line, {}) is line
    with pytest.raises(KeyError):
        stamp_record_line(line, {"model": "x"})


# --- the caller's and the engine's versions ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-weight-version": [b" 12 "]}, "12"),
        ({"baggage": [b"rollout.id=r, weight.version=v%2011;p=1"]}, "v 11"),
        ({"x-weight-version": [b"3"], "baggage": [b"weight.version=4"]}, "3"),  # the header wins
        ({"x-weight-version": [b"3", b"4"]}, None),  # which one? ignored, with a warning
        ({"x-weight-version": [b""]}, None),
        ({"baggage": [b"weight.version=" + b"x" * 300]}, None),
        ({}, None),
    ],
)
def test_the_callers_version(headers: dict[str, list[bytes]], expected: str | None) -> None:
    assert caller_weight_version(headers) == expected


def test_the_header_is_removed_before_forwarding_and_nothing_else_is() -> None:
    scope = {
        "headers": [(b"X-Weight-Version", b"7"), (b"x-rollout-id", b"r"), (b"baggage", b"weight.version=7")]
    }
    assert without_weight_version_header(scope)["headers"] == scope["headers"][1:]
    plain = {"headers": [(b"a", b"b")]}
    assert without_weight_version_header(plain) is plain


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ({"text": "x", "meta_info": {"weight_version": "default"}}, "default"),  # SGLang's native answer
        ({"choices": [], "metadata": {"weight_version": 12}}, "12"),  # SGLang's OpenAI-compatible answer
        ({"metadata": {"model_version": "v3"}}, "v3"),
        ({"weight_version": 4}, "4"),
        ({"metadata": {"weight_version": True}}, None),
        ({"metadata": "7"}, None),
        (None, None),
    ],
)
def test_the_engines_version(response: dict[str, Any] | None, expected: str | None) -> None:
    assert engine_weight_version(response) == expected


# --- the command ------------------------------------------------------------------------------------------


def test_the_weight_version_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["weight-version", str(tmp_path)]) == 1
    assert "no weight version declared" in capsys.readouterr().err
    assert main(["weight-version", str(tmp_path), "42"]) == 0
    assert main(["weight-version", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "42\n"
    assert main(["weight-version", str(tmp_path), " bad"]) == 1
    assert "invalid weight version" in capsys.readouterr().err
    assert main(["weight-version", str(tmp_path / "missing"), "1"]) == 1
    assert not (tmp_path / "missing").exists()
