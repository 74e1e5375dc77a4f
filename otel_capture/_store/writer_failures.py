"""How :class:`.writer.JsonlWriter` ends the calls whose line did not reach the disk
(contract D5, D12, D13, D20): failed, counted, and marked incomplete with the reason; a mark that cannot
be written is a pending loss, kept in the loss reserve (:mod:`.losses`) and in memory and retried until
the marker takes it. The writer has its reserve before it acknowledges a call, one handed on by a writer
that stopped if there is one (contract D42); where the directory cannot give it one, or cannot be written
at all, its losses go to the node-local reserve (contract D44), and where that fails too, ``check`` is
told that a running writer's memory holds them (contract D43). :class:`WriterFailures` is owned by the
writer: it is given the directory's state, the writer's counters, the completions it resolves calls
through, and the writer's logger.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import DamagedEntryError, UnsafeDirectoryError, WriterClosedError
from .append import AppendOutcome, fenced_mark_incomplete
from .dirstate import DirState
from .fs import DirFds, describe_error
from .journal import Fence
from .losses import Label, LossReserve, local_reserve_dir, orphans, shared_label
from .names import INCOMPLETE_SUFFIX, LOSSES_DIR
from .writer_items import Completions, WriterStats, _Abandon, _Discard, _Item

RETRY_S = 0.5
"""Seconds between two tries to write the incomplete marks that could not be written."""


@dataclass(slots=True)
class _PendingLoss:
    """A loss whose mark is not in its rollout's marker yet (a pending entry of the reserve, :mod:`.losses`,
    when it has one; ``WriterStats.unreported`` counts them)."""

    model_call_ids: list[str]
    reason: str
    reserve: LossReserve | None  # the reserve that holds its entry; None: in memory only
    offset: int | None  # its entry there


class WriterFailures:
    """The failure handling of one writer: run on its thread (``after_close`` on the caller's)."""

    def __init__(
        self,
        state: DirState,
        stats: WriterStats,
        completions: Completions,
        logger: logging.Logger,
        *,
        lock_timeout: float,
        fsync: Callable[[int], None],
        file_mode: int,
        local_base: str | os.PathLike[str] | None = None,
    ) -> None:
        self._state = state
        self._stats = stats
        self._completions = completions
        self._logger = logger
        self._lock_timeout = lock_timeout
        self._fsync = fsync
        self._file_mode = file_mode
        self._reserve = LossReserve(file_mode)
        local = self._local_path = local_reserve_dir(state.root, local_base)
        self._local = LossReserve(file_mode, label=lambda name: str(local / name))
        self._local_fd: int | None = None  # the node-local reserve's directory, once needed
        self._said_local = False
        self._in_memory = 0  # calls of pending losses that no reserve holds
        self._memory_fd: int | None = None  # the capture directory, held LOCK_SH while _in_memory (D43)
        self._orphans_left = False  # an adopted reserve still holds losses its marks could not take
        self._pending: dict[str, list[_PendingLoss]] = {}
        self._next_retry = 0.0
        self._unmarked: dict[tuple[str, str], str] = {}  # begun calls without their "+" marker -> reason
        self._ready_in: tuple[int, int] | None = None  # the directory whose state and reserve are made
        self._late: concurrent.futures.ThreadPoolExecutor | None = None
        self._late_lock = threading.Lock()

    # -- the directory made ready ahead of need --------------------------------------------------------

    def prepared(self, identity: tuple[int, int]) -> bool:
        return identity == self._ready_in

    def prepare(self, dirs: DirFds, identity: tuple[int, int] | None = None) -> None:
        """Make the state directory whole, adopt what writers that are gone left, and have this writer's
        loss reserve (one handed on, else a new one), unless done for the directory ``identity`` names
        (``(st_dev, st_ino)``; ``None``: look). Called by the writer at its start and before it acknowledges
        a batch in a directory not prepared yet (contract D42), and before a loss is recorded. Where the
        directory cannot give it a reserve, the node-local one is made instead (contract D44)."""
        if identity is not None and identity == self._ready_in:
            return
        try:
            complete = self._state.prepare(dirs)
        except Exception as exc:  # never fails the batch: made by a later one
            complete = False
            self._logger.debug("could not make the state directory of %s yet: %s", self._state.root, exc)
        self._adopt()  # first: a dead writer's reserve whose losses are all written is handed on to this one
        try:
            if not self._reserve.ready(dirs):
                self._reserve.open(dirs, self._fsync)
        except Exception as exc:  # never fails the batch
            self.no_reserve(exc)
            return
        if complete and identity is not None:
            self._ready_in = identity

    def no_reserve(self, exc: Exception) -> None:
        """The directory gives this writer no reserve: the node-local one holds its losses (contract D44)."""
        if self._local.is_open:
            return
        try:
            self._open_local()
        except Exception as local_exc:  # never fails the batch: its losses are kept in memory, and said
            if not self._said_local:
                self._said_local = True
                self._logger.error(
                    "no loss reserve in %s (%s), nor in the node-local %s (%s): a loss this writer cannot mark "
                    "is kept in its memory only while it runs, and check says so (contract D43)",
                    self._state.root,
                    exc,
                    self._local_path,
                    local_exc,
                )
            return
        self._logger.warning(
            "no loss reserve in %s (%s): the losses this writer cannot mark there are kept in the node-local "
            "reserve %s until they can be (contract D44)",
            self._state.root,
            exc,
            self._local.label,
        )

    def _local_dir(self, *, create: bool) -> int | None:
        """The node-local reserve's directory (made ``0700`` when ``create``), or ``None`` when absent."""
        for _ in range(2 if create else 1):  # twice: another writer's stop may remove it in between
            if self._local_fd is not None:
                break
            if create:
                os.makedirs(self._local_path, mode=0o700, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self._local_fd = os.open(
                    self._local_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                )
        return self._local_fd

    def _open_local(self) -> None:
        dir_fd = self._local_dir(create=True)
        if dir_fd is None:
            raise FileNotFoundError(f"{self._local_path}: removed as it was made")
        self._local.open_in(dir_fd, self._fsync)

    # -- ending calls ----------------------------------------------------------------------------------

    def fail_all(self, items: list[_Item], exc: OSError) -> None:
        if isinstance(exc, UnsafeDirectoryError):  # refused: not even an incomplete marker is written there
            self._stats.failures += len(items)
            self._stats.last_failure = str(exc)
            self._logger.error("capture of %d call(s) failed: %s", len(items), exc)
            for item in items:
                self._completions.resolve(item, exc)
            return
        by_rollout: dict[str, list[_Item]] = {}
        for item in items:
            by_rollout.setdefault(item.rollout_id, []).append(item)
        for rollout_id, group in by_rollout.items():
            self.fail(rollout_id, group, exc)

    def fail(self, rollout_id: str, items: list[_Item], exc: OSError, reason: str | None = None) -> None:
        reason = reason or describe_error(exc)  # logged, counted and marked (contract D5)
        self._stats.failures += len(items)
        self._stats.last_failure = reason
        self._logger.error("capture of %d call(s) of rollout %s failed: %s", len(items), rollout_id, reason)
        self.mark_incomplete(rollout_id, [item.model_call_id for item in items], reason)
        for item in items:
            self._completions.resolve(item, exc)

    def fail_append(self, rollout_id: str, items: list[_Item], begun: list[str], exc: OSError) -> None:
        """A rollout's append failed: its lines fail, and the calls begun without their ``+`` marker are
        marked incomplete too (a freeze in another process could not see them in flight)."""
        if items:
            self.fail(rollout_id, items, exc)
        in_batch = {item.model_call_id for item in items}
        unmarked = [mcid for mcid in begun if mcid not in in_batch]
        if unmarked:
            reason = f"in-flight marker not written: {describe_error(exc)}"
            self._logger.error("rollout %s: %s", rollout_id, reason)
            self.mark_incomplete(rollout_id, unmarked, reason)

    def unmarked(self, rollout_id: str, outcome: AppendOutcome, items: list[_Item]) -> None:
        """After a rollout's append: remember begun calls whose ``+`` marker a full filesystem refused (a
        freeze in another process cannot see them in flight). A remembered call whose line is written was
        not missed by anyone; one whose line is dropped as late was (that freeze did not name it): it is
        marked incomplete then, so the snapshot's ``version`` changes and a stale ``drop`` fails."""
        if outcome.marker_error is not None:
            reason = f"in-flight marker not written: {describe_error(outcome.marker_error)}"
            for mcid in outcome.unmarked:
                self._unmarked[(rollout_id, mcid)] = reason
        if not self._unmarked:
            return
        for index in outcome.accepted:
            self._unmarked.pop((rollout_id, items[index].model_call_id), None)
        for index, _ in outcome.dropped:
            missed = self._unmarked.pop((rollout_id, items[index].model_call_id), None)
            if missed is not None:
                self._logger.error("rollout %s, call %s: %s", rollout_id, items[index].model_call_id, missed)
                self.mark_incomplete(rollout_id, [items[index].model_call_id], missed)

    def abandon(self, abandoned: _Abandon) -> None:
        self._unmarked.pop((abandoned.rollout_id, abandoned.model_call_id), None)  # marked below anyway
        self._stats.failures += 1
        self._stats.last_failure = abandoned.reason  # logged by the middleware, with its traceback
        self.mark_incomplete(abandoned.rollout_id, [abandoned.model_call_id], abandoned.reason)

    def discard(self, discarded: _Discard) -> None:
        rid, mcid = discarded.rollout_id, discarded.model_call_id
        self._unmarked.pop((rid, mcid), None)  # not a model call: nothing a freeze could miss
        try:
            if discarded.marked:  # its "+" is on disk: a freeze elsewhere must not take it for in flight
                with (
                    self._state.dirs(lock_timeout=self._lock_timeout) as dirs,
                    self._state.locks.hold_ids(dirs, [rid]),
                ):
                    self._state.markers.write(dirs, rid, [], [mcid])
        except OSError as exc:
            self._logger.error(
                "could not end the in-flight marker of rollout %s, call %s: %s", rid, mcid, exc
            )
        finally:
            self._state.calls.end(rid, [mcid])

    # -- marking incomplete, and what to do when even that fails ---------------------------------------

    def mark_incomplete(self, rollout_id: str, model_call_ids: list[str], reason: str) -> None:
        try:
            self._write_marks(rollout_id, model_call_ids, reason)
        except OSError as exc:
            self._keep(rollout_id, model_call_ids, reason, exc)

    def _write_marks(self, rollout_id: str, model_call_ids: list[str], reason: str) -> None:
        with self._state.dirs(lock_timeout=self._lock_timeout) as dirs:
            fenced_mark_incomplete(
                self._state,
                dirs,
                rollout_id,
                [(mcid, reason) for mcid in model_call_ids],
                fsync=self._fsync,
                check=self._fence,
                file_mode=self._file_mode,
            )

    def _keep(self, rollout_id: str, model_call_ids: list[str], reason: str, exc: OSError) -> None:
        """The marker refused the mark: record the loss in the reserve (blocks taken ahead of need), else
        in the node-local one, keep it in memory, and retry it (:meth:`retry`) (contract D13, D43, D44)."""
        reserve, offset = self._record(rollout_id, model_call_ids, reason)
        if reserve is not None:
            where = f"recorded in {reserve.label}"
        else:
            where = "kept in memory only (check says so while this writer runs)"
            self._in_memory += len(model_call_ids)
            self._say_in_memory()
        self._logger.error(
            "could not mark rollout %s incomplete (%s): %d call(s) lost, %s; retried every %g s",
            rollout_id,
            describe_error(exc),
            len(model_call_ids),
            where,
            RETRY_S,
        )
        self._pending.setdefault(rollout_id, []).append(_PendingLoss(model_call_ids, reason, reserve, offset))
        self._stats.unreported += len(model_call_ids)
        self._next_retry = time.monotonic() + RETRY_S

    def _record(
        self, rollout_id: str, model_call_ids: list[str], reason: str
    ) -> tuple[LossReserve | None, int | None]:
        """The reserve that took the loss and its entry: this writer's in the directory as it is now, else
        the node-local one; ``(None, None)`` when neither could."""
        try:
            with self._state.dirs(lock_timeout=self._lock_timeout) as dirs:
                self.prepare(dirs)  # a directory removed and made anew needs a new reserve
                if self._reserve.ready(dirs):
                    offset = self._reserve.record(rollout_id, model_call_ids, reason, self._fsync)
                    if offset is not None:
                        return self._reserve, offset
        except Exception as reserve_exc:  # kept in memory at worst: a bug here must not lose the loss
            self._logger.error("could not record the loss in the directory's loss reserve: %s", reserve_exc)
        try:
            if not self._local.is_open:
                self._open_local()
            offset = self._local.record(rollout_id, model_call_ids, reason, self._fsync)
        except Exception as local_exc:
            self._logger.error("could not record the loss in the node-local reserve either: %s", local_exc)
            return None, None
        return (self._local, offset) if offset is not None else (None, None)

    def _say_in_memory(self) -> None:
        """Hold ``flock(LOCK_SH)`` on the capture directory while losses are in memory only: how ``check``
        knows (contract D43). Without waiting: a lock another holds is tried again at the next retry."""
        if self._memory_fd is not None:
            return
        try:
            fd = os.open(self._state.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return
        self._memory_fd = fd

    def _unsay_in_memory(self) -> None:
        fd, self._memory_fd = self._memory_fd, None
        if fd is not None:
            os.close(fd)  # closing releases the lock

    def retry_in(self) -> float | None:
        """Seconds until the next retry is due (``None``: nothing to retry)."""
        if not self._pending and not self._orphans_left:
            return None
        return max(0.0, self._next_retry - time.monotonic())

    def retry(self, force: bool = False) -> None:
        """Try again to write every kept loss into its rollout's marker (and adopt the reserves of writers
        that are gone); a loss written there has its reserve entry turned to reported."""
        if not force and (
            (not self._pending and not self._orphans_left) or time.monotonic() < self._next_retry
        ):
            return
        self._next_retry = time.monotonic() + RETRY_S
        for rollout_id in list(self._pending):
            entries = self._pending[rollout_id]
            while entries:
                entry = entries[0]
                try:
                    self._write_marks(rollout_id, entry.model_call_ids, entry.reason)
                except OSError:
                    break  # still refused: the next retry
                entries.pop(0)
                self._stats.unreported -= len(entry.model_call_ids)
                if entry.reserve is not None and entry.offset is not None:
                    self._report(entry.reserve, entry.offset)
                else:
                    self._in_memory -= len(entry.model_call_ids)
            if not entries:
                del self._pending[rollout_id]
                self._logger.warning(
                    "rollout %s: the lost calls are in its incomplete marker now", rollout_id
                )
        if not self._pending:
            for reserve in (self._reserve, self._local):
                try:
                    reserve.overflow_reported(self._fsync)
                except OSError as exc:
                    self._logger.error("could not update the loss reserve: %s", exc)
        if self._in_memory <= 0:
            self._unsay_in_memory()
        else:
            self._say_in_memory()
        self._adopt()

    def _report(self, reserve: LossReserve, offset: int) -> None:
        try:
            reserve.reported([offset], self._fsync)
        except OSError as exc:  # the marker has the mark: the stale entry over-reports, never hides
            self._logger.error("could not update the loss reserve: %s", exc)

    def _adopt(self) -> None:
        """Write the pending marks of reserves whose writers are gone (a crash), in the directory and in
        this node's local reserve, then hand those on or remove them (contract D15, D44)."""
        left = False
        try:
            with self._state.dirs(create=False, lock_timeout=self._lock_timeout) as dirs:
                here = dirs.state_fd(LOSSES_DIR)
                left = self._adopt_in(here, self._reserve.name, shared_label, hand_on=True)
        except FileNotFoundError:
            pass  # no reserve was ever made there
        except OSError as exc:
            self._logger.debug("could not adopt the reserves in %s yet: %s", self._state.root, exc)
            left = True  # tried again at the next retry
        try:
            local_fd = self._local_dir(create=False)
            if local_fd is not None:
                local = self._local_path
                label: Label = lambda name: str(local / name)  # noqa: E731
                left |= self._adopt_in(local_fd, self._local.name, label, hand_on=False)
        except OSError as exc:
            self._logger.debug("could not adopt the node-local reserves in %s yet: %s", self._local_path, exc)
            left = True
        self._orphans_left = left

    def _adopt_in(self, dir_fd: int, own: str, label: Label, *, hand_on: bool) -> bool:
        """Adopt the orphans of one directory of reserves; True when one still holds losses. An entry read
        back that names no rollout a file may be opened for, or whose marker can never be written, is set
        aside and said once, here (contract D41)."""
        left = False
        for orphan in orphans(dir_fd, own, label):
            reported: list[int] = []
            set_aside: list[int] = []
            try:
                for offset, loss in orphan.losses:
                    if not loss.problem and loss.rollout_id:
                        try:
                            self._write_marks(loss.rollout_id, list(loss.model_call_ids), loss.reason)
                        except DamagedEntryError as exc:
                            if exc.label != loss.rollout_id + INCOMPLETE_SUFFIX:
                                raise  # damage elsewhere (a lock file, the journal): not this entry's
                            loss = dataclasses.replace(loss, problem=str(exc))  # its marker: never written
                    if loss.problem:
                        self._logger.error(
                            "%s: an entry is set aside (check names it; no writer adopts it again): %s; "
                            "calls %s: %s",
                            loss.source,
                            loss.problem,
                            loss.calls(),
                            loss.reason,
                        )
                        set_aside.append(offset)
                    else:
                        reported.append(offset)
            except OSError:
                left = True  # still refused: the next retry
            finally:
                orphan.done(reported, set_aside, self._fsync, hand_on=hand_on)
        return left

    def close(self) -> None:
        """At the writer's stop: one last try, then the reserve is closed (removed when nothing in it is
        pending; kept, for ``check`` and for another writer to adopt, when something is)."""
        self.retry(force=True)
        if self._pending:
            self._logger.error(
                "capture writer stopped with %d lost call(s) not in their rollouts' incomplete markers "
                "(recorded in %s, or %s, where they had room)",
                self._stats.unreported,
                self._reserve.label,
                self._local_path,
            )
        self._reserve.close(hand_on=True)  # nothing pending: handed on to the next writer (contract D42)
        self._local.close()
        self._unsay_in_memory()
        if self._local_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._local_fd)
                os.rmdir(self._local_path)  # only when empty: nothing of this directory is kept here
            self._local_fd = None

    # -- after close -------------------------------------------------------------------------------------

    def after_close(self, rollout_id: str, model_call_id: str, item: _Item | None) -> None:
        """A call handed to the writer after ``close``: counted, logged the first time, its rollout marked
        incomplete (off the caller's thread: the caller may be an event loop), its waiter failed
        (contract D12)."""
        self._stats.failures += 1
        self._stats.after_close += 1
        reason = "capture writer closed: the call ended after the writer stopped"
        self._stats.last_failure = reason
        if self._stats.after_close == 1:
            self._logger.error(
                "rollout %s, call %s: %s; marked incomplete (later ones are counted in "
                "stats.after_close without a log line)",
                rollout_id,
                model_call_id,
                reason,
            )
        with self._late_lock:
            if self._late is None:
                self._late = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="otel-capture-late")
            late = self._late
        try:
            late.submit(self._mark_late, rollout_id, model_call_id, reason)
        except RuntimeError:  # the interpreter is shutting down: no thread can write the mark
            self._logger.error(
                "rollout %s, call %s: could not be marked incomplete", rollout_id, model_call_id
            )
        if item is not None:
            completions = Completions()
            completions.resolve(item, WriterClosedError(reason))
            completions.flush()

    def _mark_late(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        try:
            self._write_marks(rollout_id, [model_call_id], reason)
        except OSError as exc:
            self._logger.error("could not mark rollout %s incomplete: %s", rollout_id, exc)

    def wait_late(self) -> None:
        """Wait for the marks of calls that came after ``close`` (tests, and an orderly exit)."""
        with self._late_lock:
            late = self._late
        if late is not None:
            late.submit(lambda: None).result()

    def _fence(self, rollout_id: str) -> Fence | None:
        self._state.journal.refresh()
        return self._state.journal.fence(rollout_id)
