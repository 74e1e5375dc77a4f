"""The lifecycle's on-disk state: striped locks, the fence journal and in-flight markers.

Everything lives in ``<dir>/.otel-capture/``, which NeMo Gym never looks at:

* ``locks/NN.lock``: 64 striped lock files, chosen by ``crc32(rollout_id) % 64``. A rollout's writers and
  lifecycle operations hold its stripe (``flock(LOCK_EX)`` plus an in-process lock, because ``flock`` does
  not exclude two threads sharing one open file) for the whole fence check + append, or fence + removal.
  Lock files are created on first use and never deleted, so two processes can never lock different inodes.
* ``journal.lock``: serialises appends to, and compaction of, the journal. Order: stripes (sorted) first,
  then ``journal.lock``.
* ``fences.journal``: append-only, one JSON line per lifecycle event (``freeze``, ``retire``, ``delete``),
  each with a journal-wide ``seq``. A rollout's state is its last event: ``freeze`` → Frozen, ``retire``
  → Retired, ``delete`` (or no event) → Absent/Live. One append + one ``fsync`` makes a whole batch of
  fences durable, instead of one fence file (and one fsync) per rollout.
* ``trash/``: record files that a retire or delete took out of the directory (a ``rename``, as atomic as
  an ``unlink`` and much cheaper than freeing a synced file's blocks); a background task unlinks them.
* ``inflight/<id>.calls``: ``+<model_call_id>`` when a call begins and ``-<model_call_id>`` when it ends,
  written by the writer thread without fsync, so that a freeze in *another* process sees calls in flight.

Readers keep an in-memory view of the journal and refresh it with one ``stat``: unchanged size and inode
means nothing to read; a larger size means read only the new tail; a new inode (compaction) means reload.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

STATE_DIR = ".otel-capture"
JOURNAL_NAME = "fences.journal"
STRIPES = 64
COMPACT_MIN_LINES = 4096

FenceKind = Literal["frozen", "retired"]
Hook = Callable[[str], None]
Fsync = Callable[[int], None]

_ID_IN_LINE = re.compile(rb'"id":"([A-Za-z0-9][A-Za-z0-9._-]{0,199})"')


@dataclass(frozen=True, slots=True)
class Fence:
    """A rollout's last journal event, when it is a fence (``freeze`` or ``retire``)."""

    kind: FenceKind
    seq: int
    snapshot_id: str | None = None
    version: int | None = None
    inflight: tuple[str, ...] = ()


def _fsync_dir(path: Path, fsync: Fsync) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def _no_hook(point: str) -> None:
    return None


class _StripedLocks:
    """64 lock files per directory, each paired with an in-process lock.

    A lock file is opened for each hold and closed after it (closing releases the ``flock``): one
    ``open`` per stripe per batch is cheap, and a process touching thousands of directories never holds
    thousands of descriptors.
    """

    def __init__(self, lock_dir: Path, ensure_dir: Callable[..., None]) -> None:
        self._dir = lock_dir
        self._ensure_dir = ensure_dir
        self._threads = [threading.Lock() for _ in range(STRIPES)]

    @staticmethod
    def stripe(rollout_id: str) -> int:
        return zlib.crc32(rollout_id.encode()) % STRIPES

    @contextlib.contextmanager
    def hold(self, stripes: Iterable[int]) -> Iterator[None]:
        """Hold these stripes (acquired in ascending order, so two holders never deadlock)."""
        ordered = sorted(set(stripes))
        held: list[tuple[int, int]] = []
        if ordered:
            self._ensure_dir()
        try:
            for stripe in ordered:
                self._threads[stripe].acquire()
                try:
                    fd = _open_recreating(self._dir / f"{stripe:02d}.lock", os.O_RDWR, self._ensure_dir)
                except BaseException:
                    self._threads[stripe].release()
                    raise
                held.append((stripe, fd))
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            for stripe, fd in reversed(held):
                os.close(fd)
                self._threads[stripe].release()

    def hold_ids(self, rollout_ids: Iterable[str]) -> contextlib.AbstractContextManager[None]:
        return self.hold(self.stripe(rid) for rid in rollout_ids)


class FenceJournal:
    """The fence journal and this process's view of it."""

    def __init__(self, state_dir: Path, ensure_dir: Callable[..., None]) -> None:
        self.path = state_dir / JOURNAL_NAME
        self._state_dir = state_dir
        self._ensure_dir = ensure_dir
        self._lock_path = state_dir / "journal.lock"
        self._thread_lock = threading.Lock()
        self._view_lock = threading.RLock()
        self._reset_view()

    # -- the view ------------------------------------------------------------------------------------

    def _reset_view(self) -> None:
        self._ino: int | None = None
        self._offset = 0
        self._header = b""
        self._lines = 0
        self.max_seq = 0
        self._fences: dict[str, Fence] = {}
        self._last_seq: dict[str, int] = {}
        self._corrupt: dict[str, str] = {}
        self._raw_corrupt: list[bytes] = []

    def refresh(self) -> None:
        """Bring the view up to date: one ``stat`` when nothing changed."""
        with self._view_lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                if self._ino is not None:
                    self._reset_view()
                return
            if st.st_ino == self._ino and st.st_size == self._offset:
                return
            with open(self.path, "rb") as handle:
                st = os.fstat(handle.fileno())
                same = st.st_ino == self._ino and st.st_size >= self._offset
                if same and self._header and handle.read(len(self._header)) != self._header:
                    same = False  # a compacted journal that reused the inode number
                if not same:
                    self._reset_view()
                    self._ino = st.st_ino
                handle.seek(self._offset)
                data = handle.read()
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            for line in data[:end].split(b"\n")[:-1]:
                self._apply(line)
            self._offset += end

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
        except (ValueError, KeyError, TypeError) as exc:
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
        self._last_seq[rid] = seq
        if op == "delete":
            self._fences.pop(rid, None)
        else:
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
        with self._view_lock:
            return self._last_seq.get(rollout_id, 0)

    def fences(self) -> dict[str, Fence]:
        with self._view_lock:
            return dict(self._fences)

    # -- writing -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._ensure_dir()
        with self._thread_lock:
            fd = _open_recreating(self._lock_path, os.O_RDWR, self._ensure_dir)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing releases the flock

    def append(self, events: list[dict[str, Any]], fsync: Fsync, hook: Hook = _no_hook) -> list[int]:
        """Append events (their ``seq`` assigned here) and make the journal durable, even when ``events``
        is empty: an event another process appended may not be synced yet. Returns the seqs assigned."""
        with self._locked():
            self.refresh()
            created = False
            try:
                fd = os.open(
                    self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600
                )
                created = True
            except FileExistsError:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
            try:
                chunks: list[bytes] = []
                if created:
                    chunks.append(_dumps({"op": "base", "seq": 0, "journal": uuid.uuid4().hex}))
                else:
                    size = os.fstat(fd).st_size
                    if size and os.pread(fd, 1, size - 1) != b"\n":
                        chunks.append(b"\n")  # terminate a line torn by a crashed appender
                seqs = []
                for offset, event in enumerate(events, 1):
                    seqs.append(self.max_seq + offset)
                    chunks.append(_dumps({"seq": self.max_seq + offset, **event}))
                if chunks:
                    _write_all(fd, b"".join(chunks))
                    hook("journal_written")
                fsync(fd)
            finally:
                os.close(fd)
            if created:
                _fsync_dir(self._state_dir, fsync)
            hook("journal_synced")
            self.refresh()
            if len(events) and self._lines > COMPACT_MIN_LINES and 4 * len(self._fences) < self._lines:
                self._compact(fsync)
            return seqs

    def _compact(self, fsync: Fsync) -> None:
        """Rewrite the journal with only the fences still in force (under the journal lock)."""
        for orphan in self._state_dir.glob(JOURNAL_NAME + ".tmp-*"):
            orphan.unlink(missing_ok=True)  # left by a compaction that crashed
        chunks = [_dumps({"op": "base", "seq": self.max_seq, "journal": uuid.uuid4().hex})]
        for rid, fence in sorted(self._fences.items(), key=lambda item: item[1].seq):
            op = "freeze" if fence.kind == "frozen" else "retire"
            event: dict[str, Any] = {"seq": fence.seq, "op": op, "id": rid}
            if fence.snapshot_id is not None:
                event["snapshot_id"] = fence.snapshot_id
            if fence.version is not None:
                event["version"] = fence.version
            if fence.inflight:
                event["inflight"] = list(fence.inflight)
            chunks.append(_dumps(event))
        chunks.extend(line + b"\n" for line in self._raw_corrupt)
        tmp = self._state_dir / f"{JOURNAL_NAME}.tmp-{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, b"".join(chunks))
            fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self._state_dir, fsync)
        self.refresh()


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

    def forget(self, rollout_id: str) -> None:
        with self._lock:
            self._calls.pop(rollout_id, None)

    def pending(self, rollout_id: str) -> dict[str, int | None]:
        with self._lock:
            return dict(self._calls.get(rollout_id, {}))

    def rollouts(self) -> list[str]:
        with self._lock:
            return list(self._calls)

    def of(self, rollout_id: str) -> set[str]:
        with self._lock:
            return set(self._calls.get(rollout_id, ()))


class DirState:
    """One process's lifecycle state for one capture directory (shared by every store and writer)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state_dir = root / STATE_DIR
        self.inflight_dir = self.state_dir / "inflight"
        self.trash_dir = self.state_dir / "trash"
        self._made = False
        self._made_lock = threading.Lock()
        self.locks = _StripedLocks(self.state_dir / "locks", self.ensure_dirs)
        self.journal = FenceJournal(self.state_dir, self.ensure_dirs)
        self.calls = InflightCalls()
        self.fsync: Fsync = os.fsync  # used when the state directories are first created

    def ensure_dirs(self, again: bool = False) -> None:
        """Create ``.otel-capture/{locks,inflight,trash}`` once (``again``: they vanished, as when an
        operator removes the capture directory under a running server); a new directory's parent is synced."""
        if again:
            self._made = False
        if self._made:
            return
        with self._made_lock:
            if self._made:
                return
            for path in (
                self.root,
                self.state_dir,
                self.state_dir / "locks",
                self.inflight_dir,
                self.trash_dir,
            ):
                if not path.is_dir():
                    path.mkdir(mode=0o700, parents=True, exist_ok=True)
                    _fsync_dir(path.parent, self.fsync)
            self._made = True

    def marker_path(self, rollout_id: str) -> Path:
        return self.inflight_dir / (rollout_id + ".calls")

    def write_markers(self, rollout_id: str, begun: Iterable[str], ended: Iterable[str]) -> None:
        """Append ``+id`` / ``-id`` lines (no fsync: a marker matters while its process lives)."""
        data = b"".join(b"+" + m.encode() + b"\n" for m in begun) + b"".join(
            b"-" + m.encode() + b"\n" for m in ended
        )
        if not data:
            return
        self.ensure_dirs()
        fd = _open_recreating(self.marker_path(rollout_id), os.O_WRONLY | os.O_APPEND, self.ensure_dirs)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)

    def marked_inflight(self, rollout_id: str) -> set[str]:
        """Calls whose ``+`` marker has no ``-`` (begun in any process, never recorded)."""
        try:
            data = self.marker_path(rollout_id).read_bytes()
        except FileNotFoundError:
            return set()
        begun: set[str] = set()
        for line in data.split(b"\n"):
            if line[:1] == b"+":
                begun.add(line[1:].decode("utf-8", "replace"))
            elif line[:1] == b"-":
                begun.discard(line[1:].decode("utf-8", "replace"))
        return begun


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


def _open_recreating(path: Path, flags: int, ensure_dirs: Callable[..., None]) -> int:
    """``open(O_CREAT)``, recreating the state directories once if they have vanished."""
    flags |= os.O_CREAT | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        ensure_dirs(again=True)
        return os.open(path, flags, 0o600)


def _dumps(event: dict[str, Any]) -> bytes:
    return orjson.dumps(event, option=orjson.OPT_APPEND_NEWLINE)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
