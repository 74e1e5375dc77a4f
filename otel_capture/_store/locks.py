"""Striped rollout locks: ``.otel-capture/locks/NN.lock``, chosen by ``crc32(rollout_id) % 64`` (contract L4).

A stripe is ``flock(LOCK_EX)`` plus an in-process lock (``flock`` does not exclude two threads sharing one
open file). Lock files are never deleted, so two processes never lock different inodes. Order: stripes
(sorted), then the journal's lock. Every wait ends at the lock timeout (contract D21).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import threading
import zlib
from collections.abc import Iterable, Iterator

from .._errors import DamagedEntryError, LockTimeoutError
from .fs import DirFds, flock_within, open_file, still_named, try_flock
from .names import LOCKS_DIR, state_label

_logger = logging.getLogger(__name__)

STRIPES = 64
_NAMES = [f"{stripe:02d}.lock" for stripe in range(STRIPES)]
_LABELS = [state_label(LOCKS_DIR, name) for name in _NAMES]


class LockFiles:
    """One writer thread's stripe lock files, kept open from one hold to the next instead of opened,
    checked and closed per hold (an ``openat``, an ``fstat`` and a ``close`` each time).

    A kept descriptor is used only once the name still leads to it *while its ``flock`` is held*: after
    the ``flock``, one ``lstat`` of ``NN.lock`` relative to this operation's ``locks/`` descriptor (no
    link followed) must find a regular file with the same device and inode. Anything else (a link, a FIFO
    or another file planted in its place, the name gone, ``locks/`` replaced) unlocks and closes it, and
    the name is opened afresh with every check of a first open: a planted link is a
    :class:`DamagedEntryError` for that rollout, never followed. Checked under the lock, the name leads to
    the locked inode at that moment, so a process that opens the name then locks the same inode, and waits
    for us. The inode cannot be reused while the descriptor holds it.

    At most :data:`STRIPES` descriptors (one per stripe, for one directory); :meth:`close_all` closes them
    when the writer goes idle or stops. Used by one thread only, and each descriptor only under its
    stripe's in-process lock.
    """

    def __init__(self) -> None:
        self._fds: dict[int, tuple[int, int, int]] = {}  # stripe -> (fd, st_dev, st_ino)

    def __len__(self) -> int:
        return len(self._fds)

    def close_all(self) -> None:
        fds, self._fds = self._fds, {}
        for fd, _, _ in fds.values():
            _close(fd)

    def kept(self, stripe: int) -> int | None:
        entry = self._fds.get(stripe)
        return None if entry is None else entry[0]

    def keep(self, stripe: int, fd: int, st: os.stat_result) -> None:
        self._fds[stripe] = (fd, st.st_dev, st.st_ino)

    def still_named(self, locks_fd: int, stripe: int, name: str) -> bool:
        """Whether ``name`` in ``locks_fd`` is still the kept file of ``stripe`` (a regular file, same
        device and inode); when not, the descriptor is unlocked, closed and forgotten."""
        fd, dev, ino = self._fds[stripe]
        st = still_named(locks_fd, name, dev, ino)
        if st is not None and stat.S_ISREG(st.st_mode):
            return True
        del self._fds[stripe]
        _unlock_and_close(fd)
        return False

    def forget(self, stripe: int) -> None:
        entry = self._fds.pop(stripe, None)
        if entry is not None:
            _unlock_and_close(entry[0])


def _flock(fd: int, label: str, timeout: float | None) -> bool:
    """``flock(LOCK_EX)`` waited for ``timeout`` seconds (:func:`.fs.flock_within`), or, when ``None``,
    tried once: False when another process holds it."""
    if timeout is None:
        return try_flock(fd, fcntl.LOCK_EX, label)
    flock_within(fd, fcntl.LOCK_EX, timeout, label)
    return True


def _unlock_and_close(fd: int) -> None:
    # Unlocked first: a close releases the flock only with the last descriptor of that open file, and a
    # child forked meanwhile shares it.
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    _close(fd)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError as exc:  # a lock file: nothing was ever written through it
        _logger.warning("closing a stripe lock file failed: %s", exc)


class StripedLocks:
    """64 lock files per directory, each paired with an in-process lock.

    Without ``files``, a lock file is opened for each hold and closed after it (closing releases the
    ``flock``): a lifecycle operation holds no descriptor once it returns, and a process touching
    thousands of directories never holds thousands of descriptors. With ``files`` (the writer thread's
    :class:`LockFiles`), the descriptors stay open between holds and are checked under the lock instead.
    A lock file that is not a regular file (a planted link: following it would create or lock a file
    outside) is a ``DamagedEntryError``; nobody ever locks it, so no two holders can disagree.
    """

    def __init__(self) -> None:
        self._threads = [threading.Lock() for _ in range(STRIPES)]

    @staticmethod
    def create_all(dirs: DirFds) -> None:
        """Create every stripe's lock file that is missing (:meth:`.dirstate.DirState.prepare`): a lock is
        then never the file a full filesystem cannot create. Never follows a link; raises ``OSError`` for
        the first file it cannot create, after trying the others."""
        locks_fd = dirs.state_fd(LOCKS_DIR)
        present = set(os.listdir(locks_fd))
        first: OSError | None = None
        for name, label in zip(_NAMES, _LABELS, strict=True):
            if name in present:
                continue
            try:
                fd, _ = open_file(locks_fd, name, os.O_RDWR | os.O_CREAT, label, single_link=False)
            except OSError as exc:
                first = first or exc
                continue
            _close(fd)
        if first is not None:
            raise first

    @staticmethod
    def stripe(rollout_id: str) -> int:
        return zlib.crc32(rollout_id.encode()) % STRIPES

    @contextlib.contextmanager
    def hold(
        self,
        dirs: DirFds,
        stripes: Iterable[int],
        *,
        or_unlocked: bool = False,
        files: LockFiles | None = None,
    ) -> Iterator[None]:
        """Hold these stripes (acquired in ascending order, so two holders never deadlock).

        ``or_unlocked``: a stripe whose lock file is damaged is logged and not held (only for marking a
        rollout incomplete, where a visible loss matters more than the lock). ``files``: lock files kept
        open between holds (one thread's; see :class:`LockFiles`)."""
        held: list[tuple[int, int]] = []
        try:
            for stripe in sorted(set(stripes)):
                try:
                    fd = self.acquire(dirs, stripe, files)
                except DamagedEntryError as exc:
                    if not or_unlocked:
                        raise
                    _logger.error("%s; going on without that lock", exc)
                    continue
                held.append((stripe, fd))
            yield
        finally:
            for stripe, fd in reversed(held):
                self.release(stripe, fd, files)

    def acquire(self, dirs: DirFds, stripe: int, files: LockFiles | None = None) -> int:
        """Hold one stripe (the writer's path: no context manager, no sorting); returns the lock file's
        descriptor, for :meth:`release`. On any error nothing is held. Waits at most the lock timeout
        (contract L4, D21, D23)."""
        name = _NAMES[stripe]
        if not self._threads[stripe].acquire(timeout=dirs.lock_timeout):
            raise LockTimeoutError(_LABELS[stripe], dirs.lock_timeout, "another thread of this process")
        try:
            fd = self._locked(dirs, stripe, name, _LABELS[stripe], files)
        except BaseException:
            self._threads[stripe].release()
            raise
        assert fd is not None  # waited for: locked, or raised
        return fd

    def try_acquire(self, dirs: DirFds, stripe: int, files: LockFiles) -> int | None:
        """:meth:`acquire` without waiting (the writer's batch on a local disk takes the stripes it can have
        at once): ``None`` when another thread or process holds the stripe now. Errors as :meth:`acquire`."""
        if not self._threads[stripe].acquire(blocking=False):
            return None
        try:
            fd = self._locked(dirs, stripe, _NAMES[stripe], _LABELS[stripe], files, wait=False)
        except BaseException:
            self._threads[stripe].release()
            raise
        if fd is None:
            self._threads[stripe].release()
        return fd

    def release(self, stripe: int, fd: int, files: LockFiles | None = None) -> None:
        """Let go of a stripe taken by :meth:`acquire`: a kept descriptor is unlocked, any other closed."""
        try:
            if files is None or files.kept(stripe) != fd:
                _close(fd)
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            _logger.warning("unlocking a stripe lock file failed: %s", exc)
            if files is not None:
                files.forget(stripe)  # closing it releases the lock in any case
        finally:
            self._threads[stripe].release()

    @staticmethod
    def _locked(
        dirs: DirFds, stripe: int, name: str, label: str, files: LockFiles | None, wait: bool = True
    ) -> int | None:
        """A descriptor of the stripe's lock file, ``flock``-ed (kept by ``files`` when given); without
        ``wait``, ``None`` when another process holds it now (a descriptor opened is kept, unlocked)."""
        locks_fd = dirs.state_fd(LOCKS_DIR)
        if files is not None:
            fd = files.kept(stripe)
            if fd is not None:
                try:
                    if not _flock(fd, label, dirs.lock_timeout if wait else None):
                        return None
                    if files.still_named(locks_fd, stripe, name):
                        return fd
                except BaseException:
                    files.forget(stripe)
                    raise
        fd, st = open_file(
            locks_fd,
            name,
            os.O_RDWR | os.O_CREAT,
            label,
            single_link=False,  # only ever locked, never written: a hard link changes nothing
        )
        try:
            locked = _flock(fd, label, dirs.lock_timeout if wait else None)
        except BaseException:
            os.close(fd)
            raise
        if files is not None:
            files.keep(stripe, fd, st)
        elif not locked:
            _close(fd)
        return fd if locked else None

    def hold_ids(
        self,
        dirs: DirFds,
        rollout_ids: Iterable[str],
        *,
        or_unlocked: bool = False,
        files: LockFiles | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        return self.hold(
            dirs, (self.stripe(rid) for rid in rollout_ids), or_unlocked=or_unlocked, files=files
        )
