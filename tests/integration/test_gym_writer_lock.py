"""A freeze reads a data file under the same shared ``flock`` as the readers (issue 11, item 7): with a
NeMo Gym-style writer in another process holding ``LOCK_EX`` in the middle of a line, the snapshot waits
for the line and holds only whole lines."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from otel_capture import CaptureSnapshot, CaptureStore
from otel_capture._store import fs

BOUND = 60  # seconds: only to prove "does not hang"

GYM_WRITER = textwrap.dedent(
    """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what NeMo Gym's writer holds for each append
    second = b'{"model_call_id": "g2", "dialect": "chat"}\\n'
    os.write(fd, b'{"model_call_id": "g1", "dialect": "chat"}\\n' + second[:12])
    print("half a line written", flush=True)
    sys.stdin.readline()
    os.write(fd, second[12:])
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    """
)


class _Clock:
    """``time`` as the store's lock waits see it: ``busy`` is set once one finds a lock held and sleeps
    before trying again (the waits poll with ``LOCK_NB``, so no waiter shows in ``/proc/locks``)."""

    busy = threading.Event()
    monotonic = staticmethod(time.monotonic)

    @classmethod
    def sleep(cls, seconds: float) -> None:
        cls.busy.set()
        time.sleep(seconds)


def test_freeze_waits_for_a_gym_writer_holding_the_lock_mid_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _Clock.busy.clear()
    monkeypatch.setattr(fs, "time", _Clock)
    store = CaptureStore(tmp_path / "calls")
    store.append_now("r", "c0", {"dialect": "chat"})
    data = store.data_path("r")
    with subprocess.Popen(
        [sys.executable, "-c", GYM_WRITER, str(data)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as writer:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline() == "half a line written\n"
        snapshots: list[CaptureSnapshot] = []
        freeze = threading.Thread(target=lambda: snapshots.append(store.freeze_now("r")), daemon=True)
        freeze.start()
        # Let the writer finish once the freeze has either read the file or is waiting for its lock.
        give_up = time.monotonic() + BOUND
        while freeze.is_alive() and not _Clock.busy.is_set() and time.monotonic() < give_up:
            time.sleep(0.01)
        assert _Clock.busy.is_set(), "the freeze did not wait for the lock"
        writer.stdin.write("finish\n")
        writer.stdin.flush()
        freeze.join(BOUND)
        assert not freeze.is_alive(), "the freeze hung"
        assert writer.wait(BOUND) == 0
    snapshot = snapshots[0]
    assert [r.model_call_id for r in snapshot.records] == ["c0", "g1", "g2"]
    assert not snapshot.incomplete, snapshot.incomplete_calls
