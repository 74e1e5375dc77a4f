"""How :class:`.writer.JsonlWriter` ends the calls whose line did not reach the disk
(contract D5, D12, D13, D20): failed, counted, and marked incomplete with the reason; a mark that cannot
be written is a pending loss, kept in the loss reserve (:mod:`.losses`) and in memory and retried until
the marker takes it. :class:`WriterFailures` is owned by the writer: it is given the directory's state,
the writer's counters, the completions it resolves calls through, and the writer's logger.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import UnsafeDirectoryError, WriterClosedError
from .append import AppendOutcome, fenced_mark_incomplete
from .dirstate import DirState
from .fs import DirFds, describe_error
from .journal import Fence
from .losses import LossReserve, orphans
from .writer_items import Completions, WriterStats, _Abandon, _Discard, _Item

RETRY_S = 0.5
"""Seconds between two tries to write the incomplete marks that could not be written."""


@dataclass(slots=True)
class _PendingLoss:
    """A loss whose mark is not in its rollout's marker yet (a pending entry of the reserve, :mod:`.losses`,
    when it has one; ``WriterStats.unreported`` counts them)."""

    model_call_ids: list[str]
    reason: str
    offset: int | None  # its entry in the reserve; None: in memory only (no reserve, or it was full)


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
    ) -> None:
        self._state = state
        self._stats = stats
        self._completions = completions
        self._logger = logger
        self._lock_timeout = lock_timeout
        self._fsync = fsync
        self._file_mode = file_mode
        self._reserve = LossReserve(file_mode)
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
        """Make the state directory whole and this writer's loss reserve, unless done for the directory
        ``identity`` names (``(st_dev, st_ino)``; ``None``: look). Called by the writer after a batch in a
        directory not prepared yet (once its calls are answered) and before a loss is recorded."""
        if identity is not None and identity == self._ready_in:
            return
        try:
            complete = self._state.prepare(dirs)
            if not self._reserve.ready(dirs):
                self._reserve.open(dirs, self._fsync)
                self._adopt()
            if complete and identity is not None:
                self._ready_in = identity
        except Exception as exc:  # never fails the batch: the reserve is made by a later one
            self._logger.debug("could not make the loss reserve in %s yet: %s", self._state.root, exc)

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
        """The marker refused the mark: record the loss in the reserve (blocks taken ahead of need), keep it
        in memory, and retry it (:meth:`retry`) (contract D13)."""
        offset = None
        try:
            with self._state.dirs(lock_timeout=self._lock_timeout) as dirs:
                self.prepare(dirs)  # a directory removed and made anew needs a new reserve
                offset = self._reserve.record(rollout_id, model_call_ids, reason, self._fsync)
        except OSError as reserve_exc:
            self._logger.error("could not record the loss in the loss reserve either: %s", reserve_exc)
        where = f"recorded in {self._reserve.label}" if offset is not None else "kept in memory only"
        self._logger.error(
            "could not mark rollout %s incomplete (%s): %d call(s) lost, %s; retried every %g s",
            rollout_id,
            describe_error(exc),
            len(model_call_ids),
            where,
            RETRY_S,
        )
        self._pending.setdefault(rollout_id, []).append(_PendingLoss(model_call_ids, reason, offset))
        self._stats.unreported += len(model_call_ids)
        self._next_retry = time.monotonic() + RETRY_S

    def retry_in(self) -> float | None:
        """Seconds until the next retry is due (``None``: nothing to retry)."""
        if not self._pending:
            return None
        return max(0.0, self._next_retry - time.monotonic())

    def retry(self, force: bool = False) -> None:
        """Try again to write every kept loss into its rollout's marker (and adopt the reserves of writers
        that are gone); a loss written there has its reserve entry turned to reported."""
        if not force and (not self._pending or time.monotonic() < self._next_retry):
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
                if entry.offset is not None:
                    self._report(entry.offset)
            if not entries:
                del self._pending[rollout_id]
                self._logger.warning(
                    "rollout %s: the lost calls are in its incomplete marker now", rollout_id
                )
        if not self._pending:
            try:
                self._reserve.overflow_reported(self._fsync)
            except OSError as exc:
                self._logger.error("could not update the loss reserve: %s", exc)
        self._adopt()

    def _report(self, offset: int) -> None:
        try:
            self._reserve.reported([offset], self._fsync)
        except OSError as exc:  # the marker has the mark: the stale entry over-reports, never hides
            self._logger.error("could not update the loss reserve: %s", exc)

    def _adopt(self) -> None:
        """Write the pending marks of reserves whose writers are gone (a crash), then remove those
        (contract D15)."""
        try:
            with self._state.dirs(create=False, lock_timeout=self._lock_timeout) as dirs:
                for orphan in orphans(dirs, self._reserve.name):
                    reported = []
                    try:
                        for offset, loss in orphan.losses:
                            if loss.rollout_id:
                                self._write_marks(loss.rollout_id, list(loss.model_call_ids), loss.reason)
                            reported.append(offset)
                    except OSError:
                        pass
                    finally:
                        orphan.done(reported, self._fsync)
        except OSError as exc:
            self._logger.debug("no reserves to adopt in %s: %s", self._state.root, exc)

    def close(self) -> None:
        """At the writer's stop: one last try, then the reserve is closed (removed when nothing in it is
        pending; kept, for ``check`` and for another writer to adopt, when something is)."""
        self.retry(force=True)
        if self._pending:
            self._logger.error(
                "capture writer stopped with %d lost call(s) not in their rollouts' incomplete markers "
                "(recorded in %s where it had room)",
                self._stats.unreported,
                self._reserve.label,
            )
        self._reserve.close()

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
