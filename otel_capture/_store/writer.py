"""The durable JSONL writer: one background thread, group commit, one sync per batch.

Callers queue a call's line with its :class:`.writer_items.LoopWaiter` (``submit``) or its begin, abandon
or discard; the thread takes everything queued, appends it rollout by rollout through the fenced append
(:mod:`.append`), syncs the batch once (:mod:`.sync`) and only then resolves the waiters, one event-loop
wake-up per loop per batch. A call whose line did not reach the disk is handed to
:class:`.writer_failures.WriterFailures`, which marks it incomplete or keeps it in the loss reserve.

The promises it keeps are the durability contract's (``docs/durability.md``): D1, D3, D4, D5, D7, D8,
D10, D12, D13, D18, D19, D20, D22, D26 and L9, each cited where it is kept.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import queue
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from .._errors import CaptureFrozenError, LockTimeoutError, WriterClosedError
from .._rollout_id import validate_rollout_id
from .._settings import DEFAULT_LOCK_TIMEOUT_S
from .append import AppendJob, close_markers
from .batch_io import BatchIO
from .dirstate import DirState, dir_state
from .fs import DIR_MODE, FILE_MODE, AppendFiles, check_directory, checked_root, make_root
from .fstype import SyncChoice, choose_sync
from .libc import name_native_thread
from .locks import LockFiles, StripedLocks
from .sync import LIBC_SYNCFS, fsync_dir, sync_batch
from .uncorrelated import counter_for
from .weight import DeclaredVersions, WeightStamp, stamp_batch
from .writer_failures import WriterFailures
from .writer_items import Completions, LoopWaiter, WriterStats, _Abandon, _Barrier, _Begin, _Discard, _Item

__all__ = ["LIBC_SYNCFS", "JsonlWriter", "WriterClosedError", "WriterStats"]

_logger = logging.getLogger(__name__)


WRITER_THREAD = "otel-capture-writer"
"""The writer thread's name, in the kernel too (its first 15 bytes: :data:`WRITER_THREAD_KERNEL_NAME`)."""
WRITER_THREAD_KERNEL_NAME = WRITER_THREAD[:15]


_STOP = object()
_TICK = object()  # wakes an idle thread so that it starts timing a begin's marker delay

MARKER_DELAY = 0.02
"""Seconds a begun call may go without its ``+`` marker file (contract D19)."""
MARKER_EARLY = 0.5
"""When a begin's marker falls due, the markers of the begins due within this share of the delay are
written in the same batch, early and never late (contract D19): calls that began together (a batch of an RL
run's calls, which the loop takes one after another) cost one marker batch, not one each."""
LOCKED_OUT_WAIT = 0.1
"""Seconds a batch waits for a data file whose lock outlasted the lock timeout and was not seen free since
(contract D22)."""
_MARKER_SLACK = 0.0005
"""Seconds early the writer's timer may find a marker due (the loop's clock and the begin's are read apart):
the thread, woken, times what is left itself."""
_VALID_IDS_KEPT = 4096
"""Rollout ids a writer remembers as validated; the set starts over when full."""
IDLE_CLOSE = 10.0
"""Seconds without a batch after which the thread closes what it keeps open between batches (data files,
markers, stripe lock files, the directory's descriptors). Longer than the gap between a rollout's calls in
most agent loops (a tool step of a few seconds) and between vLLM's batches of long generations: a rollout
whose next call comes after a quiet second no longer opens, checks and creates its files again (the writer's
CPU per call, 8 rollouts calling again every 1.5 s, ``python -m bench.bench_marker --gap 1500``: 577 and 692
us at 1 s, 282 and 302 us at 10 s, in two runs). A retired
or deleted rollout's file is still not held for long, and a busy writer keeps its files to
:func:`.fs.kept_limit` whatever this is."""


class JsonlWriter:
    """Appends record lines to per-rollout files from one background thread, with group commit.

    Raises :class:`UnsafeDirectoryError` for a directory other users can write, unless
    ``allow_shared_directory``. ``fsync`` is a seam for tests that inject failures (a failing disk), not a
    tuning knob.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        allow_shared_directory: bool = False,
        fsync: Callable[[int], None] = os.fsync,
        syncfs: Callable[[int], None] | None = LIBC_SYNCFS,
        file_mode: int = FILE_MODE,
        dir_mode: int = DIR_MODE,
        marker_delay: float = MARKER_DELAY,
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
        local_reserve_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.root = Path(root)
        self._allow_shared = allow_shared_directory
        self._lock_timeout = lock_timeout_s
        self._locked_out: dict[
            str, float
        ] = {}  # rollout -> when its data file's lock timed out (thread only)
        check_directory(self.root, allow_shared=allow_shared_directory)
        self._state: DirState = dir_state(self.root)
        self._state.shared_allowed |= allow_shared_directory  # the uncorrelated counts follow its choice
        self.stats = WriterStats()
        self._fsync = fsync
        self._done = Completions()  # the calls' waiters, resolved one wake-up per loop per batch
        self._failures = WriterFailures(
            self._state,
            self.stats,
            self._done,
            _logger,
            lock_timeout=lock_timeout_s,
            fsync=fsync,
            file_mode=file_mode,
            local_base=local_reserve_dir,  # None: OTEL_CAPTURE_LOCAL_RESERVE_DIR, else ~/.local/state/...
        )
        self._syncfs = syncfs
        # Why a filesystem decides the sync: syncfs does not reach a network or FUSE server (see _sync).
        self.sync_choice: SyncChoice = choose_sync(self.root, syncfs_allowed=syncfs is not None)
        _logger.info("capture directory %s: %s", self.root, self.sync_choice.describe())
        # a network or FUSE filesystem: a batch's stripes are written at once (see batch_io)
        self._io = BatchIO(self.sync_choice.shared, fsync)
        self._file_mode = file_mode
        self._dir_mode = dir_mode
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._marker_delay = marker_delay
        self._begins: deque[_Begin] = deque()  # begun, not yet seen by the thread (no wake-up each)
        self._deferred: dict[tuple[str, str], _Begin] = {}  # seen by the thread, no marker yet (thread only)
        self._idle = False  # the thread is blocked with nothing to time: a begin must wake it
        # The one wake-up pending on an event loop for the oldest unseen begin's marker (see begin): when it
        # falls due (monotonic) and on which loop. A begin before then, on that loop, arms nothing.
        self._wake_at = 0.0
        self._wake_loop: asyncio.AbstractEventLoop | None = None
        self._valid_ids: set[str] = set()  # rollout ids this writer has validated (see _valid)
        self._files = AppendFiles()  # data files kept open between batches (thread only)
        self._lock_files = LockFiles()  # stripe lock files kept open between batches (thread only)
        # the directory descriptors, kept between batches too (thread only; revalidated each batch)
        self._dirs = self._state.dirs(lock_timeout=lock_timeout_s, keep=True)
        self.weights: DeclaredVersions = self._state.weights  # refreshed once per batch
        self._closed = False
        self._wrote_in: tuple[int, int] | None = None  # the directory the last batch wrote in (dev, ino)
        self._thread = threading.Thread(target=self._run, name=WRITER_THREAD, daemon=True)
        self._thread.start()

    # -- API used by the exporter --------------------------------------------------------------------

    def begin(self, rollout_id: str, model_call_id: str) -> None:
        """A call of ``rollout_id`` has started. Costs a dict insert and a deque append: the in-process view
        of calls in flight is updated at once; the ``+`` marker other processes read is written by the
        thread, and only for a call still in flight ``marker_delay`` after it began (or at a ``flush``):
        a call whose line comes sooner is admitted in its line's batch with no marker file I/O at all. A
        begin wakes the thread only when it is idle with nothing else to time, and then, from an event
        loop, only when a marker falls due: one timer per writer there, armed by the first begin the idle
        thread has not seen and re-armed for the next one when it fires (contract D19)."""
        rid = self._valid(rollout_id)
        if self._closed:
            return  # its line or its abandon is what gets counted and marked
        self._state.calls.begin(rid, model_call_id)
        at = time.monotonic()
        self._begins.append(_Begin(rid, model_call_id, at))
        if self._idle:
            self._wake_when_due(at)

    def _valid(self, rollout_id: str) -> str:
        """``rollout_id``, validated once per writer (a call's ``begin`` and ``submit`` check it once; a
        rollout's later calls find it in a set), else :class:`InvalidRolloutIdError`."""
        if type(rollout_id) is str and rollout_id in self._valid_ids:
            return rollout_id
        rid = validate_rollout_id(rollout_id)
        if len(self._valid_ids) >= _VALID_IDS_KEPT:
            self._valid_ids.clear()
        self._valid_ids.add(rid)
        return rid

    def _wake_when_due(self, at: float) -> None:
        """The thread is idle with nothing to time: it must wake when the marker of a call begun at ``at``
        falls due. On an event loop the writer's one timer there does it (:meth:`_marker_due`): armed now
        unless it is already pending on this loop for an earlier begin; elsewhere the thread is woken now
        to time it itself."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._queue.put(_TICK)
            return
        if at < self._wake_at and loop is self._wake_loop:
            return  # the pending timer fires first, and re-arms for this begin if it is still unseen
        self._wake_at = at + self._marker_delay
        self._wake_loop = loop
        loop.call_later(self._marker_delay, self._marker_due)

    def _marker_due(self) -> None:
        """The writer's timer, on an event loop: if the thread is still idle, the oldest begin it has not
        seen is a call still in flight (a line, abandon or discard would have woken the thread); the
        thread is woken if its marker is due, else the timer is re-armed for when it is. Nothing unseen,
        or the thread awake (it times the begins itself): nothing to do, and no timer left armed."""
        self._wake_at = 0.0  # spent: the next begin arms one unless this one is re-armed below
        if not self._idle:
            return
        try:
            oldest = self._begins[0]
        except IndexError:
            return
        now = time.monotonic()
        due = oldest.at + self._marker_delay
        if due <= now + _MARKER_SLACK:
            self._queue.put(_TICK)
            return
        loop = asyncio.get_running_loop()
        self._wake_at = due
        self._wake_loop = loop
        loop.call_later(due - now, self._marker_due)

    def abandon(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """A begun call whose record could not even be built: count it, log it, and mark the rollout
        incomplete with the reason, so neither the loss nor a phantom in-flight call goes unseen
        (contract D20)."""
        rid = self._valid(rollout_id)
        if self._closed:
            self._failures.after_close(rid, model_call_id, None)
            return
        self._queue.put(_Abandon(rid, model_call_id, reason))

    def discard(self, rollout_id: str, model_call_id: str) -> None:
        """A begun call that turned out not to be a model call (the upstream redirected it): it ends
        without a line or an incomplete mark; its ``-`` marker is written only if its ``+`` was
        (contract D20)."""
        if not self._closed:
            self._queue.put(_Discard(self._valid(rollout_id), model_call_id))

    def submit(
        self,
        rollout_id: str,
        line: bytes,
        model_call_id: str,
        tokens_line: bytes | None,
        waiter: LoopWaiter,
        weight: WeightStamp | None = None,
    ) -> None:
        """Queue one line (ending in ``\\n``), and its token line if any; the thread resolves ``waiter`` when
        both are durable, or with the error that kept them off disk. After :meth:`close` the call is
        counted, logged once and marked incomplete, and ``waiter`` fails with :class:`WriterClosedError`
        (contract D12).
        With ``weight`` (the caller's weight version, the call's start and end), the declared weight
        versions are added to the line in its batch (:func:`.weight.stamp_batch`)."""
        item = _Item(self._valid(rollout_id), line, model_call_id, tokens_line, waiter, weight=weight)
        if self._closed:
            self._failures.after_close(item.rollout_id, model_call_id, item)
            return
        self._queue.put(item)

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

    def _next(self) -> object:
        """The next queued object; ``_TICK`` when the oldest deferred begin's marker falls due first."""
        self._idle = True  # set before looking: a begin either is seen here or sees the flag and wakes us
        try:
            if self._deferred or self._begins:
                self._idle = False  # timing the oldest begin: the ones after it fall due later
                oldest = next(iter(self._deferred.values()), None) or self._begins[0]
                timeout = oldest.at + self._marker_delay - time.monotonic()
                retry = self._failures.retry_in()
                if retry is not None:
                    timeout = min(timeout, retry)
                if timeout <= 0:
                    return _TICK
                try:
                    return self._queue.get(timeout=timeout)
                except queue.Empty:
                    return _TICK
            if self._files or self._lock_files or self._dirs.is_open() or self._state.markers.kept_count():
                try:
                    return self._queue.get(timeout=IDLE_CLOSE)
                except queue.Empty:
                    self._close_markers()  # idle: the rollouts are closed, their markers removed (D19)
                    self._files.close_all()  # idle: a retired rollout's file is not held open for long
                    self._lock_files.close_all()
                    self._dirs.close()
            retry = self._failures.retry_in()
            if retry is not None:  # lost calls whose marks are still to be written
                try:
                    return self._queue.get(timeout=retry)
                except queue.Empty:
                    return _TICK
            return self._queue.get()
        finally:
            self._idle = False

    def _due_begins(
        self, batch: list[_Item], abandons: list[_Abandon], discards: list[_Discard], force: bool
    ) -> list[_Begin]:
        """The begins this batch handles: those whose line is in it (admitted with it, no marker) and those
        in flight ``marker_delay`` or longer, or all at a flush or stop (their ``+`` marker is written).
        The rest wait for their line; an abandoned or discarded call's begin is forgotten (it never got a
        marker)."""
        deferred = self._deferred
        while self._begins:
            begin = self._begins.popleft()
            deferred[(begin.rollout_id, begin.model_call_id)] = begin
        for abandoned in abandons:
            deferred.pop((abandoned.rollout_id, abandoned.model_call_id), None)
        for discarded in discards:  # one still deferred never got its marker: nothing to end on disk
            discarded.marked = deferred.pop((discarded.rollout_id, discarded.model_call_id), None) is None
        due: list[_Begin] = []
        for item in batch:
            paired = deferred.pop((item.rollout_id, item.model_call_id), None)
            if paired is not None:
                due.append(paired)
        if force:
            due.extend(deferred.values())
            deferred.clear()
            return due
        cutoff = time.monotonic() - self._marker_delay
        first = next(iter(deferred.values()), None)
        if first is not None and first.at <= cutoff:  # one is due: those due soon after go with it
            cutoff += self._marker_delay * MARKER_EARLY
        while deferred:
            key, begin = next(iter(deferred.items()))  # begins are kept in the order they began
            if begin.at > cutoff:
                break
            del deferred[key]
            due.append(begin)
        return due

    def _run(self) -> None:
        name_native_thread(self._thread.name)
        # SCHED_BATCH (Linux): a wake-up of the writer does not preempt the thread running, the event loop
        # holding the GIL that the writer would then wait for; its share of the CPU is unchanged
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        self._prepare(_existing(self.root))  # its reserve before any call is taken (contract D42)
        stop = False
        while not stop:
            batch: list[_Item] = []
            abandons: list[_Abandon] = []
            discards: list[_Discard] = []
            barriers: list[_Barrier] = []
            obj = self._next()
            while True:
                if obj is _STOP:
                    stop = True
                elif isinstance(obj, _Barrier):
                    barriers.append(obj)
                elif isinstance(obj, _Abandon):
                    abandons.append(obj)
                elif isinstance(obj, _Discard):
                    discards.append(obj)
                elif obj is not _TICK:
                    batch.append(obj)  # type: ignore[arg-type]  # only _Item, _Abandon, _Discard, _Barrier, _TICK, _STOP are queued
                try:
                    obj = self._queue.get_nowait()
                except queue.Empty:
                    break
            begins = self._due_begins(batch, abandons, discards, force=stop or bool(barriers))
            if batch or begins:
                stamp_batch(self.weights, batch)  # the declared weight version: one stat per batch
                try:
                    self._write_batch(batch, begins)
                except Exception as exc:  # a bug fails the calls, never leaves them waiting (contract D3)
                    _logger.exception("capture writer failed on a batch of %d call(s)", len(batch))
                    for item in batch:
                        if not item.resolved:
                            self._done.resolve(item, exc)
            for abandoned in abandons:
                self._failures.abandon(abandoned)
            for discarded in discards:
                self._failures.discard(discarded)
            self._prepare(self._wrote_in)  # before this batch's calls are acknowledged (contract D42)
            self._done.flush()
            try:
                self._failures.retry(force=bool(barriers))
            except Exception:  # a bug here must not stop the thread: the losses stay kept and counted
                _logger.exception("capture writer failed retrying the incomplete marks it holds")
            for barrier in barriers:
                barrier.future.set_result(None)
        self._io.close()
        self._close_markers()
        self._dirs.close()
        self._files.close_all()
        self._lock_files.close_all()
        self._failures.close()

    def _write_batch(self, batch: list[_Item], begins: list[_Begin]) -> None:
        if batch:
            self.stats.batches += 1
        by_rollout: dict[str, list[_Item]] = {}
        for item in batch:
            by_rollout.setdefault(item.rollout_id, []).append(item)
        begun: dict[str, list[str]] = {}
        for begin in begins:
            begun.setdefault(begin.rollout_id, []).append(begin.model_call_id)
            by_rollout.setdefault(begin.rollout_id, [])
        try:
            root_st = self._ensure_dir()
        except OSError as exc:
            self._failures.fail_all(batch, exc)
            return
        stripes: dict[int, list[AppendJob]] = {}
        for rollout_id, items in by_rollout.items():
            job = AppendJob(
                rollout_id,
                [(i.model_call_id, i.line, i.tokens_line) for i in items],
                begun.get(rollout_id, []),
                self._data_lock_wait(rollout_id),
            )
            stripes.setdefault(StripedLocks.stripe(rollout_id), []).append(job)
        # Phase 1: every rollout's lines are written (each under its lock, fenced), a stripe at a time or,
        # on a network filesystem, stripes at once, each then syncing its files (contract D3, D7).
        written: list[tuple[str, list[_Item]]] = []
        fds: list[int] = []
        created_any = False
        sync_error: OSError | None = None
        synced = 0
        dirs = self._dirs
        dirs.revalidate(root_st)  # kept from the last batch: each still the directory its name leads to
        try:
            wrote_in = self._wrote_in = dirs.identity()
            done = self._io.run(
                self._state,
                dirs,
                stripes,
                file_mode=self._file_mode,
                files=self._files,
                lock_files=self._lock_files,
            )
        except BaseException:
            dirs.close()
            raise
        if any(isinstance(result, OSError) for stripe in done for result in stripe.results):
            dirs.close()  # reopened afresh: the failure may have been a directory removed under us
        for stripe in done:
            synced += stripe.fsyncs
            sync_error = sync_error or stripe.sync_error
            for job, result in zip(stripe.jobs, stripe.results, strict=True):
                rollout_id, items = job.rollout_id, by_rollout[job.rollout_id]
                if isinstance(result, OSError):
                    # that rollout fails and is marked; the others go on (contract D5, D22)
                    failure = self._locked_out_error(rollout_id, result)
                    self._failures.fail_append(rollout_id, items, job.begins, failure)
                    continue
                self._locked_out.pop(rollout_id, None)
                self._failures.unmarked(rollout_id, result, items)
                for index, error in result.dropped:
                    self._drop_late(items[index], error)
                written.append((rollout_id, [items[index] for index in result.accepted]))
                if not stripe.synced:
                    fds.extend(result.fds)
                created_any |= result.created
        # Phase 2: the whole batch is durable (one sync, or the workers' fsyncs and the directory's); only
        # then is any call acknowledged (contract D1, D3, D9). The files stay open for the next batch
        # (AppendFiles), unless a sync failed.
        try:
            self.stats.fsyncs += synced
            if sync_error is not None:
                raise sync_error
            if synced:
                fds.clear()  # on a network filesystem every file was synced by its stripe's worker
                if created_any:
                    fsync_dir(self.root, self._fsync)  # the new files' entries (contract D10)
                    self.stats.fsyncs += 1
            else:
                self._sync(fds, created_any)
        except OSError as exc:
            self._files.close_all()  # after a failed fsync, nothing is assumed of those descriptors
            for rollout_id, items in written:
                if items:
                    self._failures.fail(rollout_id, items, exc)
            return
        self._files.trim()
        self._close_markers(leave=self._state.markers.limit)
        if written and not self._still_there(wrote_in):
            # The directory was removed (or replaced) under the batch: its lines went into files no reader
            # will find. Nothing is acknowledged; each call is marked in the directory as it is now
            # (contract D18).
            self._dirs.close()
            self._files.close_all()
            self._lock_files.close_all()
            gone = OSError(errno.ENOENT, "the capture directory was removed or replaced during the write")
            reason = f"capture_error: {gone.strerror}: the line went into a removed file"
            for rollout_id, items in written:
                if items:
                    self._failures.fail(rollout_id, items, gone, reason)
            return
        for _, items in written:
            self.stats.records_written += len(items)
            for item in items:
                self._done.resolve(item)

    def _close_markers(self, leave: int = 0) -> None:
        """Close the rollouts whose in-flight markers the writer keeps beyond ``leave`` (:func:`.append.close_markers`),
        a bug logged, never raised: the markers left are empty or name calls in flight (contract D19)."""
        if self._state.markers.kept_count() <= leave:
            return
        try:
            if self._dirs.is_open():  # the directory the markers were written in
                close_markers(self._state, self._dirs, self._lock_files, leave=leave)
            else:  # closed after a failure: never made again here (a marker elsewhere is left alone)
                with self._state.dirs(create=False, lock_timeout=self._lock_timeout) as dirs:
                    close_markers(self._state, dirs, leave=leave)
        except Exception:
            _logger.exception("capture writer failed closing its in-flight markers")

    def _data_lock_wait(self, rollout_id: str) -> float:
        """The lock timeout, or :data:`LOCKED_OUT_WAIT` for a data file whose lock already timed out and
        has not been seen free since (the thread serves every rollout: it pays one timeout per episode)."""
        if rollout_id in self._locked_out:
            return min(self._lock_timeout, LOCKED_OUT_WAIT)
        return self._lock_timeout

    def _locked_out_error(self, rollout_id: str, exc: OSError) -> OSError:
        """Remember a data file whose lock timed out; the error says how long it has been locked in all."""
        if not isinstance(exc, LockTimeoutError) or not exc.label.startswith(rollout_id + "."):
            return exc
        now = time.monotonic()
        since = self._locked_out.setdefault(rollout_id, now - exc.waited)
        return LockTimeoutError(exc.label, max(round(now - since, 1), exc.waited))

    def _sync(self, fds: list[int], created: bool) -> None:
        """Make the batch durable (:func:`.sync.sync_batch`: one ``syncfs`` or an ``fsync`` per file)
        (contract D4, D10)."""
        self.stats.fsyncs += sync_batch(fds, created, self.root, self.sync_choice, self._fsync, self._syncfs)

    def _prepare(self, identity: tuple[int, int] | None) -> None:
        """Ahead of need: at the writer's start in a directory that exists, and before the calls of a batch
        in a directory not prepared yet are acknowledged (its first, or one made anew), the state directory
        and the loss reserve (one a stopped writer handed on, else made), while the filesystem still has
        room; where the directory gives none, the node-local reserve. A directory already prepared costs
        nothing (contract D13, D42, D44, L15)."""
        if identity is None or self._failures.prepared(identity):
            return
        try:
            with self._state.dirs(lock_timeout=self._lock_timeout) as dirs:
                self._failures.prepare(dirs, identity)
        except Exception as exc:  # made by a later pass; a bug here must not stop the thread (contract D3)
            _logger.debug("could not prepare %s: %s", self.root, exc)
            self._failures.no_reserve(exc)

    def _still_there(self, wrote_in: tuple[int, int]) -> bool:
        """Whether the capture directory's path still leads to the directory the batch wrote in (one
        ``stat`` per batch, after its sync: what a batch acknowledges is in a file a reader can find)."""
        try:
            return _identity(os.stat(self.root)) == wrote_in
        except OSError:
            return False

    def _ensure_dir(self) -> os.stat_result:
        """Checked each batch (one ``stat``, returned): a directory made world-writable under a running
        writer stops capture. Created 0700 (records are training data); its parent is synced so it
        survives a crash (contract D10, D18, D26)."""
        st = checked_root(self.root, allow_shared=self._allow_shared)
        if st is None:
            make_root(self.root, self._fsync, self._dir_mode)
            st = os.stat(self.root)
        return st

    def _drop_late(self, item: _Item, error: CaptureFrozenError) -> None:
        # Not a failure: a late call of a frozen or retired rollout is the lifecycle working (contract L9).
        # Not silent either: counted in the directory for check and ls (the middleware logs it, metered).
        self.stats.late_write_dropped += 1
        counter_for(self.root).count_late(item.rollout_id)
        self._done.resolve(item, error)


def _existing(root: Path) -> tuple[int, int] | None:
    """The identity of ``root`` when it is a directory, else ``None``."""
    try:
        st = os.stat(root)
    except OSError:
        return None
    return _identity(st) if stat.S_ISDIR(st.st_mode) else None


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
