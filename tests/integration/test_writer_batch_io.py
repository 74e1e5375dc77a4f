"""The writer's batch on a network filesystem: its stripes written at once by a pool (``_store/batch_io``),
and what it keeps from one batch to the next (data files, stripe lock files), each still checked.

The pool runs where the capture directory is on a network or FUSE filesystem; here the directory is on the
local disk and the writer is told it is shared (the one thing replaced: its filesystem's verdict), so the
pool, its threads and every file operation are real. ``tests/gluster/`` runs the same writer on a real
GlusterFS mount. Every test runs both ways: ``pooled`` and the writer thread alone.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from support import submit

from otel_capture import CaptureStore
from otel_capture._store import CaptureFrozenError, JsonlWriter, SyncChoice
from otel_capture._store import writer as writer_module
from otel_capture._store.locks import StripedLocks

BOUND = 60  # seconds: only to prove "does not hang"


@pytest.fixture(params=["pooled", "inline"])
def pooled(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    shared = request.param == "pooled"
    chosen = SyncChoice("fsync", "the test says so", shared=shared)
    monkeypatch.setattr(writer_module, "choose_sync", lambda root, syncfs_allowed: chosen)
    return shared


def _line(rollout: str, n: int) -> bytes:
    return orjson.dumps({"model_call_id": f"{rollout}-{n}", "n": n, "pad": "x" * (n % 7) * 100}) + b"\n"


def _numbers(path: Path) -> list[int]:
    return [orjson.loads(line)["n"] for line in path.read_bytes().splitlines()]


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND  # a bound on a hang, not a timing assertion
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_each_file_s_lines_stay_whole_and_in_order(tmp_path: Path, pooled: bool) -> None:
    """Eight threads each submit 40 calls to their own 12 rollouts, in order: every rollout's file holds
    exactly its calls, each line whole, in the order they were submitted, whatever batch or worker took
    them; a tokens line goes with each call to the tokens file, in the same order."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root)
    try:

        def client(t: int) -> list[object]:
            futures: list[object] = []
            for n in range(40):
                rollout = f"t{t}-r{n % 12}"
                tokens = orjson.dumps({"model_call_id": f"{rollout}-{n}", "n": n}) + b"\n"
                futures.append(submit(writer, rollout, _line(rollout, n), f"{rollout}-{n}", tokens))
            return futures

        results: list[list[object]] = [[] for _ in range(8)]
        threads = [threading.Thread(target=lambda t=t: results.__setitem__(t, client(t))) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(BOUND)
        for futures in results:
            for future in futures:
                assert future.result(BOUND) is None  # type: ignore[attr-defined]
        assert writer.stats.batches >= 1
    finally:
        writer.close(BOUND)
    for t in range(8):
        for r in range(12):
            expected = list(range(r, 40, 12))
            assert _numbers(root / f"t{t}-r{r}.capture.jsonl") == expected
            assert _numbers(root / f"t{t}-r{r}.tokens.jsonl") == expected


def test_a_file_whose_lock_is_stuck_does_not_hold_the_others(tmp_path: Path, pooled: bool) -> None:
    """One batch over a rollout whose data file another holder keeps locked and ten others in other
    stripes: with the pool the ten are written while the lock is still held (the stuck one waits alone);
    once it is let go, every call of the batch is acknowledged, the stuck one's included."""
    root = tmp_path / "calls"
    root.mkdir(mode=0o700)
    stuck = "stuck"
    others = []
    n = 0
    while len(others) < 10:  # rollouts in stripes of their own: the stuck stripe holds only its rollout
        candidate = f"other{n}"
        n += 1
        stripes = {StripedLocks.stripe(r) for r in (stuck, *others)}
        if StripedLocks.stripe(candidate) not in stripes:
            others.append(candidate)
    gate, waiting, armed = threading.Event(), threading.Event(), threading.Event()

    def fsync(fd: int) -> None:  # the first batch (the gate) waits until the big batch is queued
        if armed.is_set() and not gate.is_set():
            waiting.set()
            gate.wait(BOUND)
        os.fsync(fd)

    (root / f"{stuck}.capture.jsonl").write_bytes(b"")
    (root / f"{stuck}.capture.jsonl").chmod(0o600)
    holder = os.open(root / f"{stuck}.capture.jsonl", os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    writer = JsonlWriter(root, fsync=fsync, lock_timeout_s=4 * BOUND)
    try:
        # the writer's own start (its loss reserve, synced) is done before the gate is armed
        assert submit(writer, "warm", _line("warm", 0), "warm-0").result(BOUND) is None
        armed.set()
        first = submit(writer, "gate", _line("gate", 0), "gate-0")
        assert waiting.wait(BOUND)
        futures = [submit(writer, stuck, _line(stuck, 0), f"{stuck}-0")]  # first in the batch
        futures += [submit(writer, r, _line(r, 0), f"{r}-0") for r in others]
        gate.set()
        assert first.result(BOUND) is None
        if pooled:
            _wait_for(
                lambda: (
                    all((root / f"{r}.capture.jsonl").exists() for r in others)
                    and all(_numbers(root / f"{r}.capture.jsonl") == [0] for r in others)
                ),
                "the other rollouts' lines written while one file's lock is held",
            )
            assert _numbers(root / f"{stuck}.capture.jsonl") == []
        fcntl.flock(holder, fcntl.LOCK_UN)
        for future in futures:
            assert future.result(4 * BOUND) is None
    finally:
        os.close(holder)
        writer.close(BOUND)
    assert _numbers(root / f"{stuck}.capture.jsonl") == [0]


def test_a_data_file_replaced_between_batches_is_written_under_its_name(tmp_path: Path, pooled: bool) -> None:
    """The writer keeps r's file open after a batch; another file renamed over the name before the next
    batch gets the next line (the kept descriptor's inode is no longer the name's), the old one nothing."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root)
    try:
        assert submit(writer, "r", _line("r", 1), "r-1").result(BOUND) is None
        old = root / "old.jsonl"
        os.link(root / "r.capture.jsonl", old)
        replacement = root / "new.tmp"
        replacement.write_bytes(_line("r", 0))
        replacement.chmod(0o600)
        os.replace(replacement, root / "r.capture.jsonl")
        assert submit(writer, "r", _line("r", 2), "r-2").result(BOUND) is None
    finally:
        writer.close(BOUND)
    assert _numbers(root / "r.capture.jsonl") == [0, 2]
    assert _numbers(old) == [1]


def test_a_directory_removed_between_batches_is_made_anew(tmp_path: Path, pooled: bool) -> None:
    """The capture directory removed whole between two batches (with the state directory and the lock
    files the writer kept open): the next line is in a new directory's file, where a reader finds it."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root)
    try:
        for n in range(3):
            assert submit(writer, f"r{n}", _line(f"r{n}", n), f"r{n}-{n}").result(BOUND) is None
        shutil.rmtree(root)
        assert submit(writer, "r0", _line("r0", 7), "r0-7").result(BOUND) is None
        assert submit(writer, "r9", _line("r9", 9), "r9-9").result(BOUND) is None
    finally:
        writer.close(BOUND)
    assert _numbers(root / "r0.capture.jsonl") == [7]
    assert _numbers(root / "r9.capture.jsonl") == [9]
    assert not (root / "r1.capture.jsonl").exists()


def test_a_fence_set_between_batches_is_honoured(tmp_path: Path, pooled: bool) -> None:
    """Rollouts written by one batch, then one frozen by another store between batches: the next batch
    over all of them refuses the frozen one's line (typed) and writes the others'."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root)
    try:
        for n in range(6):
            assert submit(writer, f"r{n}", _line(f"r{n}", 0), f"r{n}-0").result(BOUND) is None
        CaptureStore(root).freeze_now("r3")
        futures = {n: submit(writer, f"r{n}", _line(f"r{n}", 1), f"r{n}-1") for n in range(6)}
        for n, future in futures.items():
            if n == 3:
                assert isinstance(future.exception(BOUND), CaptureFrozenError)
            else:
                assert future.result(BOUND) is None
    finally:
        writer.close(BOUND)
    assert _numbers(root / "r3.capture.jsonl") == [0]
    assert all(_numbers(root / f"r{n}.capture.jsonl") == [0, 1] for n in range(6) if n != 3)
