"""The writer's in-flight markers (contract D19) as a model server makes them: ``begin`` on the event loop,
where a timer wakes the writer thread only for a call still in flight when its marker falls due, and a
marker whose last call ends emptied without being read back when it is as this process left it, kept
(with its descriptor) for the rollout's next call."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from otel_capture._store import JsonlWriter, LoopWaiter
from otel_capture._store.dirstate import STATE_DIR, dir_state
from otel_capture._store.fs import DirFds
from otel_capture._store.inflight import EMPTY_AT, InflightMarkers

BOUND = 60.0  # seconds: only to prove "does not hang"


async def _call(writer: JsonlWriter, rollout: str, mcid: str, lasts: float) -> None:
    loop = asyncio.get_running_loop()
    writer.begin(rollout, mcid)
    if lasts:
        await asyncio.sleep(lasts)
    future = loop.create_future()
    writer.submit(rollout, b'{"model_call_id":"%s"}\n' % mcid.encode(), mcid, None, LoopWaiter(loop, future))
    await asyncio.wait_for(future, BOUND)


def test_a_call_begun_on_the_loop_that_ends_first_wakes_the_writer_once(tmp_path: Path) -> None:
    """Calls begun on an event loop whose lines come within the delay: one batch each (the line's), no
    marker file, and nothing left in flight once the timers have run."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root, marker_delay=0.05)

    async def main() -> None:
        for i in range(10):
            await _call(writer, "r", f"c{i}", 0)
        await asyncio.sleep(0.1)  # every timer has fired (and found its call recorded)

    try:
        asyncio.run(main())
        assert writer.flush(BOUND)
        assert writer.stats.batches == 10
        assert writer.stats.records_written == 10
    finally:
        writer.close(BOUND)
    inflight = root / STATE_DIR / "inflight"
    assert not inflight.exists() or os.listdir(inflight) == []
    assert dir_state(root).calls.pending("r") == {}


def test_a_call_begun_on_the_loop_gets_its_marker_when_due_without_a_flush(tmp_path: Path) -> None:
    """What a freeze in another process reads: the ``+`` of a call begun on a loop and still in flight
    after the delay, written with no flush and no other call to wake the writer; gone once recorded."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root, marker_delay=0.05)
    other = InflightMarkers()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        writer.begin("r", "slow")
        deadline = time.monotonic() + BOUND
        while not other.pending(root, "r"):
            assert time.monotonic() < deadline, "the marker never came"
            await asyncio.sleep(0.01)
        assert other.pending(root, "r") == {"slow"}
        future = loop.create_future()
        writer.submit("r", b'{"model_call_id":"slow"}\n', "slow", None, LoopWaiter(loop, future))
        await asyncio.wait_for(future, BOUND)

    try:
        asyncio.run(main())
    finally:
        writer.close(BOUND)
    assert other.pending(root, "r") == set()
    assert os.listdir(root / STATE_DIR / "inflight") == []


def test_a_call_begun_while_an_earlier_calls_timer_is_pending_gets_its_marker(tmp_path: Path) -> None:
    """The writer arms one timer for the begins its idle thread has not seen: a call begun while the
    timer armed for an earlier call (whose line came first) is still pending, and still in flight after the
    delay, gets its ``+`` with no flush and no other call to wake the writer; the quick call never does."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root, marker_delay=0.2)
    other = InflightMarkers()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0.05)  # the thread has started and waits, idle
        await _call(writer, "r", "quick", 0)  # its begin armed the timer; its line came first
        await asyncio.sleep(0.05)  # the thread is idle again, the timer still pending
        writer.begin("r", "slow")  # within the quick call's delay: the pending timer serves it too
        deadline = time.monotonic() + BOUND
        while not other.pending(root, "r"):
            assert time.monotonic() < deadline, "the marker never came"
            await asyncio.sleep(0.01)
        assert other.pending(root, "r") == {"slow"}
        future = loop.create_future()
        writer.submit("r", b'{"model_call_id":"slow"}\n', "slow", None, LoopWaiter(loop, future))
        await asyncio.wait_for(future, BOUND)

    try:
        asyncio.run(main())
    finally:
        writer.close(BOUND)
    assert other.pending(root, "r") == set()


def test_a_marker_another_process_wrote_to_is_read_back_not_removed(tmp_path: Path) -> None:
    """Our slow call's ``+`` is in the marker; another process then adds its own call (under the stripe,
    as every marker writer does). Our call's ``-`` must not remove the file on what we remember of it:
    the other process's call stays in flight."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root, marker_delay=0.05)
    state = dir_state(root)
    stranger = InflightMarkers()  # another process's writer: its own memory, the same files

    async def main() -> None:
        loop = asyncio.get_running_loop()
        writer.begin("r", "ours")
        deadline = time.monotonic() + BOUND
        while not stranger.pending(root, "r"):
            assert time.monotonic() < deadline, "the marker never came"
            await asyncio.sleep(0.01)
        with state.dirs() as dirs, state.locks.hold_ids(dirs, ["r"]):
            stranger.write(dirs, "r", ["theirs"], [])
        future = loop.create_future()
        writer.submit("r", b'{"model_call_id":"ours"}\n', "ours", None, LoopWaiter(loop, future))
        await asyncio.wait_for(future, BOUND)

    try:
        asyncio.run(main())
    finally:
        writer.close(BOUND)
    assert stranger.pending(root, "r") == {"theirs"}


def test_a_rollout_making_one_call_at_a_time_keeps_one_marker_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls that each outlast the marker delay, one after another, as an RL rollout makes them: each
    call's ``+`` and ``-`` go to the one marker file, opened once and never removed in between (no create
    and unlink per call); a reader in another process sees exactly the call in flight, then none."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root, marker_delay=0.01)
    markers = dir_state(root).markers
    opened: list[str] = []
    real_open = markers.open

    def counting_open(dirs: DirFds, rollout_id: str, *, create: bool) -> int | None:
        opened.append(rollout_id)
        return real_open(dirs, rollout_id, create=create)

    monkeypatch.setattr(markers, "open", counting_open)
    other = InflightMarkers()
    marker = root / STATE_DIR / "inflight" / "r.calls"
    inodes: set[int] = set()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for i in range(5):
            writer.begin("r", f"c{i}")
            deadline = time.monotonic() + BOUND
            while not other.pending(root, "r"):
                assert time.monotonic() < deadline, "the marker never came"
                await asyncio.sleep(0.005)
            assert other.pending(root, "r") == {f"c{i}"}
            inodes.add(marker.stat().st_ino)
            future = loop.create_future()
            line = b'{"model_call_id":"c%d"}\n' % i
            writer.submit("r", line, f"c{i}", None, LoopWaiter(loop, future))
            await asyncio.wait_for(future, BOUND)
            assert other.pending(root, "r") == set()
            inodes.add(marker.stat().st_ino)

    try:
        asyncio.run(main())
        assert opened == ["r"] and len(inodes) == 1
    finally:
        writer.close(BOUND)
    assert not marker.exists()  # the writer's close closed the rollout


def test_a_long_rollout_s_kept_marker_stays_small_and_says_no_call_in_flight(tmp_path: Path) -> None:
    """A rollout making many calls one at a time, each given its ``+`` marker (a flush while it is in
    flight): between calls its kept marker names no call in flight to another process, and it never grows
    past the size at which the writer empties it, however many calls the rollout makes."""
    root = tmp_path / "calls"
    writer = JsonlWriter(root)
    other = InflightMarkers()
    marker = root / STATE_DIR / "inflight" / "r.calls"
    sizes = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for i in range(300):
            writer.begin("r", f"call-{i:04d}")
            assert writer.flush(BOUND)
            assert other.pending(root, "r") == {f"call-{i:04d}"}
            future = loop.create_future()
            line = b'{"model_call_id":"call-%04d"}\n' % i
            writer.submit("r", line, f"call-{i:04d}", None, LoopWaiter(loop, future))
            await asyncio.wait_for(future, BOUND)
            assert other.pending(root, "r") == set()
            sizes.append(marker.stat().st_size)

    try:
        asyncio.run(main())
    finally:
        writer.close(BOUND)
    assert max(sizes) < EMPTY_AT
    assert min(sizes) == 0, "never emptied"
    assert (root / "r.capture.jsonl").read_bytes().count(b"\n") == 300
