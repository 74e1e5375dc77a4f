"""Weight-version declarations against a hostile or unlucky directory (issue 30, item 6): a declarations file
that holds megabytes without a newline is read once, not at every batch; the version in force is the last
one written, whatever its date; the caller's ``x-weight-version`` is read as UTF-8; declaring creates the
capture directory as a writer would."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from support import submit

from otel_capture import CaptureStore, read_model_call_records
from otel_capture._capture.weight import caller_weight_version
from otel_capture._cli.main import main
from otel_capture._records import encode_record_line
from otel_capture._store import DeclaredVersions, JsonlWriter
from otel_capture._store.dirstate import dir_state
from otel_capture._store.weight import declare

GARBAGE = 20 * 1024 * 1024


def _bytes_read() -> int:
    """Bytes this process has read through read-like system calls so far (``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _line(model_call_id: str) -> bytes:
    return encode_record_line(
        {"model_call_id": model_call_id, "dialect": "chat", "started_at": 1.0, "completed_at": 2.0}
    )


def _plant_garbage(root: Path) -> Path:
    path = root / ".otel-capture" / "weight_versions"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        for _ in range(GARBAGE // (1 << 20)):
            handle.write(b"x" * (1 << 20))  # 20 MB, and never a newline
    return path


def test_megabytes_without_a_newline_are_read_once_not_at_every_batch(tmp_path: Path) -> None:
    _plant_garbage(tmp_path)
    view = DeclaredVersions(tmp_path)
    view.refresh()  # reads what is there once
    before = _bytes_read()
    for _ in range(20):
        view.refresh()
    assert _bytes_read() - before < GARBAGE // 10  # not 20 x 20 MB: nothing new, nothing read
    assert view.current is None

    writer = JsonlWriter(tmp_path)
    try:
        submit(writer, "r", _line("0" * 32), "0" * 32, weight=(None, time.time(), time.time())).result(60)
        before = _bytes_read()
        for n in range(1, 11):  # ten batches, each refreshing the view
            mcid = str(n) * 32
            submit(writer, "r", _line(mcid), mcid, weight=(None, time.time(), time.time())).result(60)
        assert _bytes_read() - before < GARBAGE // 10
        CaptureStore(tmp_path).set_weight_version("9")  # terminates the damaged line, then declares
        submit(writer, "r", _line("b" * 32), "b" * 32, weight=(None, time.time(), time.time())).result(60)
    finally:
        writer.close()
    assert read_model_call_records(CaptureStore(tmp_path), "r")[-1].weight_version == "9"
    assert CaptureStore(tmp_path).weight_version() == "9"


def test_the_version_in_force_is_the_last_one_written_whatever_its_date(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = CaptureStore(tmp_path)
    with dir_state(tmp_path).dirs(lock_timeout=10) as dirs:
        declare(dirs, "future", os.fsync, at=time.time() + 3600)  # a node whose clock runs an hour ahead
    store.set_weight_version("now")
    assert store.weight_version() == "now"
    assert main(["weight-version", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "now\n"
    view = DeclaredVersions(tmp_path)
    view.refresh()
    assert view.current == "now"
    assert view.at(time.time()) == "now" and view.at(time.time() + 7200) == "now"

    writer = JsonlWriter(tmp_path)
    try:
        submit(writer, "r", _line("1" * 32), "1" * 32, weight=(None, time.time(), time.time())).result(60)
    finally:
        writer.close()
    assert read_model_call_records(store, "r")[0].weight_version == "now"


def test_a_utf8_weight_version_header_is_read_as_utf8() -> None:
    assert caller_weight_version({"x-weight-version": ["vé".encode()]}) == "vé"
    assert caller_weight_version({"x-weight-version": ["步骤-7".encode()]}) == "步骤-7"
    assert caller_weight_version({"x-weight-version": [b"\xff\xfe"]}) is None  # not UTF-8: ignored


def test_declaring_before_the_directory_exists_creates_it_as_a_writer_would(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "runs" / "calls"
    assert main(["weight-version", str(root), "7"]) == 0, capsys.readouterr().err
    assert stat.S_IMODE(root.stat().st_mode) == 0o700  # private, as the writer makes it (contract D26)
    assert main(["weight-version", str(root)]) == 0
    assert capsys.readouterr().out == "7\n"
    writer = JsonlWriter(root)
    try:
        submit(writer, "r", _line("1" * 32), "1" * 32, weight=(None, time.time(), time.time())).result(60)
    finally:
        writer.close()
    assert read_model_call_records(CaptureStore(root), "r")[0].weight_version == "7"
    assert main(["weight-version", str(tmp_path / "missing")]) == 1  # reading creates nothing
    assert not (tmp_path / "missing").exists()
    shared = tmp_path / "open-to-all"
    shared.mkdir()
    shared.chmod(0o777)  # a directory others can write is refused, as the writer refuses it
    assert main(["weight-version", str(shared), "7"]) == 1
    assert not (shared / ".otel-capture").exists()
