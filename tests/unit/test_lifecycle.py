"""The capture lifecycle (docs/lifecycle.md): every transition and error of the state diagram, for both record
families (model-call records and token lines), through the file store and the in-memory backend; then
what only the file store can get wrong (fsyncs, phase order, locks, damage)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import submit

from otel_capture import (
    CaptureFrozenError,
    CaptureRetiredError,
    CaptureStateError,
    CaptureStore,
    InvalidRolloutIdError,
)
from otel_capture._capture import LoopWaiter
from otel_capture._store import JsonlWriter
from otel_capture._store.dirstate import STATE_DIR, dir_state
from otel_capture._store.inflight import InflightMarkers
from otel_capture._store.journal import FenceJournal
from otel_capture.conformance import InMemoryCaptureBackend

TOKENS = {"prompt_token_ids": [1, 2, 3], "generations": [{"index": 0, "token_ids": [7], "log_probs": [-0.5]}]}


@pytest.fixture(params=["file", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "file":
        return CaptureStore(tmp_path / "calls")
    return InMemoryCaptureBackend()


def _write(backend: Any, rid: str, mcid: str = "c1") -> None:
    backend.append_now(rid, mcid, {"dialect": "chat"}, TOKENS)


# --- Absent ------------------------------------------------------------------------------------------


def test_absent_first_write_makes_it_live_with_both_families(backend: Any) -> None:
    assert backend.rollout_state("r") == "absent"
    _write(backend, "r")
    assert backend.rollout_state("r") == "live"
    snap = backend.freeze_now("r")
    assert [r.model_call_id for r in snap.records] == ["c1"]
    assert [t["model_call_id"] for t in snap.tokens] == ["c1"] and snap.tokens[0]["prompt_token_ids"] == [
        1,
        2,
        3,
    ]
    assert snap.version == 2 and not snap.incomplete


def test_absent_freeze_fences_an_empty_snapshot(backend: Any) -> None:
    snap = backend.freeze_now("r")
    assert (snap.records, snap.tokens, snap.incomplete) == ((), (), False)
    assert backend.rollout_state("r") == "frozen"
    with pytest.raises(CaptureFrozenError):
        _write(backend, "r")


def test_absent_retire_fences_and_reports_absent(backend: Any) -> None:
    assert backend.retire_now(["r"]) == {"removed": [], "absent": ["r"], "failed": {}}
    assert backend.rollout_state("r") == "retired"


def test_absent_delete_and_drop_change_nothing(backend: Any) -> None:
    assert backend.delete_now(["r"]) == {"removed": [], "absent": ["r"], "failed": {}}
    assert backend.drop_now("r", snapshot_id="s", version=0) is False
    assert backend.rollout_state("r") == "absent"


def test_absent_mark_incomplete_and_begin_call_make_it_live(backend: Any) -> None:
    backend.mark_incomplete("a", "c9", "the upstream died")
    backend.begin_call("b", "c1")
    assert backend.rollout_state("a") == "live" and backend.rollout_state("b") == "live"


# --- Live --------------------------------------------------------------------------------------------


def test_live_freeze_then_writes_are_refused_with_the_frozen_error(backend: Any) -> None:
    _write(backend, "r")
    snap = backend.freeze_now("r")
    with pytest.raises(CaptureFrozenError) as late:
        _write(backend, "r", "c2")
    assert type(late.value) is CaptureFrozenError
    with pytest.raises(CaptureFrozenError):
        backend.begin_call("r", "c3")
    assert backend.freeze_now("r") == snap  # idempotent, and nothing got in


def test_live_retire_removes_both_families_and_keeps_a_fence(backend: Any) -> None:
    _write(backend, "r")
    assert backend.retire_now(["r"]) == {"removed": ["r"], "absent": [], "failed": {}}
    assert backend.rollout_state("r") == "retired"
    if isinstance(backend, CaptureStore):
        assert not backend.data_path("r").exists() and not backend.tokens_path("r").exists()


def test_live_delete_makes_it_absent(backend: Any) -> None:
    _write(backend, "r")
    assert backend.delete_now(["r"])["removed"] == ["r"]
    assert backend.rollout_state("r") == "absent"
    _write(backend, "r", "c2")
    assert [r.model_call_id for r in backend.freeze_now("r").records] == ["c2"]


def test_live_drop_is_false(backend: Any) -> None:
    _write(backend, "r")
    assert backend.drop_now("r", snapshot_id="x", version=2) is False
    assert backend.rollout_state("r") == "live"


# --- Frozen ------------------------------------------------------------------------------------------


def test_frozen_drop_needs_the_exact_snapshot(backend: Any) -> None:
    _write(backend, "r")
    snap = backend.freeze_now("r")
    assert not backend.drop_now("r", snapshot_id="other", version=snap.version)
    assert not backend.drop_now("r", snapshot_id=snap.snapshot_id, version=snap.version + 1)
    assert backend.rollout_state("r") == "frozen"
    assert backend.drop_now("r", snapshot_id=snap.snapshot_id, version=snap.version)
    assert backend.rollout_state("r") == "retired"
    assert backend.drop_now("r", snapshot_id=snap.snapshot_id, version=snap.version)  # idempotent
    with pytest.raises(CaptureRetiredError):
        _write(backend, "r", "c2")


def test_frozen_mark_incomplete_is_accepted_and_stales_the_snapshot(backend: Any) -> None:
    _write(backend, "r")
    snap = backend.freeze_now("r")
    backend.mark_incomplete("r", "c2", "disk full")
    again = backend.freeze_now("r")
    assert again.snapshot_id == snap.snapshot_id and again.version == snap.version + 1
    assert again.incomplete and ("c2", "disk full") in [
        (c.model_call_id, c.reason) for c in again.incomplete_calls
    ]
    assert not backend.drop_now("r", snapshot_id=snap.snapshot_id, version=snap.version)


def test_frozen_retire_and_delete(backend: Any) -> None:
    _write(backend, "a")
    _write(backend, "b")
    snap = backend.freeze_now("a")
    backend.freeze_now("b")
    assert backend.retire_now(["a"])["removed"] == ["a"]
    assert backend.drop_now("a", snapshot_id=snap.snapshot_id, version=snap.version)  # retired as consumed
    assert backend.delete_now(["b"])["removed"] == ["b"]
    assert backend.rollout_state("b") == "absent"


def test_a_call_in_flight_at_freeze_makes_the_snapshot_incomplete_and_says_why(backend: Any) -> None:
    backend.begin_call("r", "slow")
    backend.begin_call("r", "fast")
    backend.append_now("r", "fast", {})
    snap = backend.freeze_now("r")
    assert snap.incomplete
    assert [c.model_call_id for c in snap.incomplete_calls] == ["slow"]
    assert "in flight" in snap.incomplete_calls[0].reason
    with pytest.raises(CaptureFrozenError):
        backend.append_now("r", "slow", {})
    assert backend.freeze_now("r") == snap


# --- Retired -----------------------------------------------------------------------------------------


def test_retired_refuses_everything_but_delete_with_the_retired_error(backend: Any) -> None:
    _write(backend, "r")
    backend.retire_now(["r"])
    for action in (
        lambda: _write(backend, "r", "late"),
        lambda: backend.begin_call("r", "late"),
        lambda: backend.mark_incomplete("r", "late", "x"),
        lambda: backend.freeze_now("r"),
    ):
        with pytest.raises(CaptureRetiredError):
            action()
    assert backend.rollout_state("r") == "retired"
    assert backend.retire_now(["r"]) == {"removed": [], "absent": ["r"], "failed": {}}
    assert backend.drop_now("r", snapshot_id="x", version=0) is False
    assert backend.delete_now(["r"]) == {"removed": ["r"], "absent": [], "failed": {}}
    assert backend.rollout_state("r") == "absent"
    _write(backend, "r", "new")
    assert [r.model_call_id for r in backend.freeze_now("r").records] == ["new"]


def test_a_call_begun_before_a_delete_is_late_even_though_the_id_is_live_again(backend: Any) -> None:
    backend.begin_call("r", "old")
    backend.delete_now(["r"])
    _write(backend, "r", "new")
    with pytest.raises(CaptureRetiredError):
        backend.append_now("r", "old", {})
    snap = backend.freeze_now("r")
    assert [r.model_call_id for r in snap.records] == ["new"] and not snap.incomplete


# --- batches -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("operation", ["retire_now", "delete_now"])
def test_batches_are_validated_whole_before_anything_changes(backend: Any, operation: str) -> None:
    _write(backend, "ok")
    with pytest.raises(TypeError, match="string"):
        getattr(backend, operation)("ok")
    with pytest.raises(TypeError):
        getattr(backend, operation)(42)
    with pytest.raises(InvalidRolloutIdError):
        getattr(backend, operation)(["ok", "../etc"])
    with pytest.raises(ValueError, match="rollout id"):
        getattr(backend, operation)(["ok", ".hidden"])
    assert backend.rollout_state("ok") == "live"
    assert getattr(backend, operation)([]) == {"removed": [], "absent": [], "failed": {}}
    assert getattr(backend, operation)(["ok", "ok", "new"]) == {
        "removed": ["ok"],
        "absent": ["new"],
        "failed": {},
    }


def test_list_rollouts_reports_every_state_for_reconciliation(backend: Any) -> None:
    for rid in ("l", "f", "r"):
        _write(backend, rid)
    backend.freeze_now("f")
    backend.retire_now(["r", "never"])
    assert backend.list_rollouts() == {"f": "frozen", "l": "live", "never": "retired", "r": "retired"}
    assert backend.list_rollouts("retired") == {"never": "retired", "r": "retired"}
    with pytest.raises(ValueError, match="unknown state"):
        backend.list_rollouts("gone")


def test_async_forms_run_off_the_event_loop(backend: Any) -> None:
    _write(backend, "a")
    _write(backend, "b")

    async def main() -> None:
        loop_thread = asyncio.get_running_loop()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        snap = await backend.freeze("a")
        assert await backend.drop("a", snapshot_id=snap.snapshot_id, version=snap.version)
        assert (await backend.retire(["b"]))["removed"] == ["b"]
        assert (await backend.delete(["a", "b"]))["removed"] == ["a", "b"]
        with pytest.raises(TypeError):
            await backend.retire("a")
        task.cancel()
        assert loop_thread.is_running() and ticks > 0

    asyncio.run(main())


# --- file store: durability, fsyncs, locks -----------------------------------------------------------


class FsyncLog:
    """Counts fsyncs, file vs directory, and records the order of events with the crash hook."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.fail_dir_sync = False

    def fsync(self, fd: int) -> None:
        kind = "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"
        if kind == "dir" and self.fail_dir_sync:
            raise OSError(5, "Input/output error")
        os.fsync(fd)
        self.events.append(f"fsync-{kind}")

    def hook(self, point: str) -> None:
        self.events.append(point)

    def count(self, name: str) -> int:
        return self.events.count(name)


@pytest.fixture
def log() -> FsyncLog:
    return FsyncLog()


def _store(tmp_path: Path, log: FsyncLog) -> CaptureStore:
    return CaptureStore(tmp_path / "calls", fsync=log.fsync, crash_hook=log.hook)


def test_retire_of_a_large_batch_costs_two_fsyncs_not_one_per_rollout(tmp_path: Path, log: FsyncLog) -> None:
    store = _store(tmp_path, log)
    ids = [f"r{i}" for i in range(200)]
    for rid in ids:
        _write(store, rid)
    log.events.clear()
    # the journal was made (and its directory entry synced) ahead of need, when the directory was first used
    assert (store.root / STATE_DIR / "fences.journal").is_file()
    store.retire_now(["first"])
    assert (log.count("fsync-file"), log.count("fsync-dir")) == (1, 1)
    log.events.clear()
    result = store.retire_now(ids)
    assert result["removed"] == ids
    assert (log.count("fsync-file"), log.count("fsync-dir")) == (1, 1)
    # fences durable before any record is removed; the directory synced once after the removals
    assert log.events.index("journal_synced") < log.events.index("retire_removed_one")
    assert log.events[-2:] == ["fsync-dir", "retire_synced"]


def test_every_non_empty_retire_batch_syncs_its_fences_even_when_it_writes_none(
    tmp_path: Path, log: FsyncLog
) -> None:
    store = _store(tmp_path, log)
    store.retire_now(["r"])
    log.events.clear()
    assert store.retire_now(["r"])["absent"] == ["r"]
    assert log.count("fsync-file") == 1 and "journal_written" not in log.events
    log.events.clear()
    store.retire_now([])
    store.delete_now([])
    assert log.events == []


def test_delete_removes_records_durably_before_it_removes_the_fence(tmp_path: Path, log: FsyncLog) -> None:
    store = _store(tmp_path, log)
    _write(store, "r")
    store.freeze_now("r")
    log.events.clear()
    store.delete_now(["r"])
    assert (
        log.events.index("fsync-dir")
        < log.events.index("journal_written")
        < log.events.index("journal_synced")
    )
    assert os.listdir(store.root) == [STATE_DIR]


def test_phase_two_keeps_the_records_of_an_id_deleted_and_reused_in_between(tmp_path: Path) -> None:
    reuser = CaptureStore(tmp_path / "calls")

    def hook(point: str) -> None:
        if point == "retire_fenced":  # between the phases: another owner deletes and reuses the id
            reuser.delete_now(["r"])
            _write(reuser, "r", "new-attempt")

    store = CaptureStore(tmp_path / "calls", crash_hook=hook)
    _write(store, "r", "old-attempt")
    result = store.retire_now(["r"])
    assert result == {"removed": [], "absent": ["r"], "failed": {}}
    assert store.rollout_state("r") == "live"
    assert [r.model_call_id for r in store.freeze_now("r").records] == ["new-attempt"]


def _refuse_moving(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A disk that refuses to move (remove) one rollout's record file."""
    rename = os.rename

    def refusing(src: Any, dst: Any, **dir_fds: Any) -> None:
        if os.path.basename(src) == name:
            raise OSError(5, "Input/output error")
        rename(src, dst, **dir_fds)

    monkeypatch.setattr(os, "rename", refusing)


def test_a_rollout_that_cannot_be_removed_fails_alone_and_a_retry_finishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CaptureStore(tmp_path / "calls")
    for rid in ("a", "b", "c"):
        _write(store, rid)
    with monkeypatch.context() as patch:
        _refuse_moving(patch, "b.capture.jsonl")
        result = store.retire_now(["a", "b", "c"])
    assert result["removed"] == ["a", "c"] and result["absent"] == [] and list(result["failed"]) == ["b"]
    assert "EIO" in result["failed"]["b"]
    assert store.rollout_state("b") == "retired"  # fenced: a late write is refused
    with pytest.raises(CaptureRetiredError):
        _write(store, "b", "late")
    assert store.data_path("b").exists()  # what the failed removal left
    assert store.retire_now(["a", "b", "c"]) == {"removed": ["b"], "absent": ["a", "c"], "failed": {}}
    assert sorted(os.listdir(store.root)) == [STATE_DIR]


def test_removed_records_are_moved_aside_and_their_space_freed_in_the_background(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "calls")
    for rid in ("a", "b"):
        _write(store, rid)
    store.retire_now(["a"])
    store.delete_now(["b"])
    store.purge_trash()  # waits for nothing: whatever the background purge left is removed now
    assert os.listdir(store.root / STATE_DIR / "trash") == []
    assert sorted(os.listdir(store.root)) == [STATE_DIR]


def test_a_retire_whose_fences_cannot_be_made_durable_removes_nothing(tmp_path: Path) -> None:
    def failing(fd: int) -> None:
        raise OSError(28, "No space left on device")

    good = CaptureStore(tmp_path / "calls")
    _write(good, "r")
    with pytest.raises(OSError, match="No space"):
        CaptureStore(tmp_path / "calls", fsync=failing).retire_now(["r"])
    assert good.data_path("r").exists() and good.tokens_path("r").exists()


def test_a_sync_failure_after_an_error_is_logged_and_never_hides_the_error(
    tmp_path: Path, log: FsyncLog, caplog: pytest.LogCaptureFixture
) -> None:
    class Interrupted(Exception):
        pass

    def hook(point: str) -> None:
        if point == "retire_removed_one":
            log.fail_dir_sync = True
            raise Interrupted("stopped part way")

    store = CaptureStore(tmp_path / "calls", fsync=log.fsync, crash_hook=hook)
    _write(store, "a")
    _write(store, "b")
    with caplog.at_level(logging.ERROR), pytest.raises(Interrupted):
        store.retire_now(["a", "b"])
    assert "could not sync" in caplog.text
    log.fail_dir_sync = False
    assert store.rollout_state("a") == "retired" and store.rollout_state("b") == "retired"
    assert CaptureStore(tmp_path / "calls").retire_now(["a", "b"])["removed"] == ["b"]


def test_lock_files_are_striped_and_never_deleted(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "calls")
    ids = [f"r{i}" for i in range(500)]
    for rid in ids:
        _write(store, rid)
    store.retire_now(ids)
    store.delete_now(ids)
    locks = sorted(os.listdir(store.root / STATE_DIR / "locks"))
    assert len(locks) == 64 and locks[0] == "00.lock"
    assert sorted(os.listdir(store.root)) == [STATE_DIR]


def test_a_damaged_journal_line_fails_only_its_rollout_until_retire_or_delete_resets_it(
    tmp_path: Path,
) -> None:
    store = CaptureStore(tmp_path / "calls")
    _write(store, "ok")
    store.freeze_now("ok")
    journal = store.root / STATE_DIR / "fences.journal"
    with journal.open("ab") as handle:
        handle.write(b'{"seq":99,"op":"freeze","id":"bad","snapshot_id":\x00garbage\n')
    store2 = CaptureStore(tmp_path / "calls")
    dir_state(store2.root).journal.refresh()
    with pytest.raises(CaptureStateError, match="damaged fence journal line"):
        store2.freeze_now("bad")
    assert store2.freeze_now("ok").records  # the others are untouched
    assert store2.retire_now(["bad", "ok"]) == {"removed": ["ok"], "absent": ["bad"], "failed": {}}
    assert store2.rollout_state("bad") == "retired"


def test_a_torn_journal_tail_from_a_crashed_appender_is_terminated_not_merged(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "calls")
    store.retire_now(["a"])
    journal = store.root / STATE_DIR / "fences.journal"
    with journal.open("ab") as handle:
        handle.write(b'{"seq":2,"op":"retire","id":"b"')  # killed mid-append
    store.retire_now(["c"])
    assert store.list_rollouts() == {"a": "retired", "c": "retired"}
    assert store.rollout_state("b") == "absent"
    with pytest.raises(CaptureStateError):
        store.freeze_now("b")  # the torn line names b: b's state is unknown until retire or delete


def test_the_journal_is_compacted_once_mostly_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("otel_capture._store.journal.COMPACT_MIN_LINES", 50)
    store = CaptureStore(tmp_path / "calls")
    store.retire_now(["keep"])
    for i in range(30):
        store.retire_now([f"r{i}"])
        store.delete_now([f"r{i}"])
    journal = (store.root / STATE_DIR / "fences.journal").read_bytes().splitlines()
    assert len(journal) < 50
    assert CaptureStore(tmp_path / "calls").list_rollouts() == {"keep": "retired"}
    dir_state(store.root).journal.refresh()
    assert dir_state(store.root).journal.last_seq("keep") == 1


def test_delete_in_a_directory_without_lifecycle_state_creates_none(tmp_path: Path) -> None:
    root = tmp_path / "gym"
    root.mkdir()
    (root / "0-0.capture.jsonl").write_text("{}\n")
    (root / "0-0.capture.incomplete").write_text("")
    assert CaptureStore(root).delete_now(["0-0", "9-9"]) == {
        "removed": ["0-0"],
        "absent": ["9-9"],
        "failed": {},
    }
    assert os.listdir(root) == []
    assert CaptureStore(tmp_path / "nope").delete_now(["0-0"])["absent"] == ["0-0"]
    assert not (tmp_path / "nope").exists()


def test_freeze_sees_a_call_in_flight_in_another_process_through_its_marker(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "calls")
    _write(store, "r")
    state = dir_state(store.root)
    with state.dirs() as dirs:  # what another process's writer thread writes
        state.markers.write(dirs, "r", ["other-process-call"], [])
    snap = store.freeze_now("r")
    assert [c.model_call_id for c in snap.incomplete_calls] == ["other-process-call"]


def test_nemo_gym_readers_see_a_deleted_rollout_as_empty(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "calls")
    _write(store, "r")
    store.mark_incomplete("r", "c2", "x")
    store.delete_now(["r"])
    # Gym checks <id>.capture.jsonl and the existence of <id>.capture.incomplete
    assert not store.data_path("r").exists() and not store.incomplete_path("r").exists()
    assert store.rollout_ids() == []


# --- the writer enforces fences ------------------------------------------------------------------------


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[JsonlWriter]:
    writer = JsonlWriter(tmp_path / "calls")
    yield writer
    writer.close()


def test_the_writer_drops_late_lines_quietly_and_counts_them(
    tmp_path: Path, writer: JsonlWriter, caplog: pytest.LogCaptureFixture
) -> None:
    store = CaptureStore(tmp_path / "calls")
    submit(writer, "f", b'{"model_call_id":"1"}\n', "1", b'{"model_call_id":"1"}\n').result()
    store.freeze_now("f")
    store.retire_now(["r"])
    with caplog.at_level(logging.DEBUG):
        frozen = submit(writer, "f", b'{"model_call_id":"2"}\n', "2", b"{}\n")
        retired = submit(writer, "r", b'{"model_call_id":"3"}\n', "3")
        writer.flush()
    assert type(frozen.exception()) is CaptureFrozenError
    assert type(retired.exception()) is CaptureRetiredError
    assert writer.stats.late_write_dropped == 2 and writer.stats.failures == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not store.incomplete_path("f").exists() and not store.data_path("r").exists()
    assert len(store.freeze_now("f").records) == 1 and len(store.freeze_now("f").tokens) == 1


def test_the_writer_writes_token_lines_beside_records_in_the_same_batch(
    tmp_path: Path, writer: JsonlWriter
) -> None:
    futures = [
        submit(writer, "r", b'{"model_call_id":"%d"}\n' % i, str(i), b'{"t":%d}\n' % i) for i in range(5)
    ]
    futures.append(submit(writer, "r", b'{"model_call_id":"x"}\n', "x"))  # no tokens for this call
    for future in futures:
        future.result()
    store = CaptureStore(tmp_path / "calls")
    raw = store.read_token_lines("r")
    assert raw is not None and len(raw.lines) == 5 and raw.tail == b""
    assert len(store.read_lines("r").lines) == 6  # type: ignore[union-attr]


def test_the_writer_drops_a_call_that_began_before_a_retire_and_delete(
    tmp_path: Path, writer: JsonlWriter
) -> None:
    writer.begin("r", "old")
    writer.flush()
    store = CaptureStore(tmp_path / "calls")
    assert [c.model_call_id for c in store.freeze_now("r").incomplete_calls] == ["old"]
    store.retire_now(["r"])
    store.delete_now(["r"])
    assert store.rollout_state("r") == "absent"
    late = submit(writer, "r", b'{"model_call_id":"old"}\n', "old")
    writer.flush()
    assert isinstance(late.exception(), CaptureRetiredError)
    assert writer.stats.late_write_dropped == 1
    writer.begin("r", "new")
    submit(writer, "r", b'{"model_call_id":"new"}\n', "new").result()
    snap = store.freeze_now("r")
    assert [r.model_call_id for r in snap.records] == ["new"] and not snap.incomplete


def _churn_until_compacted(root: Path, store: CaptureStore) -> None:
    """Retire and delete other ids until the fence journal has been rewritten (a new inode)."""
    journal = root / STATE_DIR / "fences.journal"
    before = journal.stat().st_ino
    for i in range(200):
        store.retire_now([f"x{i}"])
        store.delete_now([f"x{i}"])
        if journal.stat().st_ino != before:
            return
    raise AssertionError("the journal was never compacted")


def test_a_call_admitted_before_a_delete_stays_late_after_the_journal_is_compacted(
    tmp_path: Path, writer: JsonlWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction keeps recent delete lines: without them the deleted id's epoch fell back to 0 and the
    old call was written into the reused id as if it belonged there."""
    monkeypatch.setattr("otel_capture._store.journal.COMPACT_MIN_LINES", 50)
    writer.begin("r", "old")
    writer.flush()  # admitted now, at the rollout's epoch 0
    store = CaptureStore(tmp_path / "calls")
    store.delete_now(["r"])
    _churn_until_compacted(store.root, store)
    late = submit(writer, "r", b'{"model_call_id":"old"}\n', "old")
    writer.flush()
    assert isinstance(late.exception(), CaptureRetiredError)
    assert store.rollout_state("r") == "absent" and not store.data_path("r").exists()


_OTHER_PROCESS_DELETES = """
import sys
import otel_capture._store.journal as journal
from otel_capture import CaptureStore
journal.COMPACT_MIN_LINES = 50
store = CaptureStore(sys.argv[1])
store.delete_now(["r"])
inode = (store.root / ".otel-capture" / "fences.journal").stat().st_ino
for i in range(200):
    store.retire_now([f"x{i}"])
    store.delete_now([f"x{i}"])
    if (store.root / ".otel-capture" / "fences.journal").stat().st_ino != inode:
        break
else:
    sys.exit("never compacted")
"""


def test_a_delete_and_a_compaction_in_another_process_still_make_the_call_late(
    tmp_path: Path, writer: JsonlWriter
) -> None:
    """The trainer deletes (and its appends compact the journal) while this process has the call in
    flight: this process never saw the delete's line in the old journal, only the compacted one."""
    writer.begin("r", "old")
    writer.flush()
    subprocess.run([sys.executable, "-c", _OTHER_PROCESS_DELETES, str(tmp_path / "calls")], check=True)
    late = submit(writer, "r", b'{"model_call_id":"old"}\n', "old")
    writer.flush()
    assert isinstance(late.exception(), CaptureRetiredError)
    assert CaptureStore(tmp_path / "calls").rollout_state("r") == "absent"
    writer.begin("r", "new")  # the id is reusable: a call begun after the delete is recorded
    submit(writer, "r", b'{"model_call_id":"new"}\n', "new").result()
    assert CaptureStore(tmp_path / "calls").rollout_state("r") == "live"


def test_deletes_older_than_the_retention_are_compacted_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete-only workload keeps the journal bounded: once no call can still be in flight from before
    a delete (the retention), its line goes at the next compaction."""
    monkeypatch.setattr("otel_capture._store.journal.COMPACT_MIN_LINES", 50)
    monkeypatch.setattr("otel_capture._store.journal.DELETE_RETENTION_S", 0.0)
    store = CaptureStore(tmp_path / "calls")
    store.retire_now(["keep"])
    for i in range(300):
        store.delete_now([f"d{i}"])
    lines = (store.root / STATE_DIR / "fences.journal").read_bytes().splitlines()
    assert len(lines) < 100
    assert CaptureStore(tmp_path / "calls").list_rollouts() == {"keep": "retired"}


def test_a_failed_write_of_a_retired_rollout_leaves_no_marker(tmp_path: Path) -> None:
    calls: list[int] = []

    def failing(fd: int) -> None:
        calls.append(fd)
        raise OSError(5, "Input/output error")

    store = CaptureStore(tmp_path / "calls")
    store.retire_now(["r"])
    writer = JsonlWriter(tmp_path / "calls", fsync=failing)
    try:
        writer._failures.mark_incomplete("r", ["c"], "EIO")  # the failure path, racing a retire
    finally:
        writer.close()
    assert not store.incomplete_path("r").exists()


# --- bounded by the work in hand (issue 15, item 10) -------------------------------------------------------


def test_a_freeze_and_drop_workload_keeps_the_fence_journal_compacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drop supersedes its freeze line: retire compacts the journal too, so it stays within 1.5 lines
    per fence in force (it had two per dropped rollout, forever)."""
    monkeypatch.setattr("otel_capture._store.journal.COMPACT_MIN_LINES", 50)
    store = CaptureStore(tmp_path / "calls")
    for i in range(200):
        _write(store, f"r{i}")
        snap = store.freeze_now(f"r{i}")
        assert store.drop_now(f"r{i}", snapshot_id=snap.snapshot_id, version=snap.version)
    journal = (store.root / STATE_DIR / "fences.journal").read_bytes().splitlines()
    assert len(journal) <= 1.5 * 200 + 2
    fresh = FenceJournal(store.root / STATE_DIR)  # what another process loads
    fresh.refresh()
    assert len(fresh.fences()) == 200 and {f.kind for f in fresh.fences().values()} == {"retired"}
    assert fresh.fence("r7") == dir_state(store.root).journal.fence("r7")


def _no_call_in_flight_seen(root: Path, rollouts: list[str]) -> None:
    """What a reader in another process sees: no marker lists a call in flight, nor a rollout with one."""
    other = InflightMarkers()
    fresh = CaptureStore(root)  # nothing of the writer's memory
    for rid in rollouts:
        assert other.pending(root, rid) == set()
        assert other.since(root, rid) == {}
        assert fresh.calls_in_flight(rid) == {}


def test_in_flight_markers_go_when_the_writer_closes_their_rollouts(tmp_path: Path) -> None:
    """One marker file per rollout the writer has open, each listing no call once its calls are recorded,
    not one per rollout ever seen until retire: the writer removes them when it closes (contract D19)."""
    store = CaptureStore(tmp_path / "calls")
    inflight = store.root / STATE_DIR / "inflight"
    rollouts = [f"r{i}" for i in range(20)]
    writer = JsonlWriter(store.root)
    try:
        for rid in rollouts:
            writer.begin(rid, "c1")
        assert writer.flush(60)
        assert len(os.listdir(inflight)) == 20  # what a freeze in another process reads meanwhile
        # another process lists them by their markers alone: no record yet, each with a call in flight
        assert CaptureStore(store.root).list_rollouts() == dict.fromkeys(rollouts, "live")
        for rid in rollouts:
            submit(writer, rid, b'{"model_call_id":"c1"}\n', "c1")
        assert writer.flush(60)
        _no_call_in_flight_seen(store.root, rollouts)  # the files are kept, empty, while the writer runs
        assert all(store.calls_in_flight(rid) == {} for rid in rollouts)
    finally:
        writer.close()
    store.begin_call("s", "c1")
    store.mark_incomplete("s", "c1", "the upstream died")
    assert os.listdir(inflight) == []
    assert store.list_rollouts() == {**{f"r{i}": "live" for i in range(20)}, "s": "live"}


def test_a_kept_in_flight_marker_goes_at_the_writers_idle_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("otel_capture._store.writer.IDLE_CLOSE", 0.05)
    root = tmp_path / "calls"
    inflight = root / STATE_DIR / "inflight"
    writer = JsonlWriter(root, marker_delay=60)
    try:
        writer.begin("r", "c1")
        assert writer.flush(60)
        assert InflightMarkers.pending(root, "r") == {"c1"}
        submit(writer, "r", b'{"model_call_id":"c1"}\n', "c1")
        assert writer.flush(60)
        _no_call_in_flight_seen(root, ["r"])
        deadline = time.monotonic() + 60  # only to prove "does not hang"
        while os.listdir(inflight) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.listdir(inflight) == []
        # the rollout's next call makes its marker afresh
        writer.begin("r", "c2")
        assert writer.flush(60)
        assert InflightMarkers.pending(root, "r") == {"c2"}
    finally:
        writer.close()
    assert InflightMarkers.pending(root, "r") == {"c2"}  # still in flight: never removed with it


@pytest.mark.parametrize("removal", ["retire_now", "delete_now"])
def test_a_kept_in_flight_marker_goes_with_a_retire_or_delete(tmp_path: Path, removal: str) -> None:
    """A retire or delete removes the marker the writer keeps; a delete's reused id gets a new one."""
    store = CaptureStore(tmp_path / "calls")
    inflight = store.root / STATE_DIR / "inflight"
    writer = JsonlWriter(store.root, marker_delay=60)
    try:
        writer.begin("r", "c1")
        assert writer.flush(60)
        submit(writer, "r", b'{"model_call_id":"c1"}\n', "c1")
        assert writer.flush(60)
        assert os.listdir(inflight) == ["r.calls"]  # kept by the writer, empty
        getattr(store, removal)(["r"])
        assert os.listdir(inflight) == []
        if removal == "delete_now":
            writer.begin("r", "c2")
            assert writer.flush(60)
            assert InflightMarkers.pending(store.root, "r") == {"c2"}
            assert store.calls_in_flight("r") == {"c2": pytest.approx(time.time(), abs=60)}
    finally:
        writer.close()


def test_a_kept_marker_whose_calls_all_ended_lists_nothing_in_flight(tmp_path: Path) -> None:
    """Markers as a writer SIGKILLed while keeping them leaves them (contract D19): an empty one and one
    whose every ``+`` has its ``-`` say no call is in flight, to every reader; one with a ``+`` alone does."""
    store = CaptureStore(tmp_path / "calls")
    store.begin_call("open", "c9")  # makes the directories, and one marker with a call in flight
    inflight = store.root / STATE_DIR / "inflight"
    (inflight / "empty.calls").write_bytes(b"")
    (inflight / "balanced.calls").write_bytes(b"+c1\n@c1 1700000000.000\n+c2\n@c2 1700000000.001\n-c2\n-c1\n")
    fresh = CaptureStore(store.root)  # another process's view: nothing of this one's memory
    assert fresh.list_rollouts() == {"open": "live"}  # three marker files, one rollout with a call in flight
    assert fresh.calls_in_flight("empty") == {} and fresh.calls_in_flight("balanced") == {}
    assert list(fresh.calls_in_flight("open")) == ["c9"]
    for rid in ("empty", "balanced"):
        snap = fresh.freeze_now(rid)
        assert not snap.incomplete and snap.incomplete_calls == ()
    snap = fresh.freeze_now("open")
    assert [c.model_call_id for c in snap.incomplete_calls] == ["c9"]


def _count_marker_opens(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    markers = dir_state(root).markers
    opened: list[str] = []
    real_open = markers.open

    def counting_open(dirs: Any, rollout_id: str, *, create: bool) -> int | None:
        opened.append(rollout_id)
        return real_open(dirs, rollout_id, create=create)

    monkeypatch.setattr(markers, "open", counting_open)
    return opened


def test_a_call_recorded_within_the_marker_delay_costs_no_marker_file_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "calls"
    writer = JsonlWriter(root, marker_delay=60)
    opened = _count_marker_opens(root, monkeypatch)
    try:
        for i in range(20):
            writer.begin(f"r{i % 4}", f"c{i}")
            submit(writer, f"r{i % 4}", b'{"model_call_id":"c%d"}\n' % i, f"c{i}")
        assert writer.flush(60)
        assert writer.stats.records_written == 20
    finally:
        writer.close()
    assert opened == []
    inflight = root / STATE_DIR / "inflight"
    assert not inflight.exists() or os.listdir(inflight) == []
    assert all(not dir_state(root).calls.pending(f"r{i}") for i in range(4))


def test_a_call_in_flight_longer_than_the_marker_delay_gets_its_marker_without_a_flush(
    tmp_path: Path,
) -> None:
    """What a freeze in another process reads: the ``+`` marker of a call still in flight after the delay."""
    store = CaptureStore(tmp_path / "calls")
    writer = JsonlWriter(store.root, marker_delay=0.05)
    other = InflightMarkers()
    try:
        writer.begin("r", "slow")
        deadline = time.monotonic() + 30
        while not other.pending(store.root, "r") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.pending(store.root, "r") == {"slow"}
        submit(writer, "r", b'{"model_call_id":"slow"}\n', "slow")
        assert writer.flush(60)
        assert other.pending(store.root, "r") == set()
        _no_call_in_flight_seen(store.root, ["r"])  # kept (empty) while the writer runs
    finally:
        writer.close()
    assert os.listdir(store.root / STATE_DIR / "inflight") == []


def test_an_abandoned_call_within_the_marker_delay_leaves_no_marker(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "calls")
    writer = JsonlWriter(store.root, marker_delay=60)
    try:
        writer.begin("r", "lost")
        writer.abandon("r", "lost", "the record could not be built")
        assert writer.flush(60)
    finally:
        writer.close()
    assert InflightMarkers.pending(store.root, "r") == set()
    snap = store.freeze_now("r")
    assert [c.model_call_id for c in snap.incomplete_calls] == ["lost"]


def test_a_discarded_call_within_the_marker_delay_leaves_nothing_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redirect (not a model call) answered before its ``+`` marker was due: no marker file I/O at all,
    no line, no incomplete mark, and this process no longer counts it in flight."""
    store = CaptureStore(tmp_path / "calls")
    writer = JsonlWriter(store.root, marker_delay=60)
    opened = _count_marker_opens(store.root, monkeypatch)
    try:
        writer.begin("r", "redirected")
        writer.discard("r", "redirected")
        assert writer.flush(60)  # a flush writes every due marker: this one is no longer due
    finally:
        writer.close()
    assert opened == []
    assert dir_state(store.root).calls.pending("r") == {}
    assert store.list_rollouts() == {}
    snap = store.freeze_now("r")
    assert snap.records == () and not snap.incomplete
    assert writer.stats.failures == 0


def test_a_discarded_call_whose_marker_was_written_gets_its_end_marker(tmp_path: Path) -> None:
    """What a freeze in another process reads: the discarded call's ``+`` is ended by a ``-``, the calls
    still in flight stay, and the marker file goes once none is left."""
    store = CaptureStore(tmp_path / "calls")
    writer = JsonlWriter(store.root, marker_delay=60)
    try:
        writer.begin("r", "redirected")
        writer.begin("r", "real")
        assert writer.flush(60)  # both "+" markers written
        assert InflightMarkers.pending(store.root, "r") == {"redirected", "real"}
        writer.discard("r", "redirected")
        assert writer.flush(60)
        assert InflightMarkers.pending(store.root, "r") == {"real"}
        submit(writer, "r", b'{"model_call_id":"real"}\n', "real")
        assert writer.flush(60)
    finally:
        writer.close()
    assert os.listdir(store.root / STATE_DIR / "inflight") == []
    snap = store.freeze_now("r")
    assert [r.model_call_id for r in snap.records] == ["real"] and not snap.incomplete
    assert not (store.root / "r.capture.incomplete").exists()


def test_a_waiter_is_resolved_without_a_concurrent_future(tmp_path: Path) -> None:
    writer = JsonlWriter(tmp_path / "calls")

    async def call() -> object:
        loop = asyncio.get_running_loop()
        waiter = LoopWaiter(loop, loop.create_future())
        writer.begin("r", "c1")
        returned = writer.submit("r", b'{"model_call_id":"c1"}\n', "c1", None, waiter)
        await asyncio.wait_for(waiter.future, 60)
        return returned

    try:
        assert asyncio.run(call()) is None
        submit(writer, "r", b'{"model_call_id":"c2"}\n', "c2").result(60)  # a thread's wait: the same route
        assert writer.flush(60)
    finally:
        writer.close()
    assert (tmp_path / "calls" / "r.capture.jsonl").read_bytes().count(b"\n") == 2


def test_the_store_has_one_listing_of_rollouts(tmp_path: Path) -> None:
    """``rollout_ids`` is the listing: ``list_rollouts``, ``check`` and ``show`` all use it; a rollout with
    only a token file is one, a FIFO named like a data file is not (it is a damaged entry)."""
    store = CaptureStore(tmp_path / "calls")
    store.append_now("d", "c1", {"dialect": "chat"})
    store.mark_incomplete("i", "c1", "why")
    (store.root / "t.tokens.jsonl").write_bytes(b'{"model_call_id":"c1"}\n')
    os.mkfifo(store.root / "f.capture.jsonl")
    assert store.rollout_ids() == ["d", "i", "t"]
    assert store.list_rollouts() == {"d": "live", "i": "live", "t": "live"}
    assert store.damaged_entries() == [("f.capture.jsonl", "a FIFO, not a regular file")]


def test_a_mark_refused_on_a_retired_rollout_leaves_its_call_late_after_a_delete(tmp_path: Path) -> None:
    """As the in-memory reference does (found by the lifecycle state machine): a refused mark does not end
    the call, so its line after a delete, admitted before the retire, is still dropped as late."""
    store = CaptureStore(tmp_path)
    store.begin_call("a", "b0")
    store.retire_now(["a"])
    with pytest.raises(CaptureRetiredError):
        store.mark_incomplete("a", "b0", "why")
    store.delete_now(["a"])
    with pytest.raises(CaptureRetiredError):
        store.append_now("a", "b0", {"x": 2})
    assert store.rollout_state("a") == "absent"
