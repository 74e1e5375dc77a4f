"""How the store makes what it wrote durable: a batch's files (one ``syncfs`` or one ``fsync`` each), a
directory whose entries changed, and the ``syncfs`` binding. Which of the two a batch uses is decided once
per directory, from its filesystem (:mod:`.fstype`)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

from .fstype import SyncChoice
from .libc import LIBC

Fsync = Callable[[int], None]

__all__ = ["LIBC_SYNCFS", "Fsync", "fsync_dir", "sync_batch"]


def _libc_syncfs() -> Callable[[int], None] | None:
    """Linux ``syncfs(2)`` through ctypes (the standard library has no binding), or None elsewhere."""
    function = getattr(LIBC, "syncfs", None)
    if function is None:
        return None
    function.argtypes = [ctypes.c_int]

    def syncfs(fd: int) -> None:
        if function(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    return syncfs


LIBC_SYNCFS = _libc_syncfs()


def fsync_dir(path: str | os.PathLike[str], fsync: Fsync) -> None:
    """Open a directory and ``fsync`` it: its new, renamed or removed entries survive a crash. The path
    is followed: it is the capture directory (the user's choice) or its parent, never an entry inside."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def sync_batch(
    fds: list[int],
    created: bool,
    root: str | os.PathLike[str],
    choice: SyncChoice,
    fsync: Fsync,
    syncfs: Fsync | None,
) -> int:
    """Make every file of a batch durable, and ``root`` when the batch created a file in it; returns the
    number of flushes (contract D4, D10).

    On a local filesystem, with two or more files, one ``syncfs`` of the capture directory's
    filesystem replaces one ``fsync`` per file plus the directory's: the batch pays one flush instead
    of one per rollout (at 64 concurrent calls over 32 rollouts that is the difference between about
    0.9 and 0.1 flushes per record). ``syncfs`` also writes out other files of that filesystem, so it
    is used only where it exists (Linux) and where it is not disabled; a single file keeps its own
    ``fsync``. On a network or FUSE filesystem (NFS, Lustre, GlusterFS...) ``syncfs`` returns at once
    without the server receiving any sync, so there every file gets its own ``fsync``, the only call
    forwarded to the server (:func:`.fstype.choose_sync` decides, once, from ``statfs``).
    """
    if not fds:
        return 0
    if len(fds) >= 2 and syncfs is not None and choice.kind == "syncfs":
        syncfs(fds[0])
        return 1
    for fd in fds:
        fsync(fd)
    if created:
        fsync_dir(root, fsync)
    return len(fds) + int(created)
