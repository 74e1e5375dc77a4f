"""The loss reserve (``otel_capture/_store/losses.py``): what a writer writes when even an incomplete mark
cannot be written, how readers and ``check`` see it, and who reports it when its writer is gone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from support import submit

from otel_capture import CaptureStore
from otel_capture._store import JsonlWriter, pending_losses
from otel_capture._store.dirstate import STATE_DIR
from otel_capture._store.fs import DirFds
from otel_capture._store.losses import RESERVE_BYTES, LossReserve
from otel_capture._store.names import LOSSES_DIR

_DIES_WITH_A_LOSS = """
import sys, time
from pathlib import Path
from otel_capture._store.fs import DirFds
from otel_capture._store.losses import LossReserve
root = Path(sys.argv[1])
reserve = LossReserve()
with DirFds(root) as dirs:
    reserve.open(dirs, lambda fd: None)
reserve.record("r", ["c1", "c2"], "OSError: ENOSPC No space left on device", lambda fd: None)
print("recorded", flush=True)
time.sleep(600)
"""


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "check", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_reserve_takes_its_blocks_when_made_and_is_removed_when_nothing_in_it_is_pending(
    tmp_path: Path,
) -> None:
    store = CaptureStore(tmp_path / "calls")
    writer = JsonlWriter(store.root)
    try:
        submit(writer, "r", b'{"model_call_id":"c1"}\n', "c1").result(60)
        assert writer.flush(60)  # made right after the first batch, once its call was answered
        (reserve,) = (store.root / STATE_DIR / LOSSES_DIR).iterdir()
        assert reserve.stat().st_blocks * 512 >= RESERVE_BYTES  # its blocks are taken ahead of need
        assert pending_losses(store.root) == []
    finally:
        writer.close()
    assert list((store.root / STATE_DIR / LOSSES_DIR).iterdir()) == []  # nothing pending: given back


def test_the_losses_of_a_writer_that_died_are_named_by_check_and_reported_by_the_next_writer(
    tmp_path: Path,
) -> None:
    store = CaptureStore(tmp_path / "calls")
    store.root.mkdir()
    dying = subprocess.Popen(
        [sys.executable, "-c", _DIES_WITH_A_LOSS, str(store.root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert dying.stdout is not None and dying.stdout.readline().strip() == "recorded"
    finally:
        dying.send_signal(signal.SIGKILL)
        dying.wait(60)
        if dying.stdout is not None:
            dying.stdout.close()
    result = _check(store.root)
    assert result.returncode == 1
    assert "r: lost, not yet in the incomplete marker: c1, c2: OSError: ENOSPC" in result.stdout
    assert store.rollout_ids() == ["r"] and store.is_incomplete("r")
    assert [c.model_call_id for c in store.incomplete_calls("r")] == ["c1", "c2"]

    writer = JsonlWriter(store.root)  # a writer's first batch adopts what a dead writer left
    try:
        submit(writer, "other", b'{"model_call_id":"o1"}\n', "o1").result(60)
    finally:
        writer.close()
    assert _check(store.root).returncode == 0
    assert [(c.model_call_id, c.reason) for c in store.incomplete_calls("r")] == [
        ("c1", "OSError: ENOSPC No space left on device"),
        ("c2", "OSError: ENOSPC No space left on device"),
    ]
    assert list((store.root / STATE_DIR / LOSSES_DIR).iterdir()) == []


def test_a_full_reserve_says_that_more_calls_were_lost_than_it_names(tmp_path: Path) -> None:
    root = tmp_path / "calls"
    root.mkdir()
    reserve = LossReserve()
    with DirFds(root) as dirs:
        reserve.open(dirs, os.fsync)
    written = 0
    while reserve.record(f"r{written}", ["c"], "x" * 100, os.fsync) is not None:
        written += 1
    losses = pending_losses(root)
    assert len(losses) == written + 1
    assert losses[-1].rollout_id == "" and "more calls were lost than it names" in losses[-1].reason
    result = _check(root)
    assert result.returncode == 1 and "(rollout unknown): lost" in result.stdout
    reserve.reported([0], os.fsync)
    reserve.overflow_reported(os.fsync)
    assert len(pending_losses(root)) == written - 1
    reserve.close()


def test_a_freeze_names_a_held_back_loss_once_not_as_a_call_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "calls"
    store = CaptureStore(root)
    store.begin_call("r", "c1")  # its "+" marker is on disk, and stays: the mark could not be written
    reserve = LossReserve()
    with DirFds(root) as dirs:
        reserve.open(dirs, os.fsync)
    reserve.record("r", ["c1"], "OSError: ENOSPC No space left on device", os.fsync)
    snapshot = asyncio.run(store.freeze("r"))
    assert [(c.model_call_id, "ENOSPC" in c.reason) for c in snapshot.incomplete_calls] == [("c1", True)]
    reserve.close_fds()
