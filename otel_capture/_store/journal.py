"""The fence journal: ``.otel-capture/fences.journal``, and this process's view of it
(contract L11, L12, L13).

Append-only, one JSON line per lifecycle event (``freeze``, ``retire``, ``delete``), each with a
journal-wide ``seq``; a rollout's state is its last event. One append + one ``fsync`` makes a whole batch
of fences durable; ``journal.lock`` serialises appends and compaction. Readers keep a view in memory and
refresh it with one ``lstat`` (same size, inode and change time: nothing to read; larger: read the new
tail; a new inode, a compaction: reload). A delete line is kept :data:`DELETE_RETENTION_S` (contract L12).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from .._errors import CaptureFrozenError, CaptureRetiredError, LockTimeoutError
from .._rollout_id import is_valid_rollout_id
from .fs import FILE_MODE, DirFds, damaged, flock_within, open_file, problem, write_all
from .names import JOURNAL, JOURNAL_LOCK, state_label
from .sync import Fsync

_logger = logging.getLogger(__name__)

COMPACT_MIN_LINES = 4096
CHUNK_BYTES = 1 << 20  # lines are encoded and written (and read back) a chunk at a time, whatever the batch
# How long a compaction keeps a delete line: longer than any call can stay in flight (a call admitted before
# a delete and written after the delete's line is gone would land in the reused id).
DELETE_RETENTION_S = 24 * 3600.0

FenceKind = Literal["frozen", "retired"]
Hook = Callable[[str], None]

_LABEL = state_label(JOURNAL)
_ID_IN_LINE = re.compile(rb'"id":"([A-Za-z0-9][A-Za-z0-9._-]{0,199})"')


def no_hook(point: str) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Fence:
    """A rollout's last journal event, when it is a fence (``freeze`` or ``retire``)."""

    kind: FenceKind
    seq: int
    snapshot_id: str | None = None
    version: int | None = None
    inflight: tuple[str, ...] = ()


class FenceJournal:
    """The fence journal of one capture directory and this process's view of it."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / JOURNAL
        self._thread_lock = threading.Lock()
        self._view_lock = threading.RLock()
        self._reset_view()

    # -- the view ------------------------------------------------------------------------------------

    def _reset_view(self) -> None:
        self._ino: int | None = None
        self._ctime_ns = 0
        self._offset = 0
        self._header = b""
        self._lines = 0
        self.max_seq = 0
        self._fences: dict[str, Fence] = {}  # in seq order: compaction writes them as they are
        # Rollouts whose last event is a delete: (seq, wall-clock time), in the order they were deleted.
        self._deleted: dict[str, tuple[int, float]] = {}
        self._corrupt: dict[str, str] = {}
        self._raw_corrupt: list[bytes] = []

    def refresh(self, state_fd: int | None = None) -> None:
        """Bring the view up to date: one ``lstat`` when nothing changed; what another process appended is
        seen here (contract L11). A journal that is not a regular file of its own (a link, a FIFO, a hard
        link) is a ``DamagedEntryError``, never read. ``state_fd``: the ``.otel-capture`` directory, already
        open (the writer's batch): the name is looked up there, one lookup instead of one per component of
        the path (each a round trip on a network filesystem)."""
        where, name = (None, self.path) if state_fd is None else (state_fd, JOURNAL)
        with self._view_lock:
            try:
                st = os.stat(name, dir_fd=where, follow_symlinks=False)
            except FileNotFoundError:
                if self._ino is not None:
                    self._reset_view()
                return
            what = problem(st, single_link=True)
            if what is not None:
                raise damaged(_LABEL, what)
            # Why the change time too: a compaction elsewhere (another process, another node) can leave a
            # journal whose inode number was reused and whose size happens to equal our offset; its
            # ctime is still new. On a shared mount this lstat is fresh only with the attribute caches
            # off (docs/scaling.md gives the mount options).
            if st.st_ino == self._ino and st.st_size == self._offset and st.st_ctime_ns == self._ctime_ns:
                return
            fd, st = open_file(where, name, os.O_RDONLY, _LABEL)
            try:
                same = st.st_ino == self._ino and st.st_size >= self._offset
                if same and self._header and os.pread(fd, len(self._header), 0) != self._header:
                    same = False  # a compacted journal that reused the inode number
                if not same:
                    self._reset_view()
                    self._ino = st.st_ino
                self._ctime_ns = st.st_ctime_ns
                self._read_from(fd)
            finally:
                os.close(fd)

    def _read_from(self, fd: int) -> None:
        """Apply every complete line after the view's offset, a chunk at a time (a line still being
        written is read next time)."""
        carry = b""
        while chunk := os.pread(fd, CHUNK_BYTES, self._offset + len(carry)):
            data = carry + chunk if carry else chunk
            start = 0
            while (end := data.find(b"\n", start)) != -1:
                self._apply(data[start:end])
                start = end + 1
            self._offset += start
            carry = data[start:]

    def _apply(self, line: bytes) -> None:
        self._lines += 1
        if not self._header:
            self._header = line + b"\n"
        if not line.strip():
            return
        try:
            event = orjson.loads(line)
            op, seq = event["op"], int(event["seq"])
            rid = event.get("id")
            if op != "base" and (not isinstance(rid, str) or op not in ("freeze", "retire", "delete")):
                raise ValueError(f"unknown event {op!r}")
            if op != "base" and not is_valid_rollout_id(rid):  # read back as the front door reads it (D41)
                raise _InvalidIdLine(f"an invalid rollout id {str(rid)[:80]!r}")
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, _InvalidIdLine):  # never a fence of any rollout; said once per reading process
                _logger.warning("%s: line %d names %s: skipped (contract D41)", _LABEL, self._lines, exc)
            # A damaged line (a torn append another process terminated, or disk damage): it poisons only
            # the rollout it names, until a later valid event for that rollout supersedes it.
            match = _ID_IN_LINE.search(line)
            self._raw_corrupt.append(line)
            if match:
                rid_s = match.group(1).decode()
                self._corrupt[rid_s] = f"damaged fence journal line {self._lines}: {exc}"
            return
        self.max_seq = max(self.max_seq, seq)
        if op == "base":
            return
        assert isinstance(rid, str)
        self._corrupt.pop(rid, None)
        self._fences.pop(rid, None)  # re-inserted last: the dict stays in seq order
        self._deleted.pop(rid, None)  # re-inserted last: the dict stays in the order of deletion
        if op == "delete":
            at = event.get("at")
            self._deleted[rid] = (seq, float(at) if isinstance(at, (int, float)) else 0.0)
            return
        self._fences[rid] = Fence(
            kind="frozen" if op == "freeze" else "retired",
            seq=seq,
            snapshot_id=event.get("snapshot_id"),
            version=event.get("version"),
            inflight=tuple(event.get("inflight") or ()),
        )

    def fence(self, rollout_id: str) -> Fence | None:
        with self._view_lock:
            return self._fences.get(rollout_id)

    def corrupt(self, rollout_id: str) -> str | None:
        with self._view_lock:
            return self._corrupt.get(rollout_id)

    def last_seq(self, rollout_id: str) -> int:
        """The seq of the rollout's last event (its epoch); 0 when it has none."""
        with self._view_lock:
            fence = self._fences.get(rollout_id)
            if fence is not None:
                return fence.seq
            deleted = self._deleted.get(rollout_id)
            return deleted[0] if deleted is not None else 0

    def fences(self) -> dict[str, Fence]:
        with self._view_lock:
            return dict(self._fences)

    # -- writing -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, dirs: DirFds) -> Iterator[None]:
        label = state_label(JOURNAL_LOCK)
        if not self._thread_lock.acquire(timeout=dirs.lock_timeout):
            raise LockTimeoutError(label, dirs.lock_timeout, "another thread of this process")
        try:
            fd, _ = open_file(dirs.state_fd(), JOURNAL_LOCK, os.O_RDWR | os.O_CREAT, label, single_link=False)
            try:
                flock_within(fd, fcntl.LOCK_EX, dirs.lock_timeout, label)
                yield
            finally:
                os.close(fd)  # closing releases the flock
        finally:
            self._thread_lock.release()

    def append(
        self, dirs: DirFds, events: Iterable[dict[str, Any]], fsync: Fsync, hook: Hook = no_hook
    ) -> int:
        """Append events (their ``seq`` assigned here, in order) and make the journal durable, even when
        there are none: an event another process appended may not be synced yet. Returns how many.

        Lines are encoded into one chunk and written each time it reaches :data:`CHUNK_BYTES`, so a batch
        of any size holds one chunk, not an encoded line per rollout. Writing a batch in several
        ``write``s is safe: nothing is acknowledged before the ``fsync``, a crash between them leaves some
        fences of the batch (each complete, a torn last line terminated by the next appender), and the
        rollouts of the batch are locked meanwhile."""
        with self._locked(dirs):
            self.refresh()
            state_fd = dirs.state_fd()
            created = False
            try:
                fd, _ = open_file(state_fd, JOURNAL, os.O_RDWR | os.O_APPEND, _LABEL)
            except FileNotFoundError:  # under the journal lock: nobody else creates it meanwhile
                fd, _ = open_file(state_fd, JOURNAL, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL, _LABEL)
                created = True
            try:
                count, wrote = self._write_events(fd, created, events)
                if wrote:
                    hook("journal_written")
                fsync(fd)
            finally:
                os.close(fd)
            if created:
                fsync(state_fd)  # the new journal's directory entry
            hook("journal_synced")
            self.refresh()
            if count and self._mostly_superseded():
                try:
                    self._compact(dirs, fsync)
                except OSError as exc:  # optional (it needs a new inode): the events are durable already
                    _logger.warning("could not compact the fence journal: %s", exc)
            return count

    def _write_events(self, fd: int, created: bool, events: Iterable[dict[str, Any]]) -> tuple[int, bool]:
        chunk = bytearray()
        if created:
            chunk += _dumps({"op": "base", "seq": 0, "journal": uuid.uuid4().hex})
        else:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                chunk += b"\n"  # terminate a line torn by a crashed appender (contract L13)
        wrote = bool(chunk)
        count = 0
        now = round(time.time(), 3)
        for count, event in enumerate(events, 1):
            if event.get("op") == "delete":
                event = {**event, "at": now}
            chunk += _dumps({"seq": self.max_seq + count, **event})
            if len(chunk) >= CHUNK_BYTES:
                write_all(fd, chunk)
                chunk.clear()
                wrote = True
        if chunk:
            write_all(fd, chunk)
            wrote = True
        return count, wrote

    def _mostly_superseded(self) -> bool:
        with self._view_lock:
            if self._lines <= COMPACT_MIN_LINES:
                return False
            live = (
                len(self._fences) + len(self._deleted) - self._expired_deletes() + len(self._raw_corrupt) + 1
            )
            return 2 * (self._lines - live) > live

    def _expired_deletes(self) -> int:
        """Delete lines a compaction would drop (older than the retention), counted from the oldest: the
        view keeps deletes in the order they happened, so this stops at the first recent one."""
        cutoff = time.time() - DELETE_RETENTION_S
        expired = 0
        for _, at in self._deleted.values():
            if at >= cutoff:
                break
            expired += 1
        return expired

    def _compact(self, dirs: DirFds, fsync: Fsync) -> None:
        """Rewrite the journal with only the fences still in force (under the journal lock): written to a
        temporary file, synced, renamed over the journal, and the directory synced (contract L12)."""
        state_fd = dirs.state_fd()
        for name in os.listdir(state_fd):
            if name.startswith(JOURNAL + ".tmp-"):
                os.unlink(name, dir_fd=state_fd)  # left by a compaction that crashed
        tmp = f"{JOURNAL}.tmp-{uuid.uuid4().hex}"
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            FILE_MODE,
            dir_fd=state_fd,
        )
        try:
            with self._view_lock:
                for chunk in self._compacted_chunks():
                    write_all(fd, chunk)
            fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, JOURNAL, src_dir_fd=state_fd, dst_dir_fd=state_fd)
        fsync(state_fd)
        self.refresh()

    def _compacted_chunks(self) -> Iterator[bytes]:
        chunk = bytearray(_dumps({"op": "base", "seq": self.max_seq, "journal": uuid.uuid4().hex}))
        for rid, fence in self._fences.items():
            event: dict[str, Any] = {
                "seq": fence.seq,
                "op": "freeze" if fence.kind == "frozen" else "retire",
                "id": rid,
            }
            if fence.snapshot_id is not None:
                event["snapshot_id"] = fence.snapshot_id
            if fence.version is not None:
                event["version"] = fence.version
            if fence.inflight:
                event["inflight"] = list(fence.inflight)
            chunk += _dumps(event)
            if len(chunk) >= CHUNK_BYTES:
                yield bytes(chunk)
                chunk.clear()
        cutoff = time.time() - DELETE_RETENTION_S
        for rid, (seq, at) in self._deleted.items():
            if at >= cutoff:
                chunk += _dumps({"seq": seq, "op": "delete", "id": rid, "at": at})
                if len(chunk) >= CHUNK_BYTES:
                    yield bytes(chunk)
                    chunk.clear()
        for line in self._raw_corrupt:
            chunk += line + b"\n"
        yield bytes(chunk)


class _InvalidIdLine(ValueError):
    """A journal line naming a rollout id the grammar refuses: damage, not a fence."""


def _dumps(event: dict[str, Any]) -> bytes:
    return orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE)


def fence_error(rollout_id: str, fence: Fence) -> CaptureFrozenError:
    """The typed refusal of a fenced rollout (contract L2)."""
    if fence.kind == "retired":
        return CaptureRetiredError(f"rollout {rollout_id} is retired: its captures take no more writes")
    return CaptureFrozenError(f"rollout {rollout_id} is frozen: its captures take no more records")
