"""The capture lifecycle on files: freeze, drop, retire, delete, begin_call, mark_incomplete.

The protocol, written before the code (``docs/lifecycle.md`` has the long form):

* One lock protocol for writers and lifecycle operations: a rollout's **stripe lock** (:mod:`.locks`), held
  for the whole "read the fence, then append" of a writer and for "check, then fence or remove" of an
  operation. A writer that holds the stripe sees every fence appended before it took the stripe.
* **Retire** (and ``drop``, which is a conditional retire) is two synced phases. Phase 1, under every
  stripe of the batch: append one ``retire`` event per rollout not already retired to the fence journal
  and ``fsync`` it, once per batch (even when it wrote nothing: an overlapping retire may not have synced
  yet). Phase 2, stripe by stripe: re-read each rollout's fence and remove its records only if the fence
  is still the one phase 1 saw (a rollout deleted and reused in between keeps its new records); then one
  directory ``fsync`` per batch. A crash anywhere leaves every rollout with its records, its fence, or
  both; retrying the batch finishes it.
* **Delete**, under every stripe of the batch: remove records, ``fsync`` the directory, then append one
  ``delete`` event per rollout and ``fsync`` the journal. A crash in between leaves a fenced rollout
  without records (a retry finishes it), never old records without their fence. Every delete event
  advances the rollout's epoch, so a call admitted before the delete is dropped as late even though the
  id is live again.
* **Freeze**, under the stripe: read the rollout (each file under ``flock(LOCK_SH)``, as the readers do)
  and ``fsync`` the files read, so a snapshot never holds a record that a crash could still take back;
  append a ``freeze`` event that names the calls in flight and ``fsync`` the journal.
* Batches are validated whole before anything changes. A failure confined to one rollout (say, a record
  file that cannot be unlinked) is reported in ``failed`` and the batch goes on; a failure of the batch's
  own syncs raises, after a best-effort sync whose own failure is logged, never raised over it.
* Nothing outside the directory is touched: every path is opened through :mod:`.fs` (no link followed),
  removal renames into the trash and purges it by directory descriptor, and a capture directory other
  users can write is refused (:class:`UnsafeDirectoryError`) unless opted in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson

from .._correlation.ids import validate_rollout_id
from .._errors import CaptureStateError, DamagedEntryError
from .dirstate import DirState, dir_state
from .fs import DirFds, Fsync, check_directory
from .journal import Fence, Hook
from .lifecycle_io import (
    CAPTURE_SUFFIX,
    INCOMPLETE_SUFFIX,
    INFLIGHT_REASON,
    RECORD_SUFFIXES,
    TOKENS_SUFFIX,
    count_version,
    fence_error,
    fenced_append,
    fenced_mark_incomplete,
    read_contents,
)
from .losses import Loss, pending_for
from .removal import describe, purge_trash, trash_fd, unlink_records
from .types import (
    ROLLOUT_STATES,
    CaptureSnapshot,
    IncompleteCall,
    RemovalResult,
    RolloutState,
    empty_result,
    validate_rollout_ids,
)
from .weight import declare

_logger = logging.getLogger(__name__)

__all__ = [
    "CAPTURE_SUFFIX",
    "INCOMPLETE_SUFFIX",
    "INFLIGHT_REASON",
    "RECORD_SUFFIXES",
    "TOKENS_SUFFIX",
    "FileLifecycle",
    "fenced_append",
]

_T = TypeVar("_T")
_executor_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _lifecycle_executor() -> concurrent.futures.ThreadPoolExecutor:
    """A dedicated pool, so a long retire never starves ``asyncio.to_thread`` users of the default one."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="otel-capture-lifecycle")
        return _executor


# --- the operations -----------------------------------------------------------------------------------


class FileLifecycle:
    """The lifecycle operations on one capture directory; a :class:`~otel_capture.CaptureStore` owns one
    and hands its lifecycle methods to it. ``rollout_ids`` is the store's one listing of the directory's
    rollouts (``list_rollouts`` adds the fenced and the in-flight ones to it). Creating it touches
    nothing; the directory's state is looked up on first use."""

    def __init__(
        self,
        root: Path,
        *,
        allow_shared: bool,
        lock_timeout: float,
        fsync: Fsync,
        hook: Hook,
        rollout_ids: Callable[[], list[str]],
    ) -> None:
        self.root = root
        self._allow_shared = allow_shared
        self._lock_timeout = lock_timeout
        self._fsync = fsync
        self._hook = hook
        self._rollout_ids = rollout_ids
        self._dir_state: DirState | None = None

    @property
    def _state(self) -> DirState:
        state = self._dir_state
        if state is None:  # dir_state resolves the real path: once per store, not once per call
            state = self._dir_state = dir_state(self.root)
        return state

    @contextlib.contextmanager
    def _dirs(self, *, create: bool = True) -> Iterator[DirFds]:
        """The directory descriptors of one operation, once the directory is known to be safe to use. An
        operation that may create makes the state directory whole first (:meth:`DirState.prepare`: once
        per directory), so that later ones need no new inode."""
        check_directory(self.root, allow_shared=self._allow_shared)
        with self._state.dirs(create=create, lock_timeout=self._lock_timeout) as dirs:
            if create:
                try:
                    self._state.prepare(dirs)
                except OSError as exc:  # the operation itself reports what it cannot do
                    _logger.debug("could not prepare %s: %s", self.root, exc)
            yield dirs

    # -- queries ---------------------------------------------------------------------------------------

    def rollout_state(self, rollout_id: str) -> RolloutState:
        """``absent``, ``live``, ``frozen`` or ``retired``."""
        rid = validate_rollout_id(rollout_id)
        state = self._state
        state.journal.refresh()
        fence = state.journal.fence(rid)
        if fence is not None:
            return fence.kind
        if any(os.path.lexists(self.root / (rid + suffix)) for suffix in RECORD_SUFFIXES):
            return "live"
        if any(loss.rollout_id == rid for loss in pending_for(self.root, rid)):
            return "live"  # its only trace is a loss a full filesystem held back from its marker
        return "live" if self._pending(rid) else "absent"

    def _pending(self, rid: str, damage: list[str] | None = None) -> set[str]:
        """Calls of the rollout's current epoch begun and not yet recorded: this process's, and every
        process's ``+`` markers (a call admitted before the last freeze, retire or delete is not pending:
        its line will be dropped as late). A damaged marker is not read: its reason goes to ``damage``."""
        state = self._state
        last = state.journal.last_seq(rid)
        mine = {mcid for mcid, epoch in state.calls.pending(rid).items() if epoch is None or epoch >= last}
        try:
            return mine | state.markers.pending(self.root, rid)
        except DamagedEntryError as exc:
            _logger.error("rollout %s: %s", rid, exc)
            if damage is not None:
                damage.append(
                    f"{exc.label}: {exc.what}: not read (calls in flight in other processes unknown)"
                )
            return mine

    def list_rollouts(self, state: RolloutState | None = None) -> dict[str, RolloutState]:
        """Every rollout that is not absent, with its state, sorted by id; only ``state`` ones if given.

        For an owner that lost track (a crash): ``list_rollouts("frozen")`` and ``list_rollouts("live")``
        say what is left to retire, ``list_rollouts("retired")`` which fences are left to delete."""
        if state is not None and state not in ROLLOUT_STATES:
            raise ValueError(f"unknown state {state!r}; one of {', '.join(ROLLOUT_STATES)}")
        dir_ = self._state
        dir_.journal.refresh()
        found: dict[str, RolloutState] = {rid: f.kind for rid, f in dir_.journal.fences().items()}
        for rid in self._rollout_ids():
            found.setdefault(rid, "live")
        with dir_.dirs(create=False, lock_timeout=self._lock_timeout) as dirs:
            try:
                marked = dir_.markers.rollouts(dirs)
            except (FileNotFoundError, DamagedEntryError) as exc:
                _logger.debug("no in-flight markers to list: %s", exc)
                marked = []
        for rid in [*marked, *dir_.calls.rollouts()]:
            if rid not in found and self._pending(rid):
                found[rid] = "live"
        return {rid: found[rid] for rid in sorted(found) if state is None or found[rid] == state}

    # -- begin_call, mark_incomplete, append_now -----------------------------------------------------

    def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Say a call has started: a freeze before its record is written reports the rollout incomplete.

        Raises :class:`CaptureRetiredError` / :class:`CaptureFrozenError` on a fenced rollout."""
        rid = validate_rollout_id(rollout_id)
        state = self._state
        with self._dirs() as dirs, state.locks.hold_ids(dirs, [rid]):
            fence = self._check(rid)
            if fence is not None:
                raise fence_error(rid, fence)
            state.markers.write(dirs, rid, [model_call_id], [])
            state.calls.begin(rid, model_call_id, state.journal.last_seq(rid))

    def mark_incomplete(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Durably mark a call as not captured (``<id>.capture.incomplete``, one JSON line).

        Accepted on a frozen rollout (it changes the snapshot's ``version``, so a stale ``drop`` fails);
        refused with :class:`CaptureRetiredError` on a retired one."""
        rid = validate_rollout_id(rollout_id)
        with self._dirs() as dirs:
            fence = fenced_mark_incomplete(
                self._state, dirs, rid, [(model_call_id, reason)], fsync=self._fsync, check=self._check
            )
        if fence is not None and fence.kind == "retired":
            raise fence_error(rid, fence)

    def append_now(
        self,
        rollout_id: str,
        model_call_id: str,
        record: dict[str, Any],
        tokens: dict[str, Any] | None = None,
    ) -> None:
        """Write one call's record (and token line) durably, through the same fenced path as the writer.

        Raises :class:`CaptureFrozenError` or :class:`CaptureRetiredError` when the rollout is fenced."""
        rid = validate_rollout_id(rollout_id)
        line = orjson.dumps({"model_call_id": model_call_id, **record}, option=orjson.OPT_APPEND_NEWLINE)
        tokens_line = None
        if tokens is not None:
            tokens_line = orjson.dumps(
                {"model_call_id": model_call_id, **tokens}, option=orjson.OPT_APPEND_NEWLINE
            )
        with self._dirs() as dirs:
            outcome = fenced_append(self._state, dirs, rid, [(model_call_id, line, tokens_line)])
            try:
                for fd in outcome.fds:
                    self._fsync(fd)
            finally:
                for fd in outcome.fds:
                    os.close(fd)
            if outcome.created:
                self._fsync(dirs.root_fd())  # the new file's directory entry
        if outcome.dropped:
            raise outcome.dropped[0][1]

    # -- freeze and drop -------------------------------------------------------------------------------

    def _check(self, rid: str) -> Fence | None:
        """Refresh the journal view (the caller holds the stripe); a damaged state raises."""
        state = self._state
        state.journal.refresh()
        damage = state.journal.corrupt(rid)
        if damage is not None:
            raise CaptureStateError(f"rollout {rid}: {damage}; retire or delete it to reset its state")
        return state.journal.fence(rid)

    def set_weight_version(self, version: str) -> None:
        """Append ``version`` (already validated) to the directory's weight-version declarations."""
        with self._dirs() as dirs:
            declare(dirs, version, self._fsync)

    def calls_in_flight(self, rollout_id: str) -> dict[str, float | None]:
        """:meth:`.store.CaptureStore.calls_in_flight`: the pending calls, each with its marker's time."""
        rid = validate_rollout_id(rollout_id)
        self._state.journal.refresh()
        pending = self._pending(rid)
        try:
            since = self._state.markers.since(self.root, rid)
        except DamagedEntryError:
            since = {}
        return {mcid: since.get(mcid) for mcid in sorted(pending)}

    def freeze_now(self, rollout_id: str) -> CaptureSnapshot:
        """Freeze the rollout (no more records) and return its snapshot. Idempotent: a repeat returns the
        same ``snapshot_id``. Freezing an absent rollout fences it too (an empty snapshot): a freeze says
        "I am consuming this now", so any later call is late. Raises :class:`CaptureRetiredError`."""
        rid = validate_rollout_id(rollout_id)
        state = self._state
        damage: list[str] = []
        with self._dirs() as dirs, state.locks.hold_ids(dirs, [rid]):
            fence = self._check(rid)
            if fence is not None and fence.kind == "retired":
                raise fence_error(rid, fence)
            # A record the snapshot hands out must survive a crash: every file read is synced.
            contents = read_contents(dirs, rid, fsync=self._fsync)
            pending = self._pending(rid, damage)
            losses = pending_for(self.root, rid)  # lost calls whose marks a full filesystem holds back
            if fence is None:
                held = {m for loss in losses for m in loss.model_call_ids}  # lost, not in flight
                inflight = sorted(pending - contents.call_ids() - held)
                event = {"op": "freeze", "id": rid, "snapshot_id": uuid.uuid4().hex, "inflight": inflight}
                state.journal.append(dirs, [event], self._fsync, self._hook)
                fence = state.journal.fence(rid)
                assert fence is not None
        calls = list(contents.incomplete) + [IncompleteCall(m, INFLIGHT_REASON) for m in fence.inflight]
        calls += [IncompleteCall("", reason) for reason in damage]
        calls += [IncompleteCall(m, loss.describe()) for loss in losses for m in loss.model_call_ids or ("",)]
        return CaptureSnapshot(
            rollout_id=rid,
            records=contents.records,
            tokens=contents.tokens,
            incomplete=contents.marker_exists or bool(calls),
            snapshot_id=fence.snapshot_id or "",
            version=contents.version + _held_back(losses),
            incomplete_calls=tuple(calls),
        )

    def _version(self, dirs: DirFds, rid: str) -> int:
        """The rollout's ``version``: its durable lines, and the marks its losses will add once written
        (so a snapshot stays the same version when a held-back mark reaches the marker)."""
        return count_version(dirs, rid) + _held_back(pending_for(self.root, rid))

    def drop_now(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire the rollout only if it is still exactly the snapshot consumed; True when it is retired
        as that snapshot (a repeat of a successful drop is True again, and costs no I/O)."""
        rid = validate_rollout_id(rollout_id)
        state = self._state
        with self._dirs() as dirs:
            with state.locks.hold_ids(dirs, [rid]):
                state.journal.refresh()
                fence = state.journal.fence(rid)
                if fence is None or state.journal.corrupt(rid) is not None:
                    return False
                if fence.kind == "retired":
                    return fence.snapshot_id == snapshot_id and fence.version == version
                if fence.snapshot_id != snapshot_id or self._version(dirs, rid) != version:
                    return False
                event = {"op": "retire", "id": rid, "snapshot_id": snapshot_id, "version": version}
                state.journal.append(dirs, [event], self._fsync, self._hook)
                expected = {rid: state.journal.last_seq(rid)}
            result = empty_result()
            self._remove_records(dirs, expected, result)
        if result["failed"]:
            raise OSError(
                errno.EIO, f"rollout {rid} is retired but its records remain: {result['failed'][rid]}"
            )
        return True

    # -- retire and delete -----------------------------------------------------------------------------

    def retire_now(self, rollout_ids: Iterable[str]) -> RemovalResult:
        """Fence each rollout whatever its state and remove its records (two synced phases)."""
        ids = validate_rollout_ids(rollout_ids)
        result = empty_result()
        if not ids:
            return result
        state = self._state
        with self._dirs() as dirs:
            with state.locks.hold_ids(dirs, ids):
                state.journal.refresh()
                self._hook("retire_fencing")
                # Phase 1: one append and one fsync make every fence of the batch durable, before any removal.
                state.journal.append(dirs, self._retire_events(dirs, ids), self._fsync, self._hook)
                expected = {rid: state.journal.last_seq(rid) for rid in ids}
            self._hook("retire_fenced")
            self._remove_records(dirs, expected, result)
        return result

    def _retire_events(self, dirs: DirFds, ids: list[str]) -> Iterator[dict[str, Any]]:
        """One ``retire`` event per rollout not already retired, made as the journal writes them (a batch
        of any size holds no list of events)."""
        journal = self._state.journal
        for rid in ids:
            fence = journal.fence(rid)
            if fence is not None and fence.kind == "retired" and journal.corrupt(rid) is None:
                continue
            event: dict[str, Any] = {"op": "retire", "id": rid}
            if fence is not None and fence.kind == "frozen":
                event["snapshot_id"] = fence.snapshot_id
                event["version"] = self._version(dirs, rid)
            yield event

    def _remove_records(self, dirs: DirFds, expected: dict[str, int], result: RemovalResult) -> None:
        """Phase 2: stripe by stripe, remove the records of each rollout still fenced by ``expected``."""
        state = self._state
        by_stripe: dict[int, list[str]] = {}
        for rid in expected:
            by_stripe.setdefault(state.locks.stripe(rid), []).append(rid)
        outcome: dict[str, str] = {}
        token = uuid.uuid4().hex[:16]
        trash = trash_fd(dirs)
        try:
            for stripe, rids in sorted(by_stripe.items()):
                with state.locks.hold(dirs, [stripe]):
                    state.journal.refresh()
                    for rid in rids:
                        fence = state.journal.fence(rid)
                        if fence is None or fence.kind != "retired" or fence.seq != expected[rid]:
                            outcome[rid] = "absent"  # deleted and reused since phase 1: keep its records
                            continue
                        try:
                            outcome[rid] = "removed" if unlink_records(dirs, rid, token, trash) else "absent"
                        except OSError as exc:
                            result["failed"][rid] = describe(exc)
                            _logger.error("could not remove the records of retired rollout %s: %s", rid, exc)
                        self._hook("retire_removed_one")
        except BaseException:
            self._sync_after_error()
            raise
        self._fsync(dirs.root_fd())  # the removals are durable before the batch reports them
        self._hook("retire_synced")
        self._purge_later()
        for rid in expected:
            if rid in outcome:
                result["removed" if outcome[rid] == "removed" else "absent"].append(rid)

    def purge_trash(self) -> int:
        """Unlink the record files retire and delete moved aside (runs in the background after each
        batch; call it to free the space now). Returns how many entries it removed."""
        with self._state.dirs(create=False, lock_timeout=self._lock_timeout) as dirs:
            return purge_trash(dirs)

    def _purge_later(self) -> None:
        def purge() -> None:
            try:
                self.purge_trash()
            except OSError as exc:
                _logger.warning("could not empty the trash of %s: %s", self.root, exc)

        with contextlib.suppress(RuntimeError):  # the interpreter is shutting down: the next batch purges
            _lifecycle_executor().submit(purge)

    def _sync_after_error(self) -> None:
        try:
            if self.root.is_dir():
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    self._fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            _logger.error("could not sync %s after a failed lifecycle batch: %s", self.root, exc)

    def delete_now(self, rollout_ids: Iterable[str]) -> RemovalResult:
        """Remove records and fences: each id is absent afterwards and can be reused. A call admitted
        before the delete is still dropped as late (the delete advances the rollout's epoch)."""
        ids = validate_rollout_ids(rollout_ids)
        result = empty_result()
        if not ids:
            return result
        if not self.root.is_dir():  # never creates the directory: nothing can be in it
            result["absent"] = ids
            return result
        state = self._state
        if not os.path.lexists(state.state_dir):
            return self._delete_plain(ids, result)
        token = uuid.uuid4().hex[:16]
        with self._dirs() as dirs, state.locks.hold_ids(dirs, ids):
            state.journal.refresh()
            had: dict[str, bool] = {}
            trash = trash_fd(dirs)
            try:
                for rid in ids:
                    fenced = state.journal.fence(rid) is not None or state.journal.corrupt(rid) is not None
                    try:
                        had[rid] = unlink_records(dirs, rid, token, trash) or fenced
                    except OSError as exc:
                        result["failed"][rid] = describe(exc)
                        _logger.error("could not remove the records of rollout %s: %s", rid, exc)
                    self._hook("delete_removed_one")
                self._fsync(dirs.root_fd())
            except BaseException:
                self._sync_after_error()
                raise
            # Records are gone (durably) before the fences go: never old records without their fence.
            events = ({"op": "delete", "id": rid} for rid in ids if rid not in result["failed"])
            state.journal.append(dirs, events, self._fsync, self._hook)
        self._purge_later()
        for rid in ids:
            if rid in had:
                result["removed" if had[rid] else "absent"].append(rid)
        return result

    def _delete_plain(self, ids: list[str], result: RemovalResult) -> RemovalResult:
        """Delete in a directory no lifecycle operation or writer of ours has used (no ``.otel-capture/``:
        no fence, no in-flight marker, nothing to lock against): NeMo Gym's unlinks, one directory sync."""
        with self._dirs(create=False) as dirs:
            try:
                for rid in ids:
                    try:
                        gone = unlink_records(dirs, rid, None, None)
                    except OSError as exc:
                        result["failed"][rid] = describe(exc)
                        continue
                    result["removed" if gone else "absent"].append(rid)
                self._fsync(dirs.root_fd())
            except BaseException:
                self._sync_after_error()
                raise
        return result

    # -- async forms -----------------------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_lifecycle_executor(), functools.partial(fn, *args, **kwargs))

    async def freeze(self, rollout_id: str) -> CaptureSnapshot:
        return await self._off_loop(self.freeze_now, rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await self._off_loop(self.drop_now, rollout_id, snapshot_id=snapshot_id, version=version)

    async def retire(self, rollout_ids: Iterable[str]) -> RemovalResult:
        ids = validate_rollout_ids(rollout_ids)  # a bare string fails here, on the caller's line
        return await self._off_loop(self.retire_now, ids)

    async def delete(self, rollout_ids: Iterable[str]) -> RemovalResult:
        ids = validate_rollout_ids(rollout_ids)
        return await self._off_loop(self.delete_now, ids)


def _held_back(losses: list[Loss]) -> int:
    """The marker lines these losses will add (one per call); the overflow entry names no rollout."""
    return sum(len(loss.model_call_ids) + loss.more for loss in losses if loss.rollout_id)
