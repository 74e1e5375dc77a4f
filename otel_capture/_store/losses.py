"""The loss reserve: where a writer says a call was lost when even its incomplete mark cannot be written
(no inode for a marker, no block for its line) (contract D13, D14, D15, D16).

* ``.otel-capture/losses/<pid>-<random>.losses``, given :data:`RESERVE_BYTES` of blocks at creation
  (``posix_fallocate``), so an entry later needs no inode and no free block.
* An entry is one line ``!{"rollout_id", "calls", "reason", "at"}``, one ``pwrite`` and ``fsync``; once
  its marks are in the marker, its ``!`` becomes ``.`` in place (reported). A pending entry is a
  :class:`Loss`. The last :data:`OVERFLOW_BYTES` hold one overflow entry (``"overflow": true``).
* The writer holds ``flock(LOCK_SH)`` on its reserve while it runs; a reserve nobody holds is an orphan,
  adopted by the next writer. Readers read every reserve without a lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from .fs import FILE_MODE, DirFds, open_file, read_all, still_named
from .names import LOSSES_DIR, LOSSES_SUFFIX, STATE_DIR, state_label
from .sync import Fsync

_logger = logging.getLogger(__name__)

RESERVE_BYTES = 64 * 1024
"""Blocks reserved per writer: about 250 entries of 250 bytes (an entry names up to :data:`MAX_IDS` calls)."""
OVERFLOW_BYTES = 256
MAX_IDS = 8
"""Call ids named per entry; further calls of the same failure are counted (``"more"``)."""
PENDING = b"!"
REPORTED = b"."


@dataclass(frozen=True)
class Loss:
    """A loss recorded in a reserve and not yet in its rollout's marker (``rollout_id`` ``""``: overflow)."""

    rollout_id: str
    model_call_ids: tuple[str, ...]
    reason: str
    more: int = 0
    """Calls of the same failure not named in ``model_call_ids``."""
    source: str = ""
    """The reserve file, relative to the capture directory."""

    def describe(self) -> str:
        calls = ", ".join(self.model_call_ids) or "calls"
        more = f" and {self.more} more" if self.more else ""
        return f"{calls}{more}: {self.reason} (not yet in the marker; recorded in {self.source})"


def _entry(rollout_id: str, mcids: list[str], reason: str) -> bytes:
    value: dict[str, object] = {"rollout_id": rollout_id, "calls": mcids[:MAX_IDS], "reason": reason}
    if len(mcids) > MAX_IDS:
        value["more"] = len(mcids) - MAX_IDS
    value["at"] = round(time.time(), 3)
    return PENDING + orjson.dumps(value) + b"\n"


def _parse(data: bytes, source: str) -> Iterator[tuple[int, Loss]]:
    """``(offset, loss)`` of every complete pending entry of a reserve's bytes, the overflow slot last."""
    yield from _parse_from(data[: RESERVE_BYTES - OVERFLOW_BYTES], 0, source)
    if len(data) >= RESERVE_BYTES:
        yield from _parse_from(data[:RESERVE_BYTES], RESERVE_BYTES - OVERFLOW_BYTES, source)


def _parse_from(data: bytes, offset: int, source: str) -> Iterator[tuple[int, Loss]]:
    while offset < len(data) and data[offset : offset + 1] in (PENDING, REPORTED):
        end = data.find(b"\n", offset)
        if end == -1:
            return  # being written: read next time
        if data[offset : offset + 1] == PENDING:
            try:
                value = orjson.loads(data[offset + 1 : end])
            except orjson.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                calls = value.get("calls") or []
                yield (
                    offset,
                    Loss(
                        str(value.get("rollout_id") or ""),
                        tuple(str(c) for c in calls if isinstance(c, str)),
                        str(value.get("reason") or "capture failed"),
                        int(value.get("more") or 0),
                        source,
                    ),
                )
        offset = end + 1


def pending_losses(root: str | os.PathLike[str]) -> list[Loss]:
    """Every pending entry of every reserve in ``root`` (no lock, nothing created; a reserve that is not a
    regular file is skipped). ``[]`` when there is no reserve."""
    losses_dir = Path(root) / STATE_DIR / LOSSES_DIR
    try:
        dir_fd = os.open(losses_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return []
        raise
    found: list[Loss] = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            if not name.endswith(LOSSES_SUFFIX):
                continue
            label = state_label(LOSSES_DIR, name)
            try:
                fd, _ = open_file(dir_fd, name, os.O_RDONLY, label, single_link=False)
            except OSError:  # gone meanwhile, or not a regular file: nothing of ours
                continue
            try:
                data = _used(fd)
            finally:
                os.close(fd)
            found.extend(loss for _, loss in _parse(data, label))
    finally:
        os.close(dir_fd)
    return found


def _used(fd: int) -> bytes:
    """The entries of a reserve (read 4 KiB at a time up to the zeros after the last one), with the
    overflow slot at the end: an idle writer's reserve costs one small read, not its reserved size."""
    chunks = []
    offset = 0
    while offset < RESERVE_BYTES - OVERFLOW_BYTES:
        chunk = os.pread(fd, 4096, offset)
        chunks.append(chunk)
        offset += len(chunk)
        if len(chunk) < 4096 or b"\0" in chunk:
            break
    data = b"".join(chunks)
    slot = os.pread(fd, OVERFLOW_BYTES, RESERVE_BYTES - OVERFLOW_BYTES)
    if slot[:1] in (PENDING, REPORTED):
        data = data.ljust(RESERVE_BYTES - OVERFLOW_BYTES, b"\0") + slot
    return data


def pending_for(root: str | os.PathLike[str], rollout_id: str) -> list[Loss]:
    """The pending losses of one rollout; an overflow entry (rollout unknown) counts for every rollout
    (contract D14)."""
    return [loss for loss in pending_losses(root) if loss.rollout_id in (rollout_id, "")]


class LossReserve:
    """One writer's reserve file. Used by the writer thread only."""

    def __init__(self, file_mode: int = FILE_MODE) -> None:
        self._file_mode = file_mode
        self._fd: int | None = None
        self._dir_fd: int | None = None
        self._name = ""
        self._id: tuple[int, int] = (0, 0)
        self._end = 0
        self._pending: set[int] = set()
        self._overflowed = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def label(self) -> str:
        return state_label(LOSSES_DIR, self._name)

    def ready(self, dirs: DirFds) -> bool:
        """Whether the reserve is open and still named in this directory (not removed with it)."""
        if self._fd is None or self._dir_fd is None:
            return False
        try:
            here = dirs.state_fd(LOSSES_DIR)
        except OSError:
            return False
        return still_named(here, self._name, *self._id) is not None

    def open(self, dirs: DirFds, fsync: Fsync) -> None:
        """Create and reserve a fresh file (the old one, if any, is let go: its directory was removed)
        (contract D13)."""
        self.close_fds()
        dir_fd = os.dup(dirs.state_fd(LOSSES_DIR))
        name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}{LOSSES_SUFFIX}"
        try:
            fd, st = open_file(
                dir_fd,
                name,
                os.O_RDWR | os.O_CREAT | os.O_EXCL,
                state_label(LOSSES_DIR, name),
                mode=self._file_mode,
            )
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)  # the blocks an entry will need, taken now
            fsync(fd)  # the allocation itself survives a crash: a later entry's pwrite needs no new block
            fsync(dir_fd)  # the reserve's directory entry survives a crash
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while this writer runs: how others know it is alive
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            os.close(dir_fd)
            raise
        self._fd, self._dir_fd, self._name, self._id = fd, dir_fd, name, (st.st_dev, st.st_ino)
        self._end, self._pending, self._overflowed = 0, set(), False

    def record(self, rollout_id: str, mcids: list[str], reason: str, fsync: Fsync) -> int | None:
        """Write one pending entry; its offset, or ``None`` when the reserve is not open or is full (the
        overflow entry is written then, once) (contract D16)."""
        if self._fd is None:
            return None
        entry = _entry(rollout_id, mcids, reason)
        if self._end + len(entry) > RESERVE_BYTES - OVERFLOW_BYTES:
            if not self._overflowed:
                reason = "the loss reserve is full: more calls were lost than it names (see the writer's log)"
                overflow = _entry("", [], reason)[: OVERFLOW_BYTES - 1].rstrip(b"\n") + b"\n"
                os.pwrite(self._fd, overflow, RESERVE_BYTES - OVERFLOW_BYTES)
                fsync(self._fd)  # durable before the loss is reported to the caller as recorded
                self._overflowed = True
            return None
        offset = self._end
        written = os.pwrite(self._fd, entry, offset)
        if written != len(entry):
            raise OSError(errno.ENOSPC, f"{self.label}: short write into reserved space")
        fsync(self._fd)  # the loss must outlive a crash of this process: check reads it from disk
        self._end += len(entry)
        self._pending.add(offset)
        return offset

    def reported(self, offsets: list[int], fsync: Fsync) -> None:
        """The entries at ``offsets`` are in their markers now: flip them to reported (in place)."""
        if self._fd is None:
            return
        for offset in offsets:
            if offset in self._pending:
                os.pwrite(self._fd, REPORTED, offset)
                self._pending.discard(offset)
        fsync(self._fd)  # else a crash brings the entry back as pending: check fails, never hides a loss

    def overflow_reported(self, fsync: Fsync) -> None:
        """Every loss the reserve could not name is in its marker now."""
        if self._fd is not None and self._overflowed:
            os.pwrite(self._fd, REPORTED, RESERVE_BYTES - OVERFLOW_BYTES)
            fsync(self._fd)  # as in reported(): a lost flip only over-reports
            self._overflowed = False

    def close(self) -> None:
        """Unlink the reserve when nothing in it is pending (its inode and blocks are given back), else
        keep it: ``check`` goes on naming those losses, and another writer adopts them."""
        if self._fd is not None and self._dir_fd is not None and not self._pending and not self._overflowed:
            with contextlib.suppress(OSError):
                os.unlink(self._name, dir_fd=self._dir_fd)
        self.close_fds()

    def close_fds(self) -> None:
        fd, dir_fd, self._fd, self._dir_fd = self._fd, self._dir_fd, None, None
        for each in (fd, dir_fd):
            if each is not None:
                with contextlib.suppress(OSError):
                    os.close(each)


@dataclass
class Orphan:
    """A reserve whose writer is gone, locked ``LOCK_EX`` by its adopter until :meth:`done`."""

    fd: int
    dir_fd: int
    name: str
    losses: list[tuple[int, Loss]]

    def done(self, reported: list[int], fsync: Fsync) -> None:
        for offset in reported:
            os.pwrite(self.fd, REPORTED, offset)
        if reported:
            fsync(self.fd)  # flipped durably before the file may go
        try:
            if len(reported) == len(self.losses):
                os.unlink(self.name, dir_fd=self.dir_fd)
        finally:
            os.close(self.fd)


def orphans(dirs: DirFds, own: str) -> Iterator[Orphan]:
    """Reserves of writers that are gone (nobody holds their ``flock``), each locked while it is used.
    An orphan with nothing pending is unlinked at once (contract D15)."""
    try:
        dir_fd = dirs.state_fd(LOSSES_DIR)
        names = os.listdir(dir_fd)
    except OSError:
        return
    for name in names:
        if not name.endswith(LOSSES_SUFFIX) or name == own:
            continue
        try:
            fd, _ = open_file(dir_fd, name, os.O_RDWR, state_label(LOSSES_DIR, name))
        except OSError:
            continue
        try:
            # Exclusive and without waiting: it succeeds only when no writer holds the LOCK_SH it keeps on
            # its reserve while it runs (readers take no lock). Held until done(): one adopter at a time.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # its writer runs: it reports its own
            continue
        try:
            losses = list(_parse(read_all(fd), state_label(LOSSES_DIR, name)))
        except OSError:
            os.close(fd)
            continue
        yield Orphan(fd, dir_fd, name, losses)


__all__ = [
    "LOSSES_DIR",
    "RESERVE_BYTES",
    "Loss",
    "LossReserve",
    "orphans",
    "pending_for",
    "pending_losses",
]
