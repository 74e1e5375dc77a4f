"""One process's lifecycle state for one capture directory, shared by every store and writer of the
process: the stripe locks, the fence journal's view, the calls in flight, the declared weight versions.
It all lives in ``<dir>/.otel-capture/`` (the entries are named in :mod:`.names`), which NeMo Gym never
looks at, and all of it but the in-flight markers and the loss reserves is made whole ahead of need
(:meth:`DirState.prepare`) (contract L15), so a filesystem out of inodes cannot stop a freeze, a read or
a mark. Every path is opened through :class:`.fs.DirFds` (no link followed) (contract D24).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from .._settings import DEFAULT_LOCK_TIMEOUT_S
from .fs import DirFds
from .inflight import InflightCalls, InflightMarkers
from .journal import FenceJournal
from .locks import StripedLocks
from .names import STATE_DIR, STATE_SUBDIRS
from .sync import Fsync
from .weight import DeclaredVersions

_logger = logging.getLogger(__name__)

__all__ = ["STATE_DIR", "DirState", "dir_state"]


class DirState:
    """The locks, the journal's view, the declared weight versions and the calls in flight of one directory, shared by every store and
    writer of this process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / STATE_DIR
        self.locks = StripedLocks()
        self.journal = FenceJournal(self.state_dir)
        self.calls = InflightCalls()
        self.markers = InflightMarkers()
        self.weights = DeclaredVersions(root)  # the declared weight versions, refreshed once per batch
        self.fsync: Fsync = os.fsync  # syncs the parent of a state directory created on first use
        self.shared_allowed = False  # a writer of this process was told to use the directory, shared or not
        self._prepared: tuple[int, int] | None = None  # the capture directory (dev, ino) made whole
        self._prepare_lock = threading.Lock()

    def dirs(
        self, *, create: bool = True, lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S, keep: bool = False
    ) -> DirFds:
        """Directory descriptors for one operation (``create``: make what is missing, 0700; every file
        lock it takes is waited for ``lock_timeout`` seconds at most; ``keep``: the writer's, kept from
        one batch to the next, see :meth:`.fs.DirFds.revalidate`)."""
        return DirFds(self.root, self.fsync, create=create, lock_timeout=lock_timeout, keep=keep)

    def prepare(self, dirs: DirFds) -> bool:
        """Make the state directory whole (contract L15), once per capture directory (again when it was
        removed and made anew): its subdirectories, the 64 stripe lock files, the journal's lock and the journal itself.
        What an operation would otherwise create on first use is created now, while there are inodes
        (``docs/durability.md``, "When files cannot be created"). Best effort: an entry that cannot be
        made (no space, a planted link) is left to the operation that needs it, which reports it. True
        when everything is in place."""
        st = os.fstat(dirs.root_fd())
        key = (st.st_dev, st.st_ino)
        if self._prepared == key:
            return True
        with self._prepare_lock:
            if self._prepared == key:
                return True
            complete = True
            for sub in STATE_SUBDIRS:
                try:
                    dirs.state_fd(sub)
                except OSError as exc:
                    _logger.debug("could not prepare %s/%s: %s", STATE_DIR, sub, exc)
                    complete = False
            try:
                self.locks.create_all(dirs)
                self.journal.append(dirs, (), self.fsync)  # creates it, with its base line, if missing
            except OSError as exc:
                _logger.debug("could not prepare the lock files or the journal of %s: %s", self.root, exc)
                complete = False
            if complete:
                self._prepared = key
            return complete


_states: dict[str, DirState] = {}
_states_lock = threading.Lock()


def dir_state(root: str | os.PathLike[str]) -> DirState:
    """The process-wide :class:`DirState` of a directory (one per real path)."""
    key = os.path.realpath(root)
    with _states_lock:
        state = _states.get(key)
        if state is None:
            state = _states[key] = DirState(Path(root))
        return state
