"""The durable JSONL writer: one background thread, group commit, one ``fsync`` per file per batch.

Durability contract (DESIGN §5), written before the code:

* ``submit(rollout_id, line)`` returns a future. It resolves with ``None`` only once the line is in
  ``<dir>/<rollout_id>.capture.jsonl`` *and* ``fsync``-ed, and, when this batch created the file, once the
  directory entry is ``fsync``-ed too (a crash after the file's fsync but before the directory's could
  otherwise lose the whole file). It resolves with an exception when the line could not be made durable;
  the writer then appends the reason to ``<rollout_id>.capture.incomplete`` (best effort) so the rollout
  is visibly incomplete.
* Each append takes ``flock(LOCK_EX)`` on the data file itself (not a separate lock file), exactly as
  NeMo Gym 0.7.0 does, so its writers and readers interleave with ours on the same files. The lock covers
  only the ``write``; the ``fsync`` runs after unlocking because fsync makes durable whatever is in the
  file, whoever wrote it, and holding the lock through a disk flush would stall every other writer.
* Every line of a batch for one file goes out in a single ``write`` of whole lines, so a reader never sees
  half of one of our lines unless the process dies inside that ``write`` (a torn tail, which the reader
  reports and never parses).
* The event loop never touches the disk: callers await the future (``asyncio.wrap_future``).

Concurrent calls that finish together share a batch: the thread takes everything queued, writes it file
by file, and syncs each file once.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from ._correlation import validate_rollout_id
from ._store import CAPTURE_SUFFIX, INCOMPLETE_SUFFIX

_logger = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700


@dataclass(slots=True)
class _Item:
    rollout_id: str
    line: bytes
    model_call_id: str
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


@dataclass(slots=True)
class WriterStats:
    """Counters a user can read to see what the writer did (and what it failed to do)."""

    records_written: int = 0
    batches: int = 0
    fsyncs: int = 0
    failures: int = 0
    last_failure: str | None = None


class _Barrier:
    def __init__(self) -> None:
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()


_STOP = object()


class JsonlWriter:
    """Appends record lines to per-rollout files from one background thread, with group commit.

    ``fsync`` is a seam for tests that inject failures (a failing disk), not a tuning knob.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: Callable[[int], None] = os.fsync,
        file_mode: int = FILE_MODE,
        dir_mode: int = DIR_MODE,
    ) -> None:
        self.root = Path(root)
        self.stats = WriterStats()
        self._fsync = fsync
        self._file_mode = file_mode
        self._dir_mode = dir_mode
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="otel-capture-writer", daemon=True)
        self._thread.start()

    # -- API used by the exporter --------------------------------------------------------------------

    def submit(self, rollout_id: str, line: bytes, model_call_id: str) -> concurrent.futures.Future[None]:
        """Queue one line (ending in ``\\n``); the future resolves when it is durable or failed."""
        item = _Item(validate_rollout_id(rollout_id), line, model_call_id)
        if self._closed:
            item.future.set_exception(RuntimeError("capture writer is closed"))
            return item.future
        self._queue.put(item)
        return item.future

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every line submitted before this call is durable or failed. False on timeout."""
        if self._closed and not self._thread.is_alive():
            return True
        barrier = _Barrier()
        self._queue.put(barrier)
        try:
            barrier.future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Write out what is queued, then stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # -- the writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            batch: list[_Item] = []
            barriers: list[_Barrier] = []
            obj = self._queue.get()
            while True:
                if obj is _STOP:
                    stop = True
                elif isinstance(obj, _Barrier):
                    barriers.append(obj)
                else:
                    batch.append(obj)  # type: ignore[arg-type]  # only _Item, _Barrier or _STOP are queued
                try:
                    obj = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._write_batch(batch)
            for barrier in barriers:
                barrier.future.set_result(None)

    def _write_batch(self, batch: list[_Item]) -> None:
        self.stats.batches += 1
        by_rollout: dict[str, list[_Item]] = {}
        for item in batch:
            by_rollout.setdefault(item.rollout_id, []).append(item)
        created_any = False
        done: list[_Item] = []
        try:
            self._ensure_dir()
        except OSError as exc:
            self._fail_all(batch, exc)
            return
        for rollout_id, items in by_rollout.items():
            try:
                created_any |= self._append(rollout_id, items)
            except OSError as exc:
                self._fail(rollout_id, items, exc)
            else:
                done.extend(items)
        if created_any and done:
            try:
                self._sync_dir()
            except OSError as exc:
                self._fail_all(done, exc)
                return
        self.stats.records_written += len(done)
        for item in done:
            item.future.set_result(None)

    def _ensure_dir(self) -> None:
        if self.root.is_dir():
            return
        # Created 0700 (records are training data); its parent is synced so the directory survives a crash.
        self.root.mkdir(mode=self._dir_mode, parents=True, exist_ok=True)
        _fsync_dir(self.root.parent, self._fsync)

    def _append(self, rollout_id: str, items: list[_Item]) -> bool:
        """Append the lines of one rollout; returns whether the file was created by this call."""
        path = self.root / (rollout_id + CAPTURE_SUFFIX)
        created = False
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._file_mode)
            created = True
        except FileExistsError:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            data = b"".join(item.line for item in items)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                start = os.fstat(fd).st_size
                try:
                    _write_all(fd, data)
                except OSError:
                    # A short write (a full disk) would leave half a line that every later append would
                    # follow: cut the file back to where this batch started, under the same lock.
                    _truncate_quietly(fd, start)
                    raise
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            self._fsync(fd)
            self.stats.fsyncs += 1
        finally:
            os.close(fd)
        return created

    def _sync_dir(self) -> None:
        _fsync_dir(self.root, self._fsync)
        self.stats.fsyncs += 1

    # -- failures ------------------------------------------------------------------------------------

    def _fail_all(self, items: list[_Item], exc: OSError) -> None:
        by_rollout: dict[str, list[_Item]] = {}
        for item in items:
            by_rollout.setdefault(item.rollout_id, []).append(item)
        for rollout_id, group in by_rollout.items():
            self._fail(rollout_id, group, exc)

    def _fail(self, rollout_id: str, items: list[_Item], exc: OSError) -> None:
        reason = f"{type(exc).__name__}: {errno.errorcode.get(exc.errno or 0, '')} {exc.strerror or exc}".strip()
        self.stats.failures += len(items)
        self.stats.last_failure = reason
        _logger.error("capture of %d call(s) of rollout %s failed: %s", len(items), rollout_id, reason)
        self._mark_incomplete(rollout_id, [item.model_call_id for item in items], reason)
        for item in items:
            item.future.set_exception(exc)

    def _mark_incomplete(self, rollout_id: str, model_call_ids: list[str], reason: str) -> None:
        lines = b"".join(
            orjson.dumps(
                {"model_call_id": mcid, "reason": reason, "at": time.time()},
                option=orjson.OPT_APPEND_NEWLINE,
            )
            for mcid in model_call_ids
        )
        path = self.root / (rollout_id + INCOMPLETE_SUFFIX)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, self._file_mode)
            try:
                _write_all(fd, lines)
                self._fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            # The disk that refused the record may refuse the marker too; the log line is all that is left.
            _logger.error("could not mark rollout %s incomplete: %s", rollout_id, exc)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _truncate_quietly(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        _logger.error("could not cut a partly written batch back to %d bytes: %s", size, exc)


def _fsync_dir(path: Path, fsync: Callable[[int], None]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync(fd)
    finally:
        os.close(fd)
