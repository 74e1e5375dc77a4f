"""Where a capture directory keeps each rollout's files.

``<dir>/<rollout_id>.capture.jsonl`` holds one NeMo Gym ``ModelCallRecord`` line per call (append only,
``flock`` exclusive per append, shared per read, as NeMo Gym 0.7.0 does on the same files);
``<dir>/<rollout_id>.capture.incomplete`` exists when a call of that rollout could not be captured. NeMo Gym
only checks that the marker exists; we append one JSON line per failed call to it, saying which and why.
``<dir>/<rollout_id>.tokens.jsonl`` holds one token line per call whose upstream returned token ids or
log-probs (:mod:`._tokens`).

The lifecycle (freeze, drop, retire, delete) is :class:`.lifecycle.FileLifecycle`, which the store owns
and hands its lifecycle methods to; its own state lives in ``<dir>/.otel-capture/``, which NeMo Gym never
reads (:mod:`.dirstate`). Losses a writer could not even mark are in its loss reserve (:mod:`.losses`):
:meth:`CaptureStore.is_incomplete` and :meth:`CaptureStore.incomplete_calls` count them. Nothing here follows a link or
waits on a FIFO: an entry that is not a regular file is skipped and listed by :meth:`damaged_entries`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from .._correlation.ids import validate_rollout_id
from .._errors import DamagedEntryError
from .._records.codec import split_lines
from .._settings import allow_shared_dir_from_environ, lock_timeout_from_environ
from .dirstate import dir_state
from .fs import flock_within, open_file, problem, read_all
from .journal import no_hook
from .lifecycle import CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX, FileLifecycle
from .losses import pending_for, pending_losses
from .types import CaptureSnapshot, IncompleteCall, RemovalResult, RolloutState
from .weight import validate_weight_version

_logger = logging.getLogger(__name__)

__all__ = [
    "CAPTURE_SUFFIX",
    "INCOMPLETE_SUFFIX",
    "TOKENS_SUFFIX",
    "CaptureStore",
    "RawLines",
    "StreamedLines",
]


class RawLines(NamedTuple):
    """A data file split at ``\\n``: the complete lines (newline removed) and what follows the last one.

    A non-blank ``tail`` is a torn final line: a writer died (or the disk filled) mid-append.
    """

    lines: list[bytes]
    tail: bytes


STREAM_CHUNK = 1 << 20


class StreamedLines:
    """A data file's complete lines (newline removed), read after its lock is let go: the file's size is
    taken under ``flock(LOCK_SH)`` and only the bytes below it are read, ``STREAM_CHUNK`` at a time. The
    data files are append-only (a failed append is cut back only to where it began), so bytes below a size
    seen under the lock never change, and a retire or delete moves the name, not the open file.

    ``count`` is the number of complete lines (blank ones too). Iterate once; the descriptor is closed at
    the end, by :meth:`close`, or when the object is dropped. A torn tail is not yielded."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd: int | None = fd
        self.size = size
        self.count = sum(chunk.count(b"\n") for chunk in self._chunks())

    def _chunks(self) -> Iterator[bytes]:
        offset = 0
        while self._fd is not None and offset < self.size:
            chunk = os.pread(self._fd, min(STREAM_CHUNK, self.size - offset), offset)
            if not chunk:
                return
            offset += len(chunk)
            yield chunk

    def __iter__(self) -> Iterator[bytes]:
        pending: list[bytes] = []  # the start of a line that continues in the next chunk
        try:
            for chunk in self._chunks():
                start = 0
                while (end := chunk.find(b"\n", start)) != -1:
                    if pending:
                        pending.append(chunk[start:end])
                        yield b"".join(pending)
                        pending.clear()
                    else:
                        yield chunk[start:end]
                    start = end + 1
                if start < len(chunk):
                    pending.append(chunk[start:])
        finally:
            self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class CaptureStore:
    """A capture directory and its lifecycle. Creating the object never touches the filesystem.

    ``allow_shared_directory``: use a world-writable directory, or one owned by another user, which is
    otherwise refused with :class:`UnsafeDirectoryError` (default: ``OTEL_CAPTURE_ALLOW_SHARED_DIR``).
    ``lock_timeout_s``: the longest wait for any file lock (a data file's ``flock`` held by another process,
    a rollout's stripe); past it a read, freeze, retire or delete raises :class:`LockTimeoutError`
    (default: ``OTEL_CAPTURE_LOCK_TIMEOUT_S``, else 30 s).
    ``fsync`` and ``crash_hook`` are seams for tests: a failing disk, and a callback named at each step of
    a lifecycle batch (crash tests SIGKILL the process there). Neither is a tuning knob.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        allow_shared_directory: bool | None = None,
        fsync: Callable[[int], None] = os.fsync,
        crash_hook: Callable[[str], None] | None = None,
        lock_timeout_s: float | None = None,
    ) -> None:
        self.root = Path(root)
        self._allow_shared = (
            allow_shared_dir_from_environ() if allow_shared_directory is None else allow_shared_directory
        )
        self._lock_timeout = lock_timeout_from_environ() if lock_timeout_s is None else lock_timeout_s
        self._lifecycle = FileLifecycle(
            self.root,
            allow_shared=self._allow_shared,
            lock_timeout=self._lock_timeout,
            fsync=fsync,
            hook=crash_hook or no_hook,
            rollout_ids=self.rollout_ids,
        )

    def __repr__(self) -> str:
        return f"CaptureStore({str(self.root)!r})"

    # -- the lifecycle, owned (docs/lifecycle.md) ----------------------------------------------------------

    def rollout_state(self, rollout_id: str) -> RolloutState:
        """``absent``, ``live``, ``frozen`` or ``retired``."""
        return self._lifecycle.rollout_state(rollout_id)

    def list_rollouts(self, state: RolloutState | None = None) -> dict[str, RolloutState]:
        """Every rollout that is not absent, with its state, sorted by id; only ``state`` ones if given."""
        return self._lifecycle.list_rollouts(state)

    def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Say a call has started (:meth:`.lifecycle.FileLifecycle.begin_call`)."""
        self._lifecycle.begin_call(rollout_id, model_call_id)

    def mark_incomplete(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Durably mark a call as not captured (:meth:`.lifecycle.FileLifecycle.mark_incomplete`)."""
        self._lifecycle.mark_incomplete(rollout_id, model_call_id, reason)

    def append_now(
        self,
        rollout_id: str,
        model_call_id: str,
        record: dict[str, Any],
        tokens: dict[str, Any] | None = None,
    ) -> None:
        """Write one call's record durably, through the writer's fenced path."""
        self._lifecycle.append_now(rollout_id, model_call_id, record, tokens)

    def freeze_now(self, rollout_id: str) -> CaptureSnapshot:
        """Freeze the rollout and return its snapshot (:meth:`.lifecycle.FileLifecycle.freeze_now`)."""
        return self._lifecycle.freeze_now(rollout_id)

    def drop_now(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire the rollout only if it is still exactly the snapshot consumed."""
        return self._lifecycle.drop_now(rollout_id, snapshot_id=snapshot_id, version=version)

    def retire_now(self, rollout_ids: Iterable[str]) -> RemovalResult:
        """Fence each rollout whatever its state and remove its records (two synced phases)."""
        return self._lifecycle.retire_now(rollout_ids)

    def delete_now(self, rollout_ids: Iterable[str]) -> RemovalResult:
        """Remove records and fences: each id is absent afterwards and can be reused."""
        return self._lifecycle.delete_now(rollout_ids)

    def purge_trash(self) -> int:
        """Unlink the record files retire and delete moved aside; how many entries it removed."""
        return self._lifecycle.purge_trash()

    async def freeze(self, rollout_id: str) -> CaptureSnapshot:
        return await self._lifecycle.freeze(rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await self._lifecycle.drop(rollout_id, snapshot_id=snapshot_id, version=version)

    async def retire(self, rollout_ids: Iterable[str]) -> RemovalResult:
        return await self._lifecycle.retire(rollout_ids)

    async def delete(self, rollout_ids: Iterable[str]) -> RemovalResult:
        return await self._lifecycle.delete(rollout_ids)

    # -- the files ---------------------------------------------------------------------------------------

    def data_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + CAPTURE_SUFFIX)

    def incomplete_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + INCOMPLETE_SUFFIX)

    def tokens_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + TOKENS_SUFFIX)

    def is_incomplete(self, rollout_id: str) -> bool:
        """Whether the marker exists (whatever it is: a damaged marker says something went wrong too), or a
        writer's loss reserve holds a loss of the rollout that its marker does not have yet."""
        return os.path.lexists(self.incomplete_path(rollout_id)) or bool(pending_for(self.root, rollout_id))

    def incomplete_calls(self, rollout_id: str) -> list[IncompleteCall]:
        """The calls the rollout's marker names (``model_call_id`` ``""`` for a line that names none, and
        one "marked incomplete" for an empty marker, as NeMo Gym writes them), then each loss in a loss
        reserve that the marker does not have yet. Read without a lock, as :meth:`is_incomplete`."""
        calls: list[IncompleteCall] = []
        path = self.incomplete_path(rollout_id)
        try:
            fd, _ = open_file(None, path, os.O_RDONLY, path.name, single_link=False)
        except FileNotFoundError:
            data = None
        except DamagedEntryError as exc:
            data = None
            calls.append(IncompleteCall("", f"{path.name}: {exc.what}: not read"))
        else:
            try:
                data = read_all(fd)
            finally:
                os.close(fd)
        if data is not None:
            lines = [line for line in data.split(b"\n") if line.strip()]
            for line in lines:
                calls.append(_marked_call(line))
            if not lines:
                calls.append(IncompleteCall("", "marked incomplete"))
        for loss in pending_for(self.root, rollout_id):
            for mcid in loss.model_call_ids or ("",):
                calls.append(IncompleteCall(mcid, loss.describe()))
        return calls

    # -- the declared weight version and calls in flight (docs/lifecycle.md) ------------------------

    def set_weight_version(self, version: str | int) -> None:
        """Declare the weight (policy) version in force from now on for every call captured in this
        directory (by any writer, on any node sharing it, from its next batch): one ``fsync``-ed line in
        ``.otel-capture/weight_versions``. A record's ``weight_version`` is the version in force when its
        call started (unless the caller sent one), ``weight_version_at_end`` the one when it finished, if
        different. Raises ``ValueError`` for an empty, over-long or unprintable version."""
        self._lifecycle.set_weight_version(validate_weight_version(version))

    def weight_version(self) -> str | None:
        """The version declared last (``None`` before any declaration)."""
        view = dir_state(self.root).weights
        view.refresh()
        return view.current

    def calls_in_flight(self, rollout_id: str) -> dict[str, float | None]:
        """The rollout's calls begun and not yet recorded, in this process and in every process whose
        writer has written their in-flight marker, each with when that marker was written (UTC Unix
        seconds; ``None`` for a call of this process without one yet, or a marker written without it).
        A call begun less than the writer's marker delay (20 ms) ago in another process is not seen."""
        return self._lifecycle.calls_in_flight(rollout_id)

    def rollout_ids(self) -> list[str]:
        """Every rollout with a data, token or incomplete file that is a regular file, or with a loss in a
        writer's loss reserve, sorted: the one listing of the directory's rollouts (``list_rollouts``,
        ``check`` and ``show`` use it)."""
        found = {rid for rid, _, st in self._scan() if stat.S_ISREG(st.st_mode)}
        # a rollout whose every file a full filesystem refused is known by its losses alone
        found.update(loss.rollout_id for loss in pending_losses(self.root) if loss.rollout_id)
        return sorted(found)

    def damaged_entries(self) -> list[tuple[str, str]]:
        """``(file name, what it is)`` for each entry named like a rollout's file that is not a regular file
        (a link, a FIFO, a directory: every reader skips it) or has several links (readers read it; the
        writer never appends to it). Nothing is ever written through any of them."""
        found = []
        for _, name, st in self._scan():
            what = problem(st, single_link=True)
            if what is not None:
                found.append((name, what))
        return sorted(found)

    def _scan(self) -> list[tuple[str, str, os.stat_result]]:
        """``(rollout id, file name, lstat)`` of every entry named like a rollout's file."""
        if not self.root.is_dir():
            return []
        found = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                for suffix in (CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX):
                    if entry.name.endswith(suffix):
                        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                            found.append(
                                (entry.name[: -len(suffix)], entry.name, entry.stat(follow_symlinks=False))
                            )
                        break
        return found

    def read_token_lines(self, rollout_id: str) -> RawLines | None:
        """The rollout's token file split into lines (as :meth:`read_lines`); ``None`` if absent."""
        return self._read_split(self.tokens_path(rollout_id), self._lock_timeout)

    def read_lines(self, rollout_id: str) -> RawLines | None:
        """The rollout's data file split into lines, read whole under ``flock(LOCK_SH)``; ``None`` if absent,
        or when it is a link, a FIFO or a device (skipped and logged: never followed or waited on).

        The shared lock is the one NeMo Gym's readers take: appenders hold ``LOCK_EX`` for a whole line, so
        under it every line is either complete or was torn by a writer that died. One ``read()`` and one
        ``split`` cost no more than iterating the file, and make the torn tail plain to see. A lock held
        by another process past the lock timeout raises :class:`LockTimeoutError`.
        """
        return self._read_split(self.data_path(rollout_id), self._lock_timeout)

    def stream_lines(self, rollout_id: str) -> StreamedLines | None:
        """The rollout's data file as :meth:`read_lines` sees it, without holding it in memory or holding its
        lock while the lines are used (``otel-capture show`` prints as it reads); ``None`` when absent or
        skipped, as :meth:`read_lines`."""
        path = self.data_path(rollout_id)
        fd = self._open_data(path)
        if fd is None:
            return None
        try:
            flock_within(fd, fcntl.LOCK_SH, self._lock_timeout, path.name)
            try:
                size = os.fstat(fd).st_size
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        return StreamedLines(fd, size)

    @staticmethod
    def _open_data(path: Path) -> int | None:
        try:
            fd, _ = open_file(None, path, os.O_RDONLY, path.name, single_link=False)
        except FileNotFoundError:
            return None
        except DamagedEntryError as exc:
            if exc.what.startswith("a directory"):  # fails at once, as open() always did: not skipped
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path)) from None
            # A link or a FIFO: never followed or waited on.
            _logger.warning("skipping %s: %s", path, exc.what)
            return None
        return fd

    @classmethod
    def _read_split(cls, path: Path, lock_timeout: float) -> RawLines | None:
        fd = cls._open_data(path)
        if fd is None:
            return None
        try:
            flock_within(fd, fcntl.LOCK_SH, lock_timeout, path.name)
            try:
                data = read_all(fd)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        return RawLines(*split_lines(data))


def _marked_call(line: bytes) -> IncompleteCall:
    """One line of an incomplete marker (ours: ``{"model_call_id", "reason", "at"}``)."""
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        return IncompleteCall("", "marked incomplete")
    mcid, reason = value.get("model_call_id"), value.get("reason")
    return IncompleteCall(mcid if isinstance(mcid, str) else "", str(reason or "marked incomplete"))
