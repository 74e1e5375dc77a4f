"""When files cannot be created: a filesystem out of inodes, out of blocks, and a capture directory removed
under calls in flight (issue 24, items 1, 3 and 5). Each through the real capture proxy (in-process,
uvicorn) in front of a real uvicorn upstream, on a tmpfs made for the test: every call's client gets the
upstream's exact answer, and a call whose line could not be written is never indistinguishable from "no
calls": ``otel-capture check`` fails and names it while its mark is held back, a freeze and the attachment
name it, and once room returns its rollout's incomplete marker names it (call id and reason)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from support import Gate, ReplayModelServer, exhaust_inodes, serve

from otel_capture import CaptureSettings, CaptureStore, read_available_model_call_records, start_proxy
from otel_capture._attach import GAP_INCOMPLETE, GAP_NO_RECORDS, build_model_call_capture
from otel_capture._store import pending_losses
from otel_capture._store.inflight import InflightMarkers
from otel_capture._store.names import INFLIGHT_DIR, INFLIGHT_SUFFIX, STATE_DIR
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

BOUND = 60.0  # generous: how long a recovery may take on a loaded machine before the test gives up
CALLS = 24
CHUNKS = [b'{"id":"chatcmpl-9","object":"chat.completion","model":"m",', b'"choices":[]}']


def _check(directory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "check", str(directory), *extra],
        capture_output=True,
        text=True,
        timeout=BOUND,
    )


def _held_calls(url: str, rollouts: list[str], gate: Gate) -> tuple[list[threading.Thread], list[object]]:
    """CALLS chat calls spread over ``rollouts``, started and left waiting at ``gate`` (in flight)."""
    answers: list[object] = []

    def call(rollout_id: str) -> None:
        try:
            response = httpx.post(
                f"{url}/ng-rollout/{rollout_id}/v1/chat/completions", json={"model": "m"}, timeout=BOUND
            )
            answers.append((response.status_code, response.content))
        except Exception as exc:  # the assertion on answers reports it
            answers.append(exc)

    threads = [threading.Thread(target=call, args=(rollouts[i % len(rollouts)],)) for i in range(CALLS)]
    for thread in threads:
        thread.start()
    return threads, answers


def _wait_in_flight(upstream: ReplayModelServer, count: int) -> None:
    deadline = time.monotonic() + BOUND
    while len(upstream.seen) < count:
        assert time.monotonic() < deadline, f"only {len(upstream.seen)} of {count} calls reached the upstream"
        time.sleep(0.01)
    time.sleep(0.1)  # past the writer's marker delay: each call's in-flight marker is on disk


def _marked(store: CaptureStore, rollout_id: str) -> dict[str, str]:
    """``{model_call_id: reason}`` of the rollout's incomplete marker (its lines as they are on disk)."""
    path = store.incomplete_path(rollout_id)
    if not path.exists():
        return {}
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return {line["model_call_id"]: line["reason"] for line in lines}


def _accounted(store: CaptureStore, rollout_id: str) -> set[str]:
    """Every call the rollout's files account for: recorded, or named in its incomplete marker."""
    records = read_available_model_call_records(store, rollout_id).records
    return {r.model_call_id for r in records if r.model_call_id} | set(_marked(store, rollout_id))


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _hold_markers(
    store: CaptureStore, rollouts: list[str], count: int, holding: contextlib.ExitStack
) -> None:
    """Once the rollouts' in-flight markers list ``count`` calls, open each and keep it open until
    ``holding`` closes: a neighbour reading them, as ``tail -f`` would. A file removed while open keeps its
    inode until it is closed, so the markers' removal (the calls' ends) gives no inode back meanwhile."""

    def listed() -> int:
        return sum(len(InflightMarkers.pending(store.root, rid)) for rid in rollouts)

    _until(lambda: listed() == count, f"the in-flight markers never listed the {count} calls")
    folder = store.root / STATE_DIR / INFLIGHT_DIR
    for rid in rollouts:
        holding.callback(os.close, os.open(folder / (rid + INFLIGHT_SUFFIX), os.O_RDONLY))


def _fill_blocks(disk: Path) -> Path:
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def upstream() -> Iterator[tuple[ReplayModelServer, str]]:
    server = ReplayModelServer()
    server.replies["chat"].chunks = list(CHUNKS)
    with serve(server) as url:
        yield server, url


def _gate(server: ReplayModelServer) -> Gate:
    """From now on each chat answer waits after its first chunk until the returned gate opens."""
    gate = server.replies["chat"].gate = Gate()
    server.seen.clear()
    return gate


def test_out_of_inodes_every_lost_call_is_named_and_check_fails_until_its_mark_is_written(
    tmpfs: Callable[[str], Path], upstream: tuple[ReplayModelServer, str]
) -> None:
    server, upstream_url = upstream
    disk = tmpfs("nr_inodes=400,size=16m")
    store = CaptureStore(disk / "calls")
    new = [f"new{i}" for i in range(8)]  # rollouts with no file yet: each needs inodes it cannot have
    with start_proxy(upstream_url, str(store.root)) as proxy, contextlib.ExitStack() as holding:
        warm = httpx.post(f"{proxy.url}/ng-rollout/warm/v1/chat/completions", json={"model": "m"})
        assert warm.status_code == 200
        gate = _gate(server)  # the next calls wait at it, in flight
        threads, answers = _held_calls(proxy.url, [*new, "warm"], gate)
        _wait_in_flight(server, CALLS)
        # Without the neighbour, warm's marker, removed when its calls are recorded, gives an inode back;
        # one is enough for a lost call's mark, whose writing removes that rollout's marker, freeing the
        # next: every mark lands before the test looks, at once or at the writer's retry.
        _hold_markers(store, [*new, "warm"], CALLS, holding)
        fillers = exhaust_inodes(disk)
        gate.open()
        for thread in threads:
            thread.join(BOUND)
        assert answers == [(200, b"".join(CHUNKS))] * CALLS  # exact, whatever the disk did

        # out of inodes still: the lost calls are held back, and said
        lost_new = sorted({loss.rollout_id for loss in pending_losses(store.root)} & set(new))
        assert lost_new, "no rollout lost its marker: the filesystem was not out of inodes"
        result = _check(store.root)
        assert result.returncode == 1, result.stdout
        for rid in lost_new:
            assert f"{rid}: lost, not yet in the incomplete marker" in result.stdout
            attachment = build_model_call_capture(store.root, rid)
            codes = [gap["code"] for gap in attachment["gaps"]]
            assert GAP_INCOMPLETE in codes and GAP_NO_RECORDS not in codes
        snapshot = store.freeze_now(lost_new[0])  # a freeze needs no new inode
        assert snapshot.incomplete and snapshot.incomplete_calls
        assert all(c.model_call_id and "ENOSPC" in c.reason for c in snapshot.incomplete_calls)

        # a rollout that has its data file keeps capturing, also calls in flight long enough to need an
        # in-flight marker file, which cannot be made now
        fillers += exhaust_inodes(disk)  # anything given back since (the held markers give none)
        server.replies["chat"].gate = None
        server.chunk_delay = 0.1
        for _ in range(3):
            again = httpx.post(f"{proxy.url}/ng-rollout/warm/v1/chat/completions", json={}, timeout=BOUND)
            assert (again.status_code, again.content) == (200, b"".join(CHUNKS))

        for filler in fillers:  # room returns: the writer writes the held-back marks by itself
            filler.unlink()
        holding.close()  # and the neighbour lets go of the removed markers
        _until(lambda: _check(store.root).returncode == 0, "check still fails after the inodes returned")
    per_rollout = {rid: sum(1 for i in range(CALLS) if i % (len(new) + 1) == n) for n, rid in enumerate(new)}
    for rid, calls in per_rollout.items():
        assert len(_accounted(store, rid)) == calls, rid  # every call recorded or named, none lost quietly
    assert all("ENOSPC" in reason for reason in _marked(store, lost_new[0]).values())
    assert store.freeze_now(lost_new[0]).version == snapshot.version  # the mark landed; same snapshot
    warm_records = read_available_model_call_records(store, "warm").records
    assert len(warm_records) == 1 + CALLS // (len(new) + 1) + 3
    assert not store.is_incomplete("warm")  # nothing of it was lost, so nothing says it was


def test_out_of_blocks_markers_name_the_lost_calls_once_room_returns(
    tmpfs: Callable[[str], Path], upstream: tuple[ReplayModelServer, str]
) -> None:
    server, upstream_url = upstream
    disk = tmpfs("size=1m")
    store = CaptureStore(disk / "calls")
    rollouts = [f"r{i}" for i in range(6)]
    with start_proxy(upstream_url, str(store.root)) as proxy:
        gate = _gate(server)
        threads, answers = _held_calls(proxy.url, rollouts, gate)
        _wait_in_flight(server, CALLS)
        filler = _fill_blocks(disk)
        gate.open()
        for thread in threads:
            thread.join(BOUND)
        assert answers == [(200, b"".join(CHUNKS))] * CALLS

        empty = [rid for rid in rollouts if store.incomplete_path(rid).exists() and not _marked(store, rid)]
        result = _check(store.root)
        assert result.returncode == 1, result.stdout
        assert "lost, not yet in the incomplete marker" in result.stdout
        for rid in empty:  # a marker that exists but holds no line: the reserve names the calls meanwhile
            gaps = {gap["code"]: gap for gap in build_model_call_capture(store.root, rid)["gaps"]}
            assert "ENOSPC" in gaps[GAP_INCOMPLETE]["detail"]

        filler.unlink()
        _until(lambda: _check(store.root).returncode == 0, "check still fails after the blocks returned")
    for rid in rollouts:
        assert len(_accounted(store, rid)) == CALLS // len(rollouts), rid
        marked = _marked(store, rid)
        if store.incomplete_path(rid).exists():  # never an empty marker once the disk had room again
            assert marked and all(mcid and reason for mcid, reason in marked.items())


def test_calls_in_flight_across_a_directory_removal_are_marked_in_the_new_directory(
    tmp_path: Path, upstream: tuple[ReplayModelServer, str]
) -> None:
    """The directory is removed at the worst moment: after a batch's lines are written, before its sync.
    Nothing of that batch is acknowledged into the removed files: every call is recorded in the directory
    made anew, or named there in its rollout's incomplete marker."""
    server, upstream_url = upstream
    capture_dir = tmp_path / "calls"
    armed = threading.Event()
    removed = threading.Event()

    def sync(fd: int) -> None:
        if armed.is_set() and not removed.is_set():
            shutil.rmtree(capture_dir)
            removed.set()
        os.fsync(fd)

    provider = TracerProvider()
    jsonl = ModelCallJsonlExporter(capture_dir, fsync=sync, syncfs=sync)
    provider.add_span_processor(SimpleSpanProcessor(jsonl))
    rollouts = [f"r{i}" for i in range(4)]
    store = CaptureStore(capture_dir)
    try:
        with start_proxy(upstream_url, settings=CaptureSettings(), tracer_provider=provider) as proxy:
            for rid in rollouts:  # files exist, and are kept open by the writer between batches
                assert httpx.post(f"{proxy.url}/ng-rollout/{rid}/v1/chat/completions", json={}).is_success
            gate = _gate(server)
            threads, answers = _held_calls(proxy.url, rollouts, gate)
            _wait_in_flight(server, CALLS)
            armed.set()
            gate.open()
            for thread in threads:
                thread.join(BOUND)
            assert answers == [(200, b"".join(CHUNKS))] * CALLS
            assert jsonl.force_flush()
    finally:
        provider.shutdown()
    assert removed.is_set()
    accounted = [len(_accounted(store, rid)) for rid in rollouts]
    assert accounted == [CALLS // len(rollouts)] * len(rollouts)  # the warm-up calls went with the directory
    reasons = [reason for rid in rollouts for reason in _marked(store, rid).values()]
    assert reasons and all("removed" in reason for reason in reasons)
    assert jsonl.stats.failures == len(reasons)
