"""A process that holds ``flock(LOCK_EX)`` on a data file forever (issue 15): NeMo Gym's writers take that
lock for each append, so any process of the same user can take it and never let go. Every wait for it is
bounded by the lock timeout: the writer fails that rollout's batch (marked incomplete, saying why) and goes
on with the others; a call is answered; freeze, retire and drop raise :class:`LockTimeoutError`."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from support import ReplayModelServer, serve, submit

from otel_capture import (
    CaptureFrozenError,
    CaptureSettings,
    CaptureStore,
    LockTimeoutError,
    ModelCallCaptureMiddleware,
    WriterSettings,
    read_model_call_records,
)
from otel_capture._store import JsonlWriter
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

TIMEOUT = 0.5  # the lock timeout, set in code; every other bound below only proves "does not hang"
BOUND = 60
LINE = b'{"model_call_id": "%s", "dialect": "chat"}\n'

HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    while True:
        time.sleep(60)
    """
)


@contextmanager
def held_forever(path: Path) -> Iterator[None]:
    """Another process holds ``flock(LOCK_EX)`` on ``path`` until the block ends (then it is killed)."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
            yield
        finally:
            holder.kill()
            holder.wait(BOUND)


def _reason(store: CaptureStore, rid: str) -> str:
    return store.incomplete_path(rid).read_text()


def test_the_writer_fails_the_locked_rollout_and_goes_on_with_the_others(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "calls", lock_timeout_s=TIMEOUT)
    writer = JsonlWriter(store.root, lock_timeout_s=TIMEOUT)
    try:
        store.append_now("stuck", "c0", {"dialect": "chat"})
        with held_forever(store.data_path("stuck")):
            locked = submit(writer, "stuck", LINE % b"c1", "c1")
            other = submit(writer, "free", LINE % b"f1", "f1")
            assert locked is not None and other is not None
            with pytest.raises(LockTimeoutError, match=r"stuck\.capture\.jsonl locked by another process"):
                locked.result(BOUND)
            assert other.result(BOUND) is None  # the other rollout is written while the lock is held
            assert "stuck.capture.jsonl locked by another process for more than 0.5 s" in _reason(
                store, "stuck"
            )
            assert "c1" in _reason(store, "stuck")
            # Later batches of the stuck rollout fail too (without another full wait); others go on.
            again = submit(writer, "stuck", LINE % b"c2", "c2")
            more = submit(writer, "free", LINE % b"f2", "f2")
            assert again is not None and more is not None
            with pytest.raises(LockTimeoutError, match=r"stuck\.capture\.jsonl locked by another process"):
                again.result(BOUND)
            assert more.result(BOUND) is None
            assert [r.model_call_id for r in read_model_call_records(store, "free")] == ["f1", "f2"]
            assert not store.is_incomplete("free")
            assert writer.stats.failures == 2
        # The holder is gone: the rollout is written again.
        after = submit(writer, "stuck", LINE % b"c3", "c3")
        assert after is not None and after.result(BOUND) is None
        assert [r.model_call_id for r in read_model_call_records(store, "stuck")] == ["c0", "c3"]
    finally:
        writer.close(BOUND)


def _stripe_held(store: CaptureStore, rollout_id: str) -> bool:
    """Whether another open file (the writer's) holds the rollout's stripe lock now."""
    stripe = zlib.crc32(rollout_id.encode()) % 64
    fd = os.open(store.root / ".otel-capture" / "locks" / f"{stripe:02d}.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, "never came"
        time.sleep(0.01)


def test_a_writer_waiting_for_a_data_file_s_lock_holds_no_other_rollout_s_stripe(tmp_path: Path) -> None:
    """A batch whose first rollout's data file another process has locked: while the writer waits for
    that lock it holds that rollout's stripe only, so a freeze of another rollout of the same batch (on a
    later stripe) is not held up; the locked rollout is written once the lock is free, and the other's
    line, now after its freeze, is refused as late."""
    ids = [f"r{i}" for i in range(200)]
    stuck = next(rid for rid in ids if zlib.crc32(rid.encode()) % 64 < 30)
    later = next(rid for rid in ids if zlib.crc32(rid.encode()) % 64 > 40)
    store = CaptureStore(tmp_path / "calls", lock_timeout_s=TIMEOUT)
    writer = JsonlWriter(store.root, lock_timeout_s=BOUND)
    first_holder = ExitStack()
    try:
        for rid in ("first", stuck, later):
            store.append_now(rid, "c0", {"dialect": "chat"})
        first_holder.enter_context(held_forever(store.data_path("first")))
        first = submit(writer, "first", LINE % b"c1", "c1")
        _wait_until(lambda: _stripe_held(store, "first"))  # the writer waits in a batch of its own
        with held_forever(store.data_path(stuck)):
            locked = submit(writer, stuck, LINE % b"c1", "c1")  # queued meanwhile: the next batch
            other = submit(writer, later, LINE % b"c1", "c1")
            first_holder.close()
            assert first.result(BOUND) is None
            _wait_until(lambda: _stripe_held(store, stuck))  # waiting for the stuck rollout's file
            snap = store.freeze_now(later)  # its stripe waited for 0.5 s at most
            assert snap.version == 1
        assert locked.result(BOUND) is None
        with pytest.raises(CaptureFrozenError):
            other.result(BOUND)
        assert len(read_model_call_records(store, stuck)) == 2
    finally:
        first_holder.close()
        writer.close(BOUND)


def test_freeze_retire_and_drop_of_a_locked_rollout_raise_instead_of_hanging(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "calls", lock_timeout_s=TIMEOUT)
    store.append_now("live", "c0", {"dialect": "chat"})
    store.append_now("frozen", "c0", {"dialect": "chat"})
    snap = store.freeze_now("frozen")
    with held_forever(store.data_path("live")), held_forever(store.data_path("frozen")):
        with pytest.raises(
            LockTimeoutError, match=r"live\.capture\.jsonl locked by another process for more"
        ):
            store.freeze_now("live")
        with pytest.raises(LockTimeoutError, match=r"live\.capture\.jsonl locked by another process"):
            read_model_call_records(store, "live")
        # Retiring a frozen rollout counts its lines (its snapshot's version) under the lock.
        with pytest.raises(LockTimeoutError, match=r"frozen\.capture\.jsonl locked by another process"):
            store.retire_now(["frozen"])
        with pytest.raises(LockTimeoutError, match=r"frozen\.capture\.jsonl locked by another process"):
            store.drop_now("frozen", snapshot_id=snap.snapshot_id, version=snap.version)
        # A live rollout's records are moved out without reading them: retire needs no data-file lock.
        assert store.retire_now(["live"])["removed"] == ["live"]
        assert store.delete_now(["live"])["removed"] == ["live"]
    assert store.drop_now("frozen", snapshot_id=snap.snapshot_id, version=snap.version)


def test_the_store_s_own_locks_held_forever_fail_lifecycle_operations_and_never_hang(tmp_path: Path) -> None:
    """The stripe locks and the fence journal's lock are the store's own, but any process of the same user
    can take them too: a retire waits for them no longer than the lock timeout."""
    store = CaptureStore(tmp_path / "calls", lock_timeout_s=TIMEOUT)
    store.retire_now(["first"])  # creates .otel-capture/, its stripes and the journal's lock
    state = store.root / ".otel-capture"
    journal_lock = r"\.otel-capture/journal\.lock locked by another process"
    with held_forever(state / "journal.lock"), pytest.raises(LockTimeoutError, match=journal_lock):
        store.retire_now(["r"])
    assert store.rollout_state("r") == "absent"  # nothing half done
    stripe = next((state / "locks").iterdir())
    stripe_lock = r"\.otel-capture/locks/\d+\.lock locked by another process"
    with held_forever(stripe), pytest.raises(LockTimeoutError, match=stripe_lock):
        store.retire_now([f"r{i}" for i in range(200)])  # 200 ids cover every stripe
    assert store.retire_now(["r"])["absent"] == ["r"]


def test_a_call_to_a_locked_rollout_is_answered_and_its_rollout_says_why_it_is_incomplete(
    tmp_path: Path, replay_server: ReplayModelServer
) -> None:
    capture_dir = tmp_path / "calls"
    store = CaptureStore(capture_dir, lock_timeout_s=TIMEOUT)
    provider = TracerProvider()
    settings = WriterSettings.from_environ(directory=capture_dir, lock_timeout_s=TIMEOUT)
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(settings=settings)))
    app = ModelCallCaptureMiddleware(replay_server, tracer_provider=provider, settings=CaptureSettings())
    store.append_now("stuck", "c0", {"dialect": "chat"})
    try:
        with serve(app) as url, held_forever(store.data_path("stuck")):

            def chat(rollout_id: str) -> str | None:
                base_url = f"{url}/ng-rollout/{rollout_id}/v1"
                with openai.OpenAI(base_url=base_url, api_key="k", max_retries=0) as client:
                    reply = client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}]
                    )
                return reply.choices[0].message.content

            assert chat("stuck") == chat("free")  # answered whole, as if nothing were wrong
            assert "stuck.capture.jsonl locked by another process for more than 0.5 s" in _reason(
                store, "stuck"
            )
            assert len(read_model_call_records(store, "free")) == 1 and not store.is_incomplete("free")
            assert chat("stuck") is not None and chat("free") is not None
            assert len(read_model_call_records(store, "free")) == 2
            assert _reason(store, "stuck").count("locked by another process") == 2
    finally:
        provider.shutdown()
    assert [r.model_call_id for r in read_model_call_records(store, "stuck")] == ["c0"]
