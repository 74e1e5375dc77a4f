"""The store: one capture directory's files and the capture lifecycle on them (``docs/lifecycle.md``).

:class:`CaptureStore` is the one actor: it reads a rollout's files (:mod:`.lines`, :mod:`.marker`), writes
through the fenced append (:mod:`.append`), freezes (:mod:`.snapshot`) and removes (:mod:`.removal`).
Its state lives in ``<dir>/.otel-capture/`` (:mod:`.dirstate`; every name in :mod:`.names`). Losses a
writer could not even mark are in its loss reserve (:mod:`.losses`): :meth:`CaptureStore.is_incomplete`
and :meth:`CaptureStore.incomplete_calls` count them. Nothing here follows a link or waits on a FIFO.

Locking: a rollout's stripe lock (:mod:`.locks`) is held for "check the fence, then act" of every
operation, as the writer holds it for "read the fence, then append". Batches are validated whole before
anything changes; a failure confined to one rollout is reported in ``failed`` and the batch goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import orjson

from .._errors import CaptureStateError, DamagedEntryError
from .._rollout_id import validate_rollout_id
from .._settings import allow_shared_dir_from_environ, lock_timeout_from_environ
from .append import fenced_append, fenced_mark_incomplete
from .backend import CaptureBackend
from .dirstate import DirState, dir_state
from .fs import DirFds, check_directory, describe_error, problem
from .inflight import INFLIGHT_REASON
from .journal import Fence, Hook, fence_error, no_hook
from .lines import RawLines, StreamedLines, read_lines, stream_lines
from .losses import Loss, pending_for, pending_losses
from .marker import read_marks
from .names import CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, RECORD_SUFFIXES, TOKENS_SUFFIX
from .removal import purge_trash, remove_fenced, trash_fd, unlink_records
from .snapshot import count_version, read_contents
from .sync import fsync_dir
from .types import (
    ROLLOUT_STATES,
    CaptureSnapshot,
    IncompleteCall,
    RemovalResult,
    RolloutState,
    empty_result,
    validate_rollout_ids,
)
from .weight import declare, validate_weight_version

_logger = logging.getLogger(__name__)

__all__ = [
    "CAPTURE_SUFFIX",
    "INCOMPLETE_SUFFIX",
    "TOKENS_SUFFIX",
    "CaptureStore",
    "RawLines",
    "StreamedLines",
]

_T = TypeVar("_T")
_executor_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _lifecycle_executor() -> concurrent.futures.ThreadPoolExecutor:
    """A dedicated pool, so a long retire never starves ``asyncio.to_thread`` users of the default one
    (contract L17)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="otel-capture-lifecycle")
        return _executor


class CaptureStore(CaptureBackend):
    """A capture directory and its lifecycle. Creating the object never touches the filesystem.

    ``allow_shared_directory``: use a world-writable directory, or one owned by another user, which is
    otherwise refused with :class:`UnsafeDirectoryError` (default: ``OTEL_CAPTURE_ALLOW_SHARED_DIR``).
    ``lock_timeout_s``: the longest wait for any file lock (a data file's ``flock`` held by another process,
    a rollout's stripe); past it a read, freeze, retire or delete raises :class:`LockTimeoutError`
    (default: ``OTEL_CAPTURE_LOCK_TIMEOUT_S``, else 30 s).
    ``fsync`` and ``crash_hook`` are seams for tests: a failing disk, and a callback named at each step of
    a lifecycle batch (crash tests SIGKILL the process there). Neither is a tuning knob.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        allow_shared_directory: bool | None = None,
        fsync: Callable[[int], None] = os.fsync,
        crash_hook: Callable[[str], None] | None = None,
        lock_timeout_s: float | None = None,
    ) -> None:
        self.root = Path(root)
        self._allow_shared = (
            allow_shared_dir_from_environ() if allow_shared_directory is None else allow_shared_directory
        )
        self._lock_timeout = lock_timeout_from_environ() if lock_timeout_s is None else lock_timeout_s
        self._fsync = fsync
        self._hook: Hook = crash_hook or no_hook
        self._dir_state: DirState | None = None

    def __repr__(self) -> str:
        return f"CaptureStore({str(self.root)!r})"

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
        """``absent``, ``live``, ``frozen`` or ``retired`` (contract L1)."""
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
        for rid in self.rollout_ids():
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
                self._state,
                dirs,
                rid,
                [(model_call_id, reason)],
                fsync=self._fsync,
                check=self._check,
                end_refused=False,
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

    def _check(self, rid: str) -> Fence | None:
        """Refresh the journal view (the caller holds the stripe); a damaged state raises (contract L2)."""
        state = self._state
        state.journal.refresh()
        damage = state.journal.corrupt(rid)
        if damage is not None:
            raise CaptureStateError(f"rollout {rid}: {damage}; retire or delete it to reset its state")
        return state.journal.fence(rid)

    def calls_in_flight(self, rollout_id: str) -> dict[str, float | None]:
        """The rollout's calls begun and not yet recorded, in this process and in every process whose
        writer has written their in-flight marker, each with when that marker was written (UTC Unix
        seconds; ``None`` for a call of this process without one yet, or a marker written without it).
        A call begun less than the writer's marker delay ago in another process is not seen (contract D19)."""
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
        with self._dirs() as dirs, state.locks.hold_ids(dirs, [rid]):  # under the stripe (contract L4, L5)
            fence = self._check(rid)
            if fence is not None and fence.kind == "retired":
                raise fence_error(rid, fence)
            # A record the snapshot hands out must survive a crash: every file read is synced (contract L5).
            contents = read_contents(dirs, rid, fsync=self._fsync)
            pending = self._pending(rid, damage)
            losses = pending_for(self.root, rid)  # held-back losses: named as lost (contract D14, L10)
            if fence is None:
                held = {m for loss in losses for m in loss.model_call_ids}  # lost, not in flight
                inflight = sorted(pending - contents.call_ids() - held)  # (contract L10)
                event = {"op": "freeze", "id": rid, "snapshot_id": uuid.uuid4().hex, "inflight": inflight}
                state.journal.append(dirs, [event], self._fsync, self._hook)
                fence = state.journal.fence(rid)
                assert fence is not None
        lost = [IncompleteCall(m, loss.describe()) for loss in losses for m in loss.model_call_ids or ("",)]
        calls = list(contents.incomplete) + [IncompleteCall(m, INFLIGHT_REASON) for m in fence.inflight]
        calls += [IncompleteCall("", reason) for reason in damage]
        calls += lost
        return CaptureSnapshot(
            rollout_id=rid,
            records=contents.records,
            tokens=contents.tokens,
            incomplete=contents.marker_exists or bool(calls),
            snapshot_id=fence.snapshot_id or "",
            version=contents.version + _held_back(losses),
            incomplete_calls=tuple(calls),
            damaged_lines=tuple(contents.damaged_lines),
            torn_tail=contents.torn_tail,
            in_flight=fence.inflight,
            lost_calls=tuple(contents.marks + lost),
            marked=bool(contents.marks) or bool(losses),
            unreadable=contents.unreadable,
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
                    return False  # only the exact snapshot is dropped (contract L6)
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
                # Phase 1: one append and one fsync make every fence durable, before any removal (contract L7).
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
        """Phase 2 of a retire (:func:`.removal.remove_fenced`), then one directory sync for the batch
        (contract L7, L14)."""
        try:
            outcome = remove_fenced(self._state, dirs, expected, result, self._hook)
        except BaseException:
            self._sync_after_error()
            raise
        self._fsync(dirs.root_fd())  # the removals are durable before the batch reports them (contract L7)
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
                fsync_dir(self.root, self._fsync)
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
                        result["failed"][rid] = describe_error(exc)
                        _logger.error("could not remove the records of rollout %s: %s", rid, exc)
                    self._hook("delete_removed_one")
                self._fsync(dirs.root_fd())
            except BaseException:
                self._sync_after_error()  # best effort, never hides the error (contract L3)
                raise
            # Records are gone (durably) before the fences go: never old records without their fence
            # (contract L8).
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
                        result["failed"][rid] = describe_error(exc)
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

    # -- the files ---------------------------------------------------------------------------------------

    def data_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + CAPTURE_SUFFIX)

    def incomplete_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + INCOMPLETE_SUFFIX)

    def tokens_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + TOKENS_SUFFIX)

    def is_incomplete(self, rollout_id: str) -> bool:
        """Whether the marker exists (whatever it is: a damaged marker says something went wrong too), or a
        writer's loss reserve holds a loss of the rollout that its marker does not have yet (contract D14)."""
        return os.path.lexists(self.incomplete_path(rollout_id)) or bool(pending_for(self.root, rollout_id))

    def incomplete_calls(self, rollout_id: str) -> list[IncompleteCall]:
        """The calls the rollout's marker names (``model_call_id`` ``""`` for a line that names none, and
        one "marked incomplete" for an empty marker, as NeMo Gym writes them), then each loss in a loss
        reserve that the marker does not have yet. Read without a lock, as :meth:`is_incomplete`."""
        calls = read_marks(self.incomplete_path(rollout_id)) or []
        for loss in pending_for(self.root, rollout_id):
            for mcid in loss.model_call_ids or ("",):
                calls.append(IncompleteCall(mcid, loss.describe()))
        return calls

    # -- the declared weight version and calls in flight ----------------------------------------------

    def set_weight_version(self, version: str | int) -> None:
        """Declare the weight (policy) version in force from now on for every call captured in this
        directory (by any writer, on any node sharing it, from its next batch): one ``fsync``-ed line in
        ``.otel-capture/weight_versions``. A record's ``weight_version`` is the version in force when its
        call started (unless the caller sent one), ``weight_version_at_end`` the one when it finished, if
        different. Raises ``ValueError`` for an empty, over-long or unprintable version."""
        with self._dirs() as dirs:
            declare(dirs, validate_weight_version(version), self._fsync)

    def weight_version(self) -> str | None:
        """The version declared last (``None`` before any declaration)."""
        view = dir_state(self.root).weights
        view.refresh()
        return view.current

    def rollout_ids(self) -> list[str]:
        """Every rollout with a data, token or incomplete file that is a regular file, or with a loss in a
        writer's loss reserve, sorted: the one listing of the directory's rollouts (``list_rollouts``,
        ``check`` and ``show`` use it) (contract L16)."""
        found = {rid for rid, _, st in self._scan() if stat.S_ISREG(st.st_mode)}
        # a rollout whose every file a full filesystem refused is known by its losses alone
        found.update(loss.rollout_id for loss in pending_losses(self.root) if loss.rollout_id)
        return sorted(found)

    def damaged_entries(self) -> list[tuple[str, str]]:
        """``(file name, what it is)`` for each entry named like a rollout's file that is not a regular file
        (a link, a FIFO, a directory: every reader skips it) or has several links (readers read it; the
        writer never appends to it). Nothing is ever written through any of them."""
        found = []
        for _, name, st in self._scan():
            what = problem(st, single_link=True)
            if what is not None:
                found.append((name, what))
        return sorted(found)

    def _scan(self) -> list[tuple[str, str, os.stat_result]]:
        """``(rollout id, file name, lstat)`` of every entry named like a rollout's file."""
        if not self.root.is_dir():
            return []
        found = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                for suffix in (CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX):
                    if entry.name.endswith(suffix):
                        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                            found.append(
                                (entry.name[: -len(suffix)], entry.name, entry.stat(follow_symlinks=False))
                            )
                        break
        return found

    def read_token_lines(self, rollout_id: str) -> RawLines | None:
        """The rollout's token file split into lines (as :meth:`read_lines`); ``None`` if absent."""
        return read_lines(self.tokens_path(rollout_id), self._lock_timeout)

    def read_lines(self, rollout_id: str) -> RawLines | None:
        """The rollout's data file split into lines, read whole under ``flock(LOCK_SH)``; ``None`` if absent,
        or when it is a link, a FIFO or a device (skipped and logged: never followed or waited on).

        The shared lock is the one NeMo Gym's readers take: appenders hold ``LOCK_EX`` for a whole line, so
        under it every line is either complete or was torn by a writer that died. One ``read()`` and one
        ``split`` cost no more than iterating the file, and make the torn tail plain to see. A lock held
        by another process past the lock timeout raises :class:`LockTimeoutError`.
        """
        return read_lines(self.data_path(rollout_id), self._lock_timeout)

    def stream_lines(self, rollout_id: str) -> StreamedLines | None:
        """The rollout's data file as :meth:`read_lines` sees it, without holding it in memory or holding its
        lock while the lines are used (``otel-capture show`` prints as it reads); ``None`` when absent or
        skipped, as :meth:`read_lines`."""
        return stream_lines(self.data_path(rollout_id), self._lock_timeout)


def _held_back(losses: list[Loss]) -> int:
    """The marker lines these losses will add (one per call); the overflow entry names no rollout."""
    return sum(len(loss.model_call_ids) + loss.more for loss in losses if loss.rollout_id)
