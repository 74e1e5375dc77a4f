"""The store's no-follow I/O: the one way it touches the filesystem (contract D21, D24, D25).

The capture directory's own path is the user's choice and is followed; every path inside it is opened
relative to a directory descriptor with ``O_NOFOLLOW`` (:class:`DirFds`: ``.otel-capture`` and its
subdirectories one component at a time), ``O_NONBLOCK``, and ``fstat``-ed: anything but a regular file
(of one link, for a file the store writes) is a :class:`DamagedEntryError`. Opens that race a creator
retry a bounded number of times; every ``flock`` wait ends (:func:`flock_within`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from .._errors import DamagedEntryError, LockTimeoutError, UnsafeDirectoryError
from .._settings import DEFAULT_LOCK_TIMEOUT_S
from .names import STATE_DIR
from .sync import Fsync, fsync_dir

_logger = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700
OPEN_TRIES = 3
LOCK_POLL_MAX_S = 0.05  # the longest sleep between two tries of a busy flock


_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_SUBDIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# What a lock or a write on a shared filesystem says when this node lost its lock (GlusterFS with
# client.strict-locks: EBADFD; NFS after a lease expired: ENOLCK or ESTALE, a file replaced on the server).
# It means "you were fenced", never "retry": the lock is gone, another node may hold it now.
FENCED_ERRNOS = frozenset({errno.EBADFD, errno.ENOLCK, errno.ESTALE})
# What open() says when the entry is not a file it can open as asked: a link under O_NOFOLLOW, a FIFO or
# socket opened write-only without a reader, a directory opened for writing.
_NOT_A_FILE = {errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR, errno.EOPNOTSUPP}


def kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a device"


def problem(st: os.stat_result, *, single_link: bool) -> str | None:
    """Why an entry is not a file the store may use (``None`` when it is)."""
    if not stat.S_ISREG(st.st_mode):
        return f"{kind(st.st_mode)}, not a regular file"
    if single_link and st.st_nlink != 1:
        return f"a regular file with {st.st_nlink} hard links, not 1 (another may be outside the directory)"
    return None


def describe_error(exc: OSError) -> str:
    """An ``OSError`` in one line, its errno's name included (``OSError: ENOSPC No space left on device``)."""
    return f"{type(exc).__name__}: {errno.errorcode.get(exc.errno or 0, '')} {exc.strerror or exc}".strip()


def damaged(label: str, what: str) -> DamagedEntryError:
    return DamagedEntryError(label, what)


def _describe_failed_open(dir_fd: int | None, name: str | Path, label: str, exc: OSError) -> OSError:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return exc
    what = problem(st, single_link=False)
    return damaged(label, what) if what is not None else exc


def open_file(
    dir_fd: int | None,
    name: str | Path,
    flags: int,
    label: str,
    *,
    single_link: bool = True,
    mode: int = FILE_MODE,
) -> tuple[int, os.stat_result]:
    """Open ``name`` in ``dir_fd`` (a path when ``None``) without following a link or blocking: a regular
    file (with one link when ``single_link``) or :class:`DamagedEntryError`. Returns the descriptor and its
    ``fstat`` (contract D24, D25).

    With ``O_CREAT`` and without ``O_EXCL``, a name another node creates at the same moment is opened, not
    refused: GlusterFS's FUSE client answers such a create that lost the race with ``EEXIST`` (its create
    must find no entry: ``tests/gluster/test_racing_creates.py``), and the next try finds the file
    (contract D27)."""
    for tries_left in range(OPEN_TRIES - 1, -1, -1):
        try:
            fd = os.open(name, flags | _NOFOLLOW, mode, dir_fd=dir_fd)
            break
        except FileExistsError:
            if flags & os.O_EXCL or not tries_left:
                raise
        except OSError as exc:
            if exc.errno in _NOT_A_FILE:
                raise _describe_failed_open(dir_fd, name, label, exc) from None
            raise
    try:
        st = os.fstat(fd)
        what = problem(st, single_link=single_link)
        if what is not None:
            raise damaged(label, what)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_append(dir_fd: int, name: str, label: str, mode: int = FILE_MODE) -> tuple[int, bool]:
    """Open a data file for appending; True when this call created it (its directory entry needs a sync).

    Read-write so that an append can look at the file's last byte. The file usually exists: that is tried
    first (one syscall); else it is created exclusively. A racing creator or remover sends us round again,
    at most :data:`OPEN_TRIES` times. A file that existed with a wider mode is narrowed to ``mode``.
    """
    for _ in range(OPEN_TRIES):
        try:
            fd, st = open_file(dir_fd, name, os.O_RDWR | os.O_APPEND, label)
            created = False
        except FileNotFoundError:
            try:
                fd, st = open_file(
                    dir_fd, name, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL, label, mode=mode
                )
            except FileExistsError:
                continue
            created = True
        try:
            if stat.S_IMODE(st.st_mode) & ~mode:
                os.fchmod(fd, mode)  # records are training data: 0644 becomes 0600 (contract D26)
        except BaseException:
            os.close(fd)
            raise
        return fd, created
    raise OSError(errno.EAGAIN, f"{label}: created and removed under us {OPEN_TRIES} times in a row")


def still_named(dir_fd: int, name: str, dev: int, ino: int) -> os.stat_result | None:
    """The ``lstat`` of ``name`` in ``dir_fd`` when it still leads to the file a kept descriptor holds (same
    device and inode, no link followed), else ``None``: how a descriptor kept between batches is checked
    before it is used again (the inode cannot be reused while the descriptor holds it)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st if st.st_ino == ino and st.st_dev == dev else None


SEEN_NAMES = 8192
"""Names of data files the writer closed that it remembers as existing (:class:`AppendFiles`)."""


def _create_locked(
    dir_fd: int,
    name: str,
    label: str,
    timeout: float,
    mode: int,
    before_wait: Callable[[], None] | None = None,
) -> tuple[int, os.stat_result] | None:
    """Create a data file that should not exist yet (a rollout's first append), then ``flock(LOCK_EX)`` it
    and ``fstat`` it once: its checks (contract D25) and the size the append starts at, after the lock (a
    process that opened the new name meanwhile may have appended). ``None`` when the name exists (a link
    too: ``O_EXCL`` never follows one): the caller opens it as usual (contract D24)."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode, dir_fd=dir_fd)
    except FileExistsError:
        return None
    try:
        flock_within(fd, fcntl.LOCK_EX, timeout, label, before_wait)
        st = os.fstat(fd)
        what = problem(st, single_link=True)
        if what is not None:
            raise damaged(label, what)  # a hard link made to it this instant
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def kept_limit() -> int:
    """How many descriptors each table the writer keeps open holds (its data files, :class:`AppendFiles`;
    its in-flight markers, ``InflightMarkers``): a quarter of the process's descriptor limit, between 64
    and 2,048 (1,024 rollouts with a tokens file each). The two together hold at most half; a node's other
    descriptors keep the other half."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - every Linux has it
        return 64
    if soft == resource.RLIM_INFINITY:
        return 2048
    return max(64, min(2048, soft // 4))


class AppendFiles:
    """The writer's data files, kept open from one batch to the next instead of opened, checked and closed
    per rollout per batch (an ``openat``, an ``fstat`` and a ``close`` each time).

    A kept descriptor is used again only if the name still leads to it *while its ``flock`` is held*
    (:meth:`open_locked`): one ``lstat`` of the name (relative to this batch's directory descriptor, no link
    followed) must find a regular file with one link, the same device and inode, and no mode wider than
    ``mode``. Anything else (a retire or delete renamed the file away, a link or another file planted in its
    place, a hard link made to it, the directory replaced) unlocks and closes it and opens the name afresh
    through :func:`open_append`, with every check of a first open. The inode cannot be reused while the
    descriptor holds it, so the same inode is the same file; checked under the lock, the ``lstat``'s size is
    the size the append starts at (no ``fstat`` of its own: one round trip fewer on a network filesystem).

    At most ``limit`` files stay open (:meth:`trim`, after a batch is synced: a file of the batch is never
    closed before its sync); :meth:`close_all` closes them when the writer goes idle or stops, so a retired
    rollout's file is not held open for long. Used by the writer thread and, on a network filesystem, by
    its pool at once, each name by one thread at a time (:mod:`.batch_io`): the table is guarded by a lock,
    never held across I/O.
    """

    def __init__(self, limit: int | None = None) -> None:
        self._limit = kept_limit() if limit is None else limit
        self._files: dict[str, tuple[int, int, int]] = {}  # name -> (fd, st_dev, st_ino), oldest use first
        self._ends: dict[int, int] = {}  # fd -> size after our last append (its last byte is our "\n")
        # names whose file existed when last opened here (most recent last): opened, not created, first
        self._seen: dict[str, None] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._files)

    def open_locked(
        self,
        dir_fd: int,
        name: str,
        label: str,
        timeout: float,
        mode: int = FILE_MODE,
        before_wait: Callable[[], None] | None = None,
    ) -> tuple[int, bool, int]:
        """The data file ``name``, open for appending and ``flock(LOCK_EX)``-ed (waited for ``timeout``
        seconds at most) (contract D8, D21): ``(fd, created, size)``. The descriptor stays owned by this
        object (never close it; :meth:`discard` it after a failure); the caller unlocks it.
        ``before_wait``: see :func:`flock_within`."""
        with self._lock:
            kept = self._files.pop(name, None)
        if kept is not None:
            fd, dev, ino = kept
            try:
                flock_within(fd, fcntl.LOCK_EX, timeout, label, before_wait)
            except BaseException:
                self._close(fd)  # fenced (EBADFD): the next batch opens the file afresh (contract D27)
                raise
            try:
                st = still_named(dir_fd, name, dev, ino)
            except OSError as exc:
                # A shared mount that took this node's lock away fails even the lstat (EBADFD) while the
                # descriptor stays open: close it, so that the next batch opens the file afresh.
                self._close(fd)
                raise fenced_error(exc, label) from None
            except BaseException:
                self._close(fd)
                raise
            if (
                st is not None
                and problem(st, single_link=True) is None
                and not stat.S_IMODE(st.st_mode) & ~mode
            ):
                with self._lock:
                    self._files[name] = kept  # most recently used last
                return fd, False, st.st_size
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            self._close(fd)
        # A name this table never had is most likely a new rollout's (single-turn RL: every call's):
        # created first, one open instead of two; a name it closed before is opened first.
        made = None if name in self._seen else _create_locked(dir_fd, name, label, timeout, mode, before_wait)
        if made is not None:
            (fd, st), created = made, True
        else:
            fd, created = open_append(dir_fd, name, label, mode)
            try:
                flock_within(fd, fcntl.LOCK_EX, timeout, label, before_wait)
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
        with self._lock:
            self._files[name] = (fd, st.st_dev, st.st_ino)
            self._seen.pop(name, None)
        return fd, created, st.st_size

    def clean_end(self, fd: int) -> int:
        """The size the file had after our last append to it through ``fd`` (-1 when unknown)."""
        return self._ends.get(fd, -1)

    def appended(self, fd: int, end: int) -> None:
        self._ends[fd] = end

    def discard(self, fd: int) -> None:
        """Close a descriptor after a failure on it (it is opened afresh next time)."""
        with self._lock:
            found = next((name for name, kept in self._files.items() if kept[0] == fd), None)
            if found is None:
                return
            del self._files[found]
            self._saw(found)
        self._close(fd)

    def trim(self) -> None:
        """Close the least recently used files beyond the limit (after a batch's sync)."""
        while len(self._files) > self._limit:
            with self._lock:
                name = next(iter(self._files))
                fd = self._files.pop(name)[0]
                self._saw(name)
            self._close(fd)

    def close_all(self) -> None:
        with self._lock:
            files, self._files = self._files, {}
            for name in files:
                self._saw(name)
        for fd, _, _ in files.values():
            self._close(fd)

    def _saw(self, name: str) -> None:
        """Remember a closed file's name (the table's lock held): its next open tries the name first."""
        self._seen[name] = None
        if len(self._seen) > SEEN_NAMES:
            del self._seen[next(iter(self._seen))]

    def _close(self, fd: int) -> None:
        self._ends.pop(fd, None)
        try:
            os.close(fd)
        except OSError as exc:  # nothing was written through it since its last sync
            _logger.warning("closing a capture file failed: %s", exc)


def try_flock(fd: int, operation: int, label: str) -> bool:
    """``flock(fd, operation | LOCK_NB)``: False when another holds the lock; an error of a fenced node
    as :func:`fenced_error` says it (contract D27)."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        raise fenced_error(exc, label) from None
    return True


def flock_within(
    fd: int, operation: int, timeout: float, label: str, before_wait: Callable[[], None] | None = None
) -> None:
    """``flock(fd, operation)``, waiting at most ``timeout`` seconds: tried with ``LOCK_NB``, then again
    after a sleep that doubles from 1 ms to 50 ms. A blocking ``flock`` would wait as long as its holder
    likes, and the holder may be any process of the same user (NeMo Gym's writers lock the data files
    too). Raises :class:`LockTimeoutError` naming ``label`` when the lock is still held at the deadline
    (contract D21). ``before_wait``: called once when the lock is not had at once, before any wait."""
    if try_flock(fd, operation, label):
        return
    if before_wait is not None:
        before_wait()
    deadline = time.monotonic() + timeout
    pause = 0.001
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(pause, left))
        pause = min(2 * pause, LOCK_POLL_MAX_S)
        if try_flock(fd, operation, label):
            return
    raise LockTimeoutError(label, timeout)


def fenced_error(exc: OSError, label: str) -> OSError:
    """``exc`` itself, or, for an error of :data:`FENCED_ERRNOS`, the same errno with a reason that says
    what it means: the shared filesystem took this node's lock away (fenced), nothing more is written
    (contract D27)."""
    if exc.errno not in FENCED_ERRNOS:
        return exc
    return OSError(
        exc.errno,
        f"{label}: fenced by the shared filesystem ({errno.errorcode.get(exc.errno or 0, exc.errno)}: "
        f"{exc.strerror}): this node lost its lock, another may hold it; nothing more is written without it",
    )


def read_locked(
    dir_fd: int,
    name: str,
    label: str,
    fsync: Fsync | None = None,
    timeout: float = DEFAULT_LOCK_TIMEOUT_S,
) -> bytes | None:
    """A file's bytes, read whole under ``flock(LOCK_SH)`` (the lock NeMo Gym's readers take: appenders hold
    ``LOCK_EX`` for a whole line); ``None`` when absent. ``fsync`` (the freeze) makes what was read durable.
    A lock held longer than ``timeout`` raises :class:`LockTimeoutError`."""
    try:
        fd, _ = open_file(dir_fd, name, os.O_RDONLY, label, single_link=False)
    except FileNotFoundError:
        return None
    try:
        return read_shared(fd, label, timeout, fsync)
    finally:
        os.close(fd)


def read_shared(fd: int, label: str, timeout: float, fsync: Fsync | None = None) -> bytes:
    """An open file's bytes, read whole under ``flock(LOCK_SH)``: every read of a rollout's file, the
    readers' and the freeze's, goes through here (contract D8). ``fsync``: make what was read durable."""
    flock_within(fd, fcntl.LOCK_SH, timeout, label)
    try:
        data = read_all(fd)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    if fsync is not None:
        fsync(fd)
    return data


def read_all(fd: int) -> bytes:
    """The rest of the file, in one buffer sized from ``fstat`` (no second copy of a large file)."""
    with io.FileIO(fd, "rb", closefd=False) as handle:
        return handle.readall()


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def replace_file(dir_fd: int, name: str, data: bytes, mode: int = FILE_MODE) -> None:
    """Replace ``name`` in ``dir_fd`` whole: ``data`` goes to ``<name>.tmp`` (whatever stood there, a link
    included, is unlinked first, never followed or truncated through), which is then renamed over ``name``
    (a rename replaces a planted link, never writes through it). Not synced: for hints, not records."""
    tmp = name + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd, _ = open_file(dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, tmp, mode=mode)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # atomic: the old content or the new


def make_root(root: Path, fsync: Fsync, mode: int = DIR_MODE) -> None:
    """Create the capture directory (``0700``: records are training data) and sync its parent, so the
    directory survives a crash; nothing when it exists."""
    if root.is_dir():
        return
    root.mkdir(mode=mode, parents=True, exist_ok=True)
    fsync_dir(root.parent, fsync)  # the new directory survives a crash (contract D10)


def check_directory(root: Path, *, allow_shared: bool) -> bool:
    """Refuse a capture directory that other users can write: they could plant the links, FIFOs and hard
    links the store refuses, and make every capture fail. A missing directory passes (it is created 0700).

    True when ``root`` was checked and is an existing directory (the caller need not ``stat`` it again to
    create it). (contract D26)"""
    if allow_shared:
        return False
    return checked_root(root, allow_shared=False) is not None


def checked_root(root: Path, *, allow_shared: bool) -> os.stat_result | None:
    """The capture directory's ``stat`` (its path followed), after :func:`check_directory`'s refusal unless
    ``allow_shared``; ``None`` when it is missing or not a directory. One ``stat`` for the writer's batch:
    the check, and the identity its kept descriptors are compared with (:meth:`DirFds.revalidate`)."""
    try:
        st = os.stat(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    if not allow_shared:
        _refuse_unsafe(root, st)
    return st


def _refuse_unsafe(root: Path, st: os.stat_result) -> None:
    reasons = []
    if st.st_mode & stat.S_IWOTH:
        reasons.append(f"world-writable (mode {stat.S_IMODE(st.st_mode):04o})")
    if st.st_uid != os.geteuid():
        reasons.append(f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if reasons:
        raise UnsafeDirectoryError(
            f"refusing capture directory {root}: it is {' and '.join(reasons)}, so another user could plant "
            "links or files in it; use a directory only you can write, or opt in with "
            "allow_shared_directory=True (OTEL_CAPTURE_ALLOW_SHARED_DIR=1)"
        )


class DirFds:
    """Directory descriptors for one operation: the capture directory, then ``.otel-capture`` and its
    subdirectories, each opened relative to its parent without following a link (a link there is a
    :class:`DamagedEntryError`). With ``create``, missing ones are made ``0700`` and their parent synced.

    Opened lazily, closed together (a context manager). Held for one operation, or (``keep``, the writer's)
    from one batch to the next, each then checked by :meth:`revalidate` before it serves again: a
    directory removed and recreated under a running process is simply opened afresh.
    """

    def __init__(
        self,
        root: Path,
        fsync: Fsync = os.fsync,
        *,
        create: bool = True,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
        keep: bool = False,
    ) -> None:
        self.root = root
        self.lock_timeout = lock_timeout
        self._keep = keep
        self._ids: dict[str, tuple[int, int]] = {}  # label -> (st_dev, st_ino) at open (``keep`` only)
        """The longest wait for any file lock of this operation (:func:`flock_within`)."""
        self._fsync = fsync
        self._create = create
        self._fds: dict[str, int] = {}
        self._opening = threading.RLock()  # a batch's pool opens them lazily from several threads

    def __enter__(self) -> DirFds:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        self._ids = {}
        for fd in fds.values():
            os.close(fd)

    def is_open(self) -> bool:
        return bool(self._fds)

    def identity(self) -> tuple[int, int]:
        """The capture directory's ``(st_dev, st_ino)`` as opened (``keep`` only: no ``fstat`` again)."""
        self.root_fd()
        return self._ids[""]

    def revalidate(self, root_st: os.stat_result) -> None:
        """Before kept descriptors serve another batch (contract D18, D24): the capture directory's path
        must still lead to the kept directory (``root_st``: the batch's ``stat`` of it), and each kept
        subdirectory's name, ``lstat``-ed relative to its kept parent (no link followed), to the same
        directory; whatever does not is closed, with everything below it, and opened afresh when next
        needed. One ``lstat`` per kept subdirectory."""
        with self._opening:
            if "" not in self._fds:
                return
            if self._ids.get("") != (root_st.st_dev, root_st.st_ino):
                self.close()
                return
            if STATE_DIR in self._fds and not self._still(self._fds[""], STATE_DIR, STATE_DIR):
                self._forget(lambda label: label == STATE_DIR or label.startswith(STATE_DIR + "/"))
                return
            for label in [label for label in self._fds if label.startswith(STATE_DIR + "/")]:
                if not self._still(self._fds[STATE_DIR], label.split("/", 1)[1], label):
                    self._ids.pop(label, None)
                    os.close(self._fds.pop(label))

    def _still(self, parent: int, name: str, label: str) -> bool:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == self._ids.get(label)

    def _forget(self, which: Callable[[str], bool]) -> None:
        for label in [label for label in self._fds if which(label)]:
            self._ids.pop(label, None)
            os.close(self._fds.pop(label))

    def _opened(self, label: str, fd: int) -> int:
        if self._keep:
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            self._ids[label] = (st.st_dev, st.st_ino)
        self._fds[label] = fd
        return fd

    def root_fd(self) -> int:
        fd = self._fds.get("")
        if fd is not None:
            return fd
        with self._opening:
            return self._open_root()

    def _open_root(self) -> int:
        fd = self._fds.get("")
        if fd is None:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
            try:
                fd = os.open(self.root, flags)  # no stat first: the directory is there nearly always
            except FileNotFoundError:
                if not self._create:
                    raise
                make_root(self.root, self._fsync)
                fd = os.open(self.root, flags)
            self._opened("", fd)
        return fd

    def state_fd(self, sub: str | None = None) -> int:
        """``.otel-capture`` (``sub`` None) or ``.otel-capture/<sub>``."""
        label = STATE_DIR if sub is None else f"{STATE_DIR}/{sub}"
        fd = self._fds.get(label)
        if fd is not None:
            return fd
        with self._opening:
            fd = self._fds.get(label)
            if fd is None:
                parent = self.root_fd() if sub is None else self.state_fd()
                fd = self._opened(label, self._subdir(parent, STATE_DIR if sub is None else sub, label))
            return fd

    def _subdir(self, parent: int, name: str, label: str) -> int:
        for _ in range(OPEN_TRIES):
            try:
                return os.open(name, _SUBDIR, dir_fd=parent)
            except FileNotFoundError:
                if not self._create:
                    raise
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                    raise DamagedEntryError(label, f"{kind(st.st_mode)}, not a directory") from None
                raise
            try:
                os.mkdir(name, DIR_MODE, dir_fd=parent)
                self._fsync(parent)  # the new directory's entry survives a crash (contract D10)
            except FileExistsError:
                pass
        raise OSError(errno.EAGAIN, f"{label}: created and removed under us {OPEN_TRIES} times in a row")
