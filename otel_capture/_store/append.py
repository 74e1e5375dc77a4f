"""The fenced append: a rollout's lines (the writer's batches and ``CaptureStore.append_now``) and its
incomplete marks (:func:`fenced_mark_incomplete`), written under the rollout's stripe lock after reading
its fence, each file under its own ``flock(LOCK_EX)`` as NeMo Gym's writers do. Syncing is the caller's
(the writer syncs a batch once per file; :mod:`.sync`)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .._errors import CaptureFrozenError, CaptureRetiredError, DamagedEntryError
from .dirstate import DirState
from .fs import (
    FENCED_ERRNOS,
    FILE_MODE,
    AppendFiles,
    DirFds,
    fenced_error,
    flock_within,
    open_append,
    write_all,
)
from .journal import Fence, fence_error
from .locks import LockFiles
from .marker import mark_lines
from .names import CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX
from .sync import Fsync

_logger = logging.getLogger(__name__)

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class AppendOutcome:
    """What one rollout's fenced append did. The caller ``fsync``s ``fds`` and then closes them (unless
    they came from an :class:`AppendFiles`, which keeps them)."""

    accepted: list[int] = field(default_factory=list)
    dropped: list[tuple[int, CaptureFrozenError]] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    created: bool = False
    unmarked: list[str] = field(default_factory=list)
    """Begun calls whose ``+`` marker could not be made (no inode or block for the marker file): their
    lines were still written; the caller decides what a freeze elsewhere may have missed."""
    marker_error: OSError | None = None


def _append_locked(fd: int, data: bytes, label: str, timeout: float, clean_end: int = -1) -> int:
    """Append under the data file's own ``flock``, as NeMo Gym's writers and readers expect; a lock held
    by another process for more than ``timeout`` seconds raises :class:`LockTimeoutError`, nothing written.
    Returns the file's size after the append. ``clean_end``: see :func:`_append_held`."""
    flock_within(fd, fcntl.LOCK_EX, timeout, label)  # NeMo Gym's lock, for the write only (contract D8)
    try:
        return _append_held(fd, data, label, os.fstat(fd).st_size, clean_end)
    finally:
        _unlock(fd, label)


def _unlock(fd: int, label: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:  # a lock lost meanwhile: say so, whatever else went wrong
        raise fenced_error(exc, label) from None


def _append_held(fd: int, data: bytes, label: str, start: int, clean_end: int = -1) -> int:
    """Append ``data`` to a data file whose ``flock`` the caller holds and whose size is ``start``.

    A file that does not end in ``\n`` ends in a line torn by a writer that died mid-``write``: it is
    terminated first, so it stays one damaged line for readers to report instead of swallowing our line.
    ``clean_end``: the size the file had after our own last append through ``fd``; a file still that size
    ends in our ``\n``, and its last byte is not read again.
    """
    if start and start != clean_end and os.pread(fd, 1, start - 1) != b"\n":
        data = b"\n" + data  # a torn tail is terminated first (contract D7)
    try:
        write_all(fd, data)  # the batch's lines for this file in one write (contract D7)
    except OSError as error:
        if error.errno in FENCED_ERRNOS:  # the lock is gone: never cut back (contract D27)
            raise fenced_error(error, label) from None
        # Half a batch would leave a torn line that every later append follows: cut back (contract D7, D17).
        try:
            os.ftruncate(fd, start)
        except OSError as exc:
            _logger.error("could not cut a partly written batch back to %d bytes: %s", start, exc)
        raise
    return start + len(data)


def _append_file(
    dirs: DirFds,
    name: str,
    data: bytes,
    mode: int,
    outcome: AppendOutcome,
    lock_timeout: float,
    files: AppendFiles | None,
    before_wait: Callable[[], None] | None = None,
) -> None:
    if files is None:
        fd, created = open_append(dirs.root_fd(), name, name, mode)
        outcome.fds.append(fd)
        outcome.created |= created
        _append_locked(fd, data, name, lock_timeout)
        return
    # A kept file is locked first, then checked (its lstat gives the size the append starts at).
    fd, created, start = files.open_locked(dirs.root_fd(), name, name, lock_timeout, mode, before_wait)
    try:
        outcome.fds.append(fd)
        outcome.created |= created
        clean_end = files.clean_end(fd)
        files.appended(fd, -1)  # unknown until this append has succeeded
        files.appended(fd, _append_held(fd, data, name, start, clean_end))
    finally:
        _unlock(fd, name)


@dataclass
class AppendJob:
    """One rollout's part of a writer batch: its ``(model_call_id, capture line, tokens line)`` entries,
    the calls that began since the last batch, and how long its data file's lock is waited for."""

    rollout_id: str
    calls: list[tuple[str, bytes, bytes | None]]
    begins: list[str]
    data_lock_timeout: float | None = None


def fenced_append(
    state: DirState,
    dirs: DirFds,
    rollout_id: str,
    calls: list[tuple[str, bytes, bytes | None]],
    begins: Iterable[str] = (),
    *,
    file_mode: int = FILE_MODE,
    data_lock_timeout: float | None = None,
    files: AppendFiles | None = None,
    lock_files: LockFiles | None = None,
) -> AppendOutcome:
    """Append one rollout's ``(model_call_id, capture line, tokens line)`` entries, unless fenced.

    Under the rollout's stripe: a frozen or retired rollout drops every entry (each with its typed
    error); a call admitted before the rollout's latest lifecycle event is dropped as late; the rest is
    written in one ``write`` per file. ``begins`` are calls that started since the last batch: their
    ``+`` markers are written here (when their line is not in the same batch). Raises ``OSError`` when a
    file cannot be written, ``DamagedEntryError`` when one is not a regular file of its own, and
    ``LockTimeoutError`` when a lock stays held (a data file's past ``data_lock_timeout``, default the
    ``dirs``' lock timeout); the caller marks the rollout incomplete. No descriptor is leaked. With
    ``files`` (the writer thread's), the data files are opened through it and stay open after the batch;
    with ``lock_files``, so does the stripe's lock file.
    """
    job = AppendJob(rollout_id, calls, list(begins), data_lock_timeout)
    stripe = state.locks.stripe(rollout_id)
    (result,) = fenced_append_stripe(
        state, dirs, stripe, [job], file_mode=file_mode, files=files, lock_files=lock_files
    )
    if isinstance(result, OSError):
        raise result
    return result


class SharedRefresh:
    """The fence journal's refresh for a batch's stripes held at once (:mod:`.batch_io`): one ``lstat``
    serves every stripe that was already held when it began, instead of one per stripe, each waiting for
    the one before it (the journal's view is refreshed under one lock).

    Why that keeps the stripe's promise (contract L4): a fence is appended to the journal while its maker
    holds the stripe, so a fence on a stripe we hold was complete before we took it, and a journal
    ``lstat`` issued after that sees it (fresh with the attribute caches off: ``docs/scaling.md``). A caller therefore waits for a
    refresh that *begins* after it called, never for one already under way; the callers that arrive
    during one all share the next. Its error, if any, is each sharer's."""

    def __init__(self, state: DirState, dirs: DirFds) -> None:
        self._state, self._dirs = state, dirs
        self._changed = threading.Condition()
        self._begun = 0  # refreshes begun, one at a time: one runs while the latest finished is older
        self._last: tuple[int, BaseException | None] = (0, None)  # the latest finished and its error

    def __call__(self) -> None:
        with self._changed:
            wanted = self._begun + 1  # the first refresh to begin from now on
            # while one runs (the latest finished is older than the latest begun) and has not served us
            while self._last[0] < min(self._begun, wanted):
                self._changed.wait()
            if self._last[0] >= wanted:
                error = self._last[1]
                if error is not None:
                    raise error
                return
            self._begun = mine = wanted
        error = None
        try:
            self._state.journal.refresh(self._dirs.state_fd())
        except BaseException as exc:
            error = exc
            raise
        finally:
            with self._changed:
                self._last = (mine, error)
                self._changed.notify_all()


def fenced_append_stripe(
    state: DirState,
    dirs: DirFds,
    stripe: int,
    jobs: list[AppendJob],
    *,
    file_mode: int = FILE_MODE,
    files: AppendFiles | None = None,
    lock_files: LockFiles | None = None,
    refresh: SharedRefresh | None = None,
) -> list[AppendOutcome | OSError]:
    """:func:`fenced_append` for every rollout of one stripe in a batch, under one hold of the stripe and
    one read of the fence journal: the stripe's lock is taken once, the journal refreshed once after it
    (a fence made before we hold the stripe is seen; one made after waits for us) (contract L4), then each
    rollout is fenced and appended in turn. Each rollout's outcome, or the ``OSError`` that failed it (the
    others go on); when the stripe or the journal cannot be had, every rollout fails with that error.
    ``refresh``: the batch's :class:`SharedRefresh` when its stripes are held at once.
    """
    try:
        lock_fd = state.locks.acquire(dirs, stripe, lock_files)
    except OSError as exc:
        return [exc for _ in jobs]
    results: list[AppendOutcome | OSError] = []
    try:
        try:
            if refresh is None:
                state.journal.refresh(dirs.state_fd())
            else:
                refresh()  # one lstat shared with the stripes held meanwhile (still after we hold ours)
        except OSError as exc:
            for job in jobs:
                state.calls.end(job.rollout_id, [mcid for mcid, _, _ in job.calls])
            return [exc for _ in jobs]
        for job in jobs:
            try:
                results.append(_append_held_stripe(state, dirs, job, file_mode, files))
            except OSError as exc:
                results.append(exc)
    finally:
        state.locks.release(stripe, lock_fd, lock_files)
    return results


def fenced_append_wave(
    state: DirState,
    dirs: DirFds,
    stripes: dict[int, list[AppendJob]],
    *,
    file_mode: int,
    files: AppendFiles,
    lock_files: LockFiles,
) -> list[tuple[list[AppendJob], list[AppendOutcome | OSError]]]:
    """:func:`fenced_append_stripe` for a whole batch on one thread (a local disk), the fence journal read
    once for every stripe that could be had at once instead of once per stripe: those stripes are taken
    in ascending order without waiting, the journal refreshed once after the last (a fence is appended
    while its maker holds the stripe, so one made before we held ours is seen, one made after waits for
    us) (contract L4), then each stripe's rollouts are appended and the stripe let go. Whatever would
    wait leaves that wave: a stripe held elsewhere, and, when a data file's lock is not had at once, the
    stripes not yet written (let go before the wait, so no stripe is held longer than today while another
    lock is waited for); each is then done alone by :func:`fenced_append_stripe`. Each stripe's jobs with
    their outcomes or errors, every stripe of ``stripes`` once."""
    done: list[tuple[list[AppendJob], list[AppendOutcome | OSError]]] = []
    held: dict[int, int] = {}  # stripe -> lock descriptor, ascending
    later: list[int] = []
    for stripe in sorted(stripes):
        try:
            fd = state.locks.try_acquire(dirs, stripe, lock_files)
        except OSError as exc:
            done.append((stripes[stripe], [exc for _ in stripes[stripe]]))
            continue
        if fd is None:
            later.append(stripe)
        else:
            held[stripe] = fd
    try:
        if held:
            try:
                state.journal.refresh(dirs.state_fd())  # after every stripe of the wave is held
            except OSError as exc:
                for stripe in list(held):
                    _let_go(state, held, stripe, lock_files)
                    for job in stripes[stripe]:
                        state.calls.end(job.rollout_id, [mcid for mcid, _, _ in job.calls])
                    done.append((stripes[stripe], [exc for _ in stripes[stripe]]))

        def leave_wave() -> None:  # before a wait: only the stripe being written stays held
            for stripe in list(held)[1:]:
                _let_go(state, held, stripe, lock_files)
                later.append(stripe)

        while held:
            stripe = next(iter(held))
            results: list[AppendOutcome | OSError] = []
            try:
                for job in stripes[stripe]:
                    try:
                        results.append(_append_held_stripe(state, dirs, job, file_mode, files, leave_wave))
                    except OSError as exc:
                        results.append(exc)
            finally:
                _let_go(state, held, stripe, lock_files)
            done.append((stripes[stripe], results))
    finally:
        for stripe in list(held):  # a bug above: nothing stays held
            _let_go(state, held, stripe, lock_files)
    for stripe in sorted(later):
        results = fenced_append_stripe(
            state, dirs, stripe, stripes[stripe], file_mode=file_mode, files=files, lock_files=lock_files
        )
        done.append((stripes[stripe], results))
    return done


def _let_go(state: DirState, held: dict[int, int], stripe: int, lock_files: LockFiles) -> None:
    state.locks.release(stripe, held.pop(stripe), lock_files)


def _append_held_stripe(
    state: DirState,
    dirs: DirFds,
    job: AppendJob,
    file_mode: int,
    files: AppendFiles | None,
    before_wait: Callable[[], None] | None = None,
) -> AppendOutcome:
    """One rollout's fence check and append, its stripe held and the journal fresh. ``before_wait``:
    called before a data file's lock is waited for (:func:`fenced_append_wave`)."""
    outcome = AppendOutcome()
    rollout_id, calls, begins = job.rollout_id, job.calls, job.begins
    mcids = [mcid for mcid, _, _ in calls]
    try:
        fence = state.journal.fence(rollout_id)
        if fence is not None:
            error = fence_error(rollout_id, fence)
            outcome.dropped = [(i, error) for i in range(len(calls))]
            last = state.journal.last_seq(rollout_id)
            for mcid in begins:  # admitted at this epoch: still late after a delete reuses the id
                state.calls.admit(rollout_id, mcid, last)
            return outcome
        kept, ended = _admit(state, rollout_id, calls, begins, outcome)
        in_batch = set(mcids)
        begun = [m for m in begins if m not in in_batch]
        timeout = dirs.lock_timeout if job.data_lock_timeout is None else job.data_lock_timeout
        _write_admitted(
            state, dirs, rollout_id, kept, begun, ended, outcome, file_mode, timeout, files, before_wait
        )
    finally:
        state.calls.end(rollout_id, mcids)
    return outcome


def _admit(
    state: DirState,
    rollout_id: str,
    calls: list[tuple[str, bytes, bytes | None]],
    begins: list[str],
    outcome: AppendOutcome,
) -> tuple[list[tuple[str, bytes, bytes | None]], list[str]]:
    """The entries to write (late ones dropped into ``outcome``) and the calls whose ``-`` marker is due."""
    epoch = state.journal.last_seq(rollout_id)
    for mcid in begins:
        state.calls.admit(rollout_id, mcid, epoch)
    kept: list[tuple[str, bytes, bytes | None]] = []
    ended: list[str] = []
    begun_here = set(begins)
    for index, (mcid, line, tokens) in enumerate(calls):
        admitted = state.calls.epoch(rollout_id, mcid)
        if (
            admitted is not None and epoch > admitted
        ):  # admitted before a retire or delete: late (contract L9)
            late = CaptureRetiredError(
                f"rollout {rollout_id} was retired or deleted while call {mcid} was in flight"
            )
            outcome.dropped.append((index, late))
            continue
        if admitted is not None and mcid not in begun_here:
            ended.append(mcid)
        outcome.accepted.append(index)
        kept.append((mcid, line, tokens))
    return kept, ended


def _write_admitted(
    state: DirState,
    dirs: DirFds,
    rollout_id: str,
    kept: list[tuple[str, bytes, bytes | None]],
    begun: list[str],
    ended: list[str],
    outcome: AppendOutcome,
    file_mode: int,
    lock_timeout: float,
    files: AppendFiles | None,
    before_wait: Callable[[], None] | None = None,
) -> None:
    # The marker is opened first: a damaged one fails the batch before any line is written. One that a
    # full filesystem cannot create does not: the lines matter more than another process's view of them.
    # The writer's batches (``files``) keep it, and its descriptor, while the rollout is active (D19).
    keep = files is not None
    marker = None
    unlink_marker = False  # its last calls end here, known without reading it (contract D19)
    if begun or ended:
        try:
            if keep:
                marker = state.markers.take(dirs, rollout_id, create=bool(begun))
            else:
                unlink_marker = not begun and state.markers.ends_all(dirs, rollout_id, ended)
                if not unlink_marker:
                    marker = state.markers.open(dirs, rollout_id, create=bool(begun))
        except OSError as exc:
            if isinstance(exc, DamagedEntryError) or exc.errno not in _NO_ROOM:
                raise
            outcome.unmarked, outcome.marker_error = list(begun), exc
    written = False
    try:
        if kept:
            lines = b"".join(line for _, line, _ in kept)
            name = rollout_id + CAPTURE_SUFFIX
            _append_file(dirs, name, lines, file_mode, outcome, lock_timeout, files, before_wait)
            token_data = b"".join(tokens for _, _, tokens in kept if tokens)
            if token_data:
                name = rollout_id + TOKENS_SUFFIX
                _append_file(dirs, name, token_data, file_mode, outcome, lock_timeout, files, before_wait)
        if marker is not None:
            state.markers.write_to(dirs, marker, rollout_id, begun, ended, keep=keep)
            written = True
        elif unlink_marker:
            state.markers.remove(dirs, rollout_id)
    except BaseException:
        for fd in outcome.fds:
            if files is None:
                os.close(fd)
            else:
                files.discard(fd)
        outcome.fds.clear()
        raise
    finally:
        if marker is not None:
            if keep and written:
                state.markers.keep(rollout_id, marker)
            else:
                os.close(marker)


def close_markers(
    state: DirState, dirs: DirFds, lock_files: LockFiles | None = None, *, leave: int = 0
) -> None:
    """The writer closes the rollouts whose markers it keeps, the least recently used first, until at most
    ``leave`` are kept (0: its idle close and its stop): each under its stripe, a marker with no call in
    flight is removed and its descriptor closed (contract D19). A stripe that cannot be had (the directory
    gone, a lock held past the timeout) only closes its descriptors: the files stay, empty or with calls
    still in flight, for a later retire or delete."""
    rollouts = state.markers.kept()
    if len(rollouts) <= leave:
        return
    by_stripe: dict[int, list[str]] = {}
    for rollout_id in rollouts[: len(rollouts) - leave]:
        by_stripe.setdefault(state.locks.stripe(rollout_id), []).append(rollout_id)
    for stripe, rollout_ids in sorted(by_stripe.items()):
        try:
            lock_fd = state.locks.acquire(dirs, stripe, lock_files)
        except OSError as exc:
            _logger.warning("could not close %d in-flight marker(s): %s", len(rollout_ids), exc)
            for rollout_id in rollout_ids:
                state.markers.close_kept(None, rollout_id)
            continue
        try:
            for rollout_id in rollout_ids:
                try:
                    state.markers.close_kept(dirs, rollout_id)
                except OSError as exc:  # left as it is: empty, or with calls that stay in flight
                    _logger.warning("could not close the in-flight marker of rollout %s: %s", rollout_id, exc)
        finally:
            state.locks.release(stripe, lock_fd, lock_files)


def fenced_mark_incomplete(
    state: DirState,
    dirs: DirFds,
    rollout_id: str,
    calls: list[tuple[str, str]],
    *,
    fsync: Fsync,
    check: Callable[[str], Fence | None],
    file_mode: int = FILE_MODE,
    end_refused: bool = True,
) -> Fence | None:
    """Durably mark ``(model_call_id, reason)`` calls as not captured: one JSON line each in
    ``<id>.capture.incomplete`` (NeMo Gym only checks that the file exists), and the calls end (their
    ``-`` markers, so no other process takes them for calls still in flight).

    Under the rollout's stripe, after ``check`` (which refreshes the journal and returns the fence): a
    retired rollout's marker would outlive its removed records, so nothing is written and the fence is
    returned for the caller to refuse or ignore; the calls then end too unless ``end_refused`` is false
    (``CaptureStore.mark_incomplete``: a refused mark leaves the call admitted where it was, so its line
    after a delete is still late, as (contract L9) says). A frozen rollout is marked: its snapshot may list a line
    whose sync failed, and the changed version makes a stale ``drop`` fail. The one path shared by the
    writer thread (a failed batch, an unbuildable record) and ``CaptureStore.mark_incomplete``.

    When the lifecycle state itself is damaged (a planted lock file or journal), the marker is still
    written, without the lock or the fence: the loss is visible, which matters more than a marker that
    might outlive a retire.
    """
    data = mark_lines(calls)
    mcids = [mcid for mcid, _ in calls]
    refused = False
    with state.locks.hold_ids(dirs, [rollout_id], or_unlocked=True):
        try:
            try:
                fence = check(rollout_id)
            except DamagedEntryError as exc:
                _logger.error("rollout %s: %s; marking it incomplete whatever its fence", rollout_id, exc)
                fence = None
            if fence is not None and fence.kind == "retired":
                refused = True
                return fence
            name = rollout_id + INCOMPLETE_SUFFIX
            fd, created = open_append(dirs.root_fd(), name, name, file_mode)
            try:
                _append_locked(fd, data, name, dirs.lock_timeout)
                fsync(fd)  # the mark is durable before the call is reported lost (contract D5)
            finally:
                os.close(fd)
            if created:
                fsync(dirs.root_fd())  # the new marker's entry (contract D10)
            if fence is None:
                _end_markers(state, dirs, rollout_id, mcids)
            return fence
        finally:
            if end_refused or not refused:
                state.calls.end(rollout_id, mcids)


def _end_markers(state: DirState, dirs: DirFds, rollout_id: str, mcids: list[str]) -> None:
    try:
        state.markers.write(dirs, rollout_id, [], mcids)
    except OSError as exc:  # the incomplete marker, written, is what matters
        _logger.error("could not end the in-flight markers of rollout %s: %s", rollout_id, exc)
