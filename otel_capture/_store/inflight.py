"""Calls in flight: begun, not yet recorded. Two views of one thing (contract D19, L10).

* :class:`InflightCalls`: this process's calls, in memory, with the epoch each was admitted at.
* :class:`InflightMarkers`: every process's calls, in ``.otel-capture/inflight/<id>.calls``: ``+<call>``
  when a call begins, ``-<call>`` when it is recorded or marked incomplete, written under the rollout's
  stripe without ``fsync`` (a marker matters while its process lives). An empty file, or one whose every
  ``+`` has its ``-``, has no call in flight. The writer keeps a rollout's file (and its descriptor) while
  the rollout is active (emptied once it has reached :data:`EMPTY_AT` bytes with no call in flight), and
  removes it when it closes the rollout
  (idle, or beyond its limit); a retire or delete removes it too. Elsewhere a file whose calls have all
  ended is removed at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .._records.codec import split_lines
from .._rollout_id import is_valid_rollout_id
from .fs import DirFds, kept_limit, open_file, problem, read_all, still_named, write_all
from .names import INFLIGHT_DIR, INFLIGHT_SUFFIX, STATE_DIR, state_label

INFLIGHT_REASON = "in flight when frozen: the call began and was never recorded"
"""The reason a snapshot gives a call that was in flight when the rollout was frozen."""

_logger = logging.getLogger(__name__)


class InflightCalls:
    """Calls begun in this process and not yet recorded: ``{rollout_id: {model_call_id: epoch}}``.

    ``epoch`` is the rollout's last journal seq when the writer thread admitted the call (``None`` until
    then); a line whose rollout has a newer event was admitted before a freeze, retire or delete, and is late.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, dict[str, int | None]] = {}

    def begin(self, rollout_id: str, model_call_id: str, epoch: int | None = None) -> None:
        with self._lock:
            self._calls.setdefault(rollout_id, {})[model_call_id] = epoch

    def admit(self, rollout_id: str, model_call_id: str, epoch: int) -> None:
        with self._lock:
            calls = self._calls.get(rollout_id)
            if calls is not None and model_call_id in calls and calls[model_call_id] is None:
                calls[model_call_id] = epoch

    def has(self, rollout_id: str, model_call_id: str) -> bool:
        with self._lock:
            return model_call_id in self._calls.get(rollout_id, ())

    def epoch(self, rollout_id: str, model_call_id: str) -> int | None:
        with self._lock:
            return self._calls.get(rollout_id, {}).get(model_call_id)

    def end(self, rollout_id: str, model_call_ids: Iterable[str]) -> None:
        with self._lock:
            calls = self._calls.get(rollout_id)
            if calls is None:
                return
            for mcid in model_call_ids:
                calls.pop(mcid, None)
            if not calls:
                del self._calls[rollout_id]

    def pending(self, rollout_id: str) -> dict[str, int | None]:
        with self._lock:
            return dict(self._calls.get(rollout_id, {}))

    def rollouts(self) -> list[str]:
        with self._lock:
            return list(self._calls)


def marker_label(rollout_id: str) -> str:
    return state_label(INFLIGHT_DIR, rollout_id + INFLIGHT_SUFFIX)


def _apply(data: bytes, begun: set[str]) -> set[str]:
    lines, tail = split_lines(data)
    for line in (*lines, tail):  # a torn last entry counts, as it always has
        if line[:1] == b"+":
            begun.add(line[1:].decode("utf-8", "replace"))
        elif line[:1] == b"-":
            begun.discard(line[1:].decode("utf-8", "replace"))
    return begun


@dataclass(slots=True)
class _Left:
    """A marker file as this process last left it: which file (device, inode), its size and change times
    right after our write, and the calls its lines leave in flight."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    calls: set[str]

    def same(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (
            self.dev,
            self.ino,
            self.size,
            self.mtime_ns,
            self.ctime_ns,
        )


EMPTY_AT = 4096
"""Bytes past which the writer empties a kept marker whose calls have all ended (:meth:`InflightMarkers.write_to`)."""


class InflightMarkers:
    """The marker files (contract D19, L10). Writers hold the rollout's stripe; readers (a freeze,
    ``list_rollouts``) need not.

    What this process wrote last to each marker is remembered (:class:`_Left`, at most
    :data:`REMEMBERED` rollouts): a marker whose ``lstat`` finds it exactly as we left it (same inode,
    size, modification and change time: nobody wrote since, and every writer holds the stripe we hold)
    holds the calls we know, so a call's ``-`` that ends its last call removes it without opening or
    reading it back (:meth:`ends_all`). Anything else is read whole, as before.

    The writer thread keeps each active rollout's marker and its descriptor between batches (:meth:`take`,
    :meth:`keep`; at most :attr:`limit`): a kept marker is used again only if its name still leads to it
    (one ``lstat``, under the stripe), and a marker whose calls have all ended is kept, not removed (emptied
    once it has grown to :data:`EMPTY_AT`), so that a rollout making one call at a time pays one append per
    ``+`` and per ``-`` instead of a create and an unlink per call. The writer removes it when it closes the rollout (:meth:`close_kept`)."""

    REMEMBERED = 4096

    def __init__(self, limit: int | None = None) -> None:
        self._left: dict[str, _Left] = {}
        self._opened: dict[int, os.stat_result] = {}  # fd -> its fstat at open, until written through
        self._evicting = threading.Lock()  # guards _left and _kept; never held across I/O
        self._kept: dict[str, tuple[int, int, int]] = {}  # rollout -> (fd, st_dev, st_ino), oldest use first
        self.limit = kept_limit() if limit is None else limit
        """How many markers the writer keeps (each with a descriptor) between its idle closes."""

    def open(self, dirs: DirFds, rollout_id: str, *, create: bool) -> int | None:
        """The rollout's marker, opened to append (``None`` when absent and not ``create``). A marker that
        is a link, a FIFO or a hard link is a ``DamagedEntryError``: never written through."""
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)
        try:
            fd, st = open_file(
                dirs.state_fd(INFLIGHT_DIR), rollout_id + INFLIGHT_SUFFIX, flags, marker_label(rollout_id)
            )
        except FileNotFoundError:
            if create:
                raise
            return None
        self._opened[fd] = st  # a descriptor number reused later overwrites it
        return fd

    def ends_all(self, dirs: DirFds, rollout_id: str, ended: list[str]) -> bool:
        """Whether ending ``ended`` leaves the rollout's marker with no call in flight, known without
        reading it: the marker is as this process left it (one ``lstat``) and ``ended`` covers its calls.
        The caller then removes it with :meth:`remove` once its lines are written. False: open it."""
        left = self._left.get(rollout_id)
        if left is None or not left.calls <= set(ended):
            return False
        try:
            st = os.stat(
                rollout_id + INFLIGHT_SUFFIX, dir_fd=dirs.state_fd(INFLIGHT_DIR), follow_symlinks=False
            )
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and left.same(st)

    def remove(self, dirs: DirFds, rollout_id: str) -> None:
        """Remove a marker whose calls have all ended (under the stripe, nobody else has it open)."""
        self._left.pop(rollout_id, None)
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile (a retire): what we wanted
            os.unlink(rollout_id + INFLIGHT_SUFFIX, dir_fd=dirs.state_fd(INFLIGHT_DIR))

    def write_to(
        self,
        dirs: DirFds,
        fd: int,
        rollout_id: str,
        begun: list[str],
        ended: list[str],
        *,
        keep: bool = False,
    ) -> None:
        """Append ``+`` lines for ``begun`` and ``-`` lines for ``ended``; when that would leave no call in
        flight the file is removed instead (under the stripe, nobody else has it open), or, when ``keep``
        (the writer's kept marker), kept: the ``-`` lines are appended, and a marker that would reach
        :data:`EMPTY_AT` bytes is emptied instead (one ``ftruncate`` in place of the ``-`` lines), so that
        one kept for a long rollout never outgrows that plus the calls in flight. Why not empty it each
        time: truncating a file whose blocks a sync has written waits for the filesystem's journal (on
        ext4 0.3 to 0.6 ms and a wake-up each, against 5 us for the append)."""
        st = self._opened.pop(fd, None) or os.fstat(fd)
        left = self._left.get(rollout_id)
        if left is not None and left.same(st):
            calls = set(left.calls)
        elif st.st_size == 0:  # seen under the stripe every marker writer holds: nothing to read back
            calls = set()
        else:
            calls = _apply(read_all_from(fd), set())
        calls = (calls | set(begun)) - set(ended)
        if ended and not calls and not keep:
            self.remove(dirs, rollout_id)
            return
        # "@<call> <time>" says when the "+" was written (readers that know only "+" and "-" skip it)
        now = b" %.3f\n" % time.time() if begun else b""
        data = b"".join(b"+" + m.encode() + b"\n@" + m.encode() + now for m in begun) + b"".join(
            b"-" + m.encode() + b"\n" for m in ended
        )
        if ended and not calls and st.st_size + len(data) >= EMPTY_AT:
            self._left.pop(rollout_id, None)  # unknown until emptied
            os.ftruncate(fd, 0)  # no call in flight: nothing left to say (contract D19)
        else:
            if data:
                self._left.pop(rollout_id, None)  # unknown until written
                write_all(fd, data)
        after = os.fstat(fd)
        left = _Left(after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns, calls)
        with self._evicting:  # the writer's pool writes several rollouts' markers at once
            if len(self._left) >= self.REMEMBERED:
                self._left.pop(next(iter(self._left)), None)
            self._left[rollout_id] = left

    def take(self, dirs: DirFds, rollout_id: str, *, create: bool) -> int | None:
        """The writer's marker for ``rollout_id`` (its stripe held): the descriptor kept from an earlier
        batch when the name still leads to that file (one ``lstat``: a retire, a delete or another process
        that emptied and removed it sends us to open it afresh), else :meth:`open`. Give it back with
        :meth:`keep` after writing through it, or close it."""
        with self._evicting:
            kept = self._kept.pop(rollout_id, None)
        if kept is not None:
            fd, dev, ino = kept
            try:
                st = still_named(dirs.state_fd(INFLIGHT_DIR), rollout_id + INFLIGHT_SUFFIX, dev, ino)
            except BaseException:
                os.close(fd)
                raise
            if st is not None and problem(st, single_link=True) is None:
                self._opened[fd] = st  # as good as an fstat: the same file, under the stripe
                return fd
            self._opened.pop(fd, None)
            os.close(fd)
        return self.open(dirs, rollout_id, create=create)

    def keep(self, rollout_id: str, fd: int) -> None:
        """Keep a marker's descriptor, written through by :meth:`write_to`, for the rollout's next batch."""
        left = self._left.get(rollout_id)
        if left is None:  # what the write left is unknown: nothing to check a kept descriptor against
            os.close(fd)
            return
        with self._evicting:
            old = self._kept.pop(rollout_id, None)
            self._kept[rollout_id] = (fd, left.dev, left.ino)  # most recently used last
        if old is not None and old[0] != fd:
            os.close(old[0])

    def kept_count(self) -> int:
        return len(self._kept)

    def kept(self) -> list[str]:
        """The rollouts whose marker the writer keeps, least recently used first."""
        with self._evicting:
            return list(self._kept)

    def close_kept(self, dirs: DirFds | None, rollout_id: str) -> None:
        """Close a kept marker (its stripe held): removed when it is still the file we keep and has no call
        in flight; a marker with calls in flight stays for their ``-``. Without ``dirs`` (the directory
        cannot be had) the descriptor is only closed."""
        with self._evicting:
            kept = self._kept.pop(rollout_id, None)
        if kept is None:
            return
        fd, dev, ino = kept
        self._opened.pop(fd, None)
        try:
            if dirs is None:
                return
            st = still_named(dirs.state_fd(INFLIGHT_DIR), rollout_id + INFLIGHT_SUFFIX, dev, ino)
            if st is None or problem(st, single_link=True) is not None:
                return  # not ours any more (removed, or replaced by another process's): left alone
            left = self._left.get(rollout_id)
            if left is not None and left.same(st):
                calls = left.calls
            else:
                calls = _apply(read_all_from(fd), set()) if st.st_size else set()
            if not calls:
                self.remove(dirs, rollout_id)
        finally:
            os.close(fd)

    def write(self, dirs: DirFds, rollout_id: str, begun: list[str], ended: list[str]) -> None:
        if not begun and not ended:
            return
        fd = self.open(dirs, rollout_id, create=bool(begun))
        if fd is None:
            return  # only ends, and no marker: those calls were never marked as begun
        try:
            self.write_to(dirs, fd, rollout_id, begun, ended)
        finally:
            os.close(fd)

    @staticmethod
    def pending(root: Path, rollout_id: str) -> set[str]:
        """Calls whose ``+`` has no ``-`` (begun in any process, never recorded). A damaged marker raises
        ``DamagedEntryError``; it is never followed or waited on."""
        path = root / STATE_DIR / INFLIGHT_DIR / (rollout_id + INFLIGHT_SUFFIX)
        try:
            fd, _ = open_file(None, path, os.O_RDONLY, marker_label(rollout_id), single_link=False)
        except FileNotFoundError:
            return set()
        try:
            return _apply(read_all(fd), set())
        finally:
            os.close(fd)

    @staticmethod
    def since(root: Path, rollout_id: str) -> dict[str, float]:
        """When each call still in flight had its ``+`` marker written (its ``@`` line, UTC Unix seconds; a
        call whose ``-`` follows is not named): the call began
        at most the writer's marker delay (and one batch) before. A damaged marker raises
        ``DamagedEntryError``."""
        path = root / STATE_DIR / INFLIGHT_DIR / (rollout_id + INFLIGHT_SUFFIX)
        try:
            fd, _ = open_file(None, path, os.O_RDONLY, marker_label(rollout_id), single_link=False)
        except FileNotFoundError:
            return {}
        try:
            lines, _ = split_lines(read_all(fd))
        finally:
            os.close(fd)
        found: dict[str, float] = {}
        for line in lines:
            if line[:1] == b"@":
                mcid, _, at = line[1:].decode("utf-8", "replace").partition(" ")
                with contextlib.suppress(ValueError):
                    found.setdefault(mcid, float(at))
            elif line[:1] == b"-":  # ended: a kept marker keeps its "-" lines until it is emptied
                found.pop(line[1:].decode("utf-8", "replace"), None)
        return found

    @staticmethod
    def rollouts(dirs: DirFds) -> list[str]:
        """Rollouts with a marker file (``dirs`` made with ``create=False``). A file may name no call in
        flight (empty, or every ``+`` with its ``-``: a writer keeps it while the rollout is active, or died
        keeping it): the caller asks :meth:`pending` of each, as ``list_rollouts`` does (contract D19)."""
        try:
            names = os.listdir(dirs.state_fd(INFLIGHT_DIR))
        except FileNotFoundError:
            return []
        found = [name[: -len(INFLIGHT_SUFFIX)] for name in names if name.endswith(INFLIGHT_SUFFIX)]
        bad = [rid for rid in found if not is_valid_rollout_id(rid)]
        if bad:  # never a rollout: no file is opened for it (contract D41)
            _logger.debug("in-flight markers naming invalid rollout ids are skipped: %s", bad[:8])
        return [rid for rid in found if is_valid_rollout_id(rid)]


def read_all_from(fd: int) -> bytes:
    """The whole file behind an ``O_APPEND`` descriptor, from its start."""
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
