"""Striped rollout locks: ``.otel-capture/locks/NN.lock``, chosen by ``crc32(rollout_id) % 64``.

A rollout's writers and lifecycle operations hold its stripe (``flock(LOCK_EX)`` plus an in-process lock,
because ``flock`` does not exclude two threads sharing one open file) for the whole fence check + append,
or fence + removal. Lock files are created on first use and never deleted, so two processes can never
lock different inodes. Order: stripes (sorted) first, then the journal's lock. Every wait for a stripe
ends after the operation's lock timeout (:class:`LockTimeoutError`). See ``docs/lifecycle.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import zlib
from collections.abc import Iterable, Iterator

from .fs import DirFds, flock_within, open_file
from .types import DamagedEntryError, LockTimeoutError

_logger = logging.getLogger(__name__)

STRIPES = 64


class StripedLocks:
    """64 lock files per directory, each paired with an in-process lock.

    A lock file is opened for each hold and closed after it (closing releases the ``flock``): one ``open``
    per stripe per batch is cheap, and a process touching thousands of directories never holds thousands
    of descriptors. A lock file that is not a regular file (a planted link: following it would create or
    lock a file outside) is a ``DamagedEntryError``; nobody ever locks it, so no two holders can disagree.
    """

    def __init__(self) -> None:
        self._threads = [threading.Lock() for _ in range(STRIPES)]

    @staticmethod
    def stripe(rollout_id: str) -> int:
        return zlib.crc32(rollout_id.encode()) % STRIPES

    @contextlib.contextmanager
    def hold(self, dirs: DirFds, stripes: Iterable[int], *, or_unlocked: bool = False) -> Iterator[None]:
        """Hold these stripes (acquired in ascending order, so two holders never deadlock).

        ``or_unlocked``: a stripe whose lock file is damaged is logged and not held (only for marking a
        rollout incomplete, where a visible loss matters more than the lock)."""
        held: list[tuple[int, int]] = []
        try:
            for stripe in sorted(set(stripes)):
                name = f"{stripe:02d}.lock"
                if not self._threads[stripe].acquire(timeout=dirs.lock_timeout):
                    label = f".otel-capture/locks/{name}"
                    raise LockTimeoutError(label, dirs.lock_timeout, "another thread of this process")
                try:
                    fd, _ = open_file(
                        dirs.state_fd("locks"),
                        name,
                        os.O_RDWR | os.O_CREAT,
                        f".otel-capture/locks/{name}",
                        single_link=False,  # only ever locked, never written: a hard link changes nothing
                    )
                except DamagedEntryError as exc:
                    self._threads[stripe].release()
                    if not or_unlocked:
                        raise
                    _logger.error("%s; going on without that lock", exc)
                    continue
                except BaseException:
                    self._threads[stripe].release()
                    raise
                held.append((stripe, fd))
                flock_within(fd, fcntl.LOCK_EX, dirs.lock_timeout, f".otel-capture/locks/{name}")
            yield
        finally:
            for stripe, fd in reversed(held):
                os.close(fd)
                self._threads[stripe].release()

    def hold_ids(
        self, dirs: DirFds, rollout_ids: Iterable[str], *, or_unlocked: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        return self.hold(dirs, (self.stripe(rid) for rid in rollout_ids), or_unlocked=or_unlocked)
