"""One process's lifecycle state for one capture directory: everything lives in ``<dir>/.otel-capture/``,
which NeMo Gym never looks at.

* ``locks/NN.lock``: striped rollout locks (:mod:`.locks`);
* ``journal.lock`` and ``fences.journal``: the fence journal (:mod:`.journal`);
* ``inflight/<id>.calls``: calls in flight, for freezes in other processes (:mod:`.inflight`);
* ``trash/``: record files that a retire or delete took out of the directory (a ``rename``, as atomic as
  an ``unlink`` and much cheaper than freeing a synced file's blocks); a background task unlinks them.

Every path is opened through :class:`.fs.DirFds` (no link followed). ``docs/lifecycle.md`` has the protocol.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from .._settings import DEFAULT_LOCK_TIMEOUT_S
from .fs import STATE_DIR, DirFds, Fsync
from .inflight import InflightCalls, InflightMarkers
from .journal import FenceJournal
from .locks import StripedLocks

_logger = logging.getLogger(__name__)

__all__ = ["STATE_DIR", "DirState", "dir_state"]


class DirState:
    """The locks, the journal's view and the calls in flight of one directory, shared by every store and
    writer of this process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / STATE_DIR
        self.locks = StripedLocks()
        self.journal = FenceJournal(self.state_dir)
        self.calls = InflightCalls()
        self.markers = InflightMarkers()
        self.fsync: Fsync = os.fsync  # syncs the parent of a state directory created on first use

    def dirs(self, *, create: bool = True, lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S) -> DirFds:
        """Directory descriptors for one operation (``create``: make what is missing, 0700; every file
        lock it takes is waited for ``lock_timeout`` seconds at most)."""
        return DirFds(self.root, self.fsync, create=create, lock_timeout=lock_timeout)


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
