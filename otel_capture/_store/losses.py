"""The loss reserve: where a writer says a call was lost when even its incomplete mark cannot be written
(no inode for a marker, no block for its line, the directory unreachable)
(contract D13, D14, D15, D16, D41, D42, D43, D44).

* ``.otel-capture/losses/<pid>-<random>.losses``, given :data:`RESERVE_BYTES` of blocks at creation
  (``posix_fallocate``), so an entry later needs no inode and no free block. A writer has it before it
  acknowledges its first call; a clean stop hands it on as ``<random>.spare`` (its blocks kept), which the
  next writer takes by a rename: a writer restarted on a full disk needs no new inode for it.
* An entry is one line ``!{"rollout_id", "calls", "reason", "at"}``, one ``pwrite`` and ``fsync``; once
  its marks are in the marker, its ``!`` becomes ``.`` in place (reported). A pending entry is a
  :class:`Loss`. The last :data:`OVERFLOW_BYTES` hold one overflow entry (``"overflow": true``).
* An entry read back is input like any other: one that is not a loss or names an id the front door would
  refuse is never opened a file for; its adopter turns its ``!`` into ``x`` (set aside) and renames a
  reserve holding such entries ``<name>.set-aside``: named by ``check``, never adopted again.
* The writer holds ``flock(LOCK_SH)`` on its reserve while it runs; a reserve nobody holds is an orphan,
  adopted by the next writer. Readers read every reserve without a lock.
* A writer that cannot keep a loss in the directory (its reserve cannot be made or written, the directory
  is cut off) keeps it in its node-local reserve, the same format in
  ``<OTEL_CAPTURE_LOCAL_RESERVE_DIR>/<name>-<hash>/`` (:func:`local_reserve_dir`), until the directory
  takes the marks; a writer that has nowhere holds ``flock(LOCK_SH)`` on the capture directory itself
  while it keeps losses in memory only (:func:`held_in_memory`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from .._rollout_id import is_valid_rollout_id
from .._settings import local_reserve_dir_from_environ
from .fs import FILE_MODE, DirFds, open_file, read_all, still_named
from .names import (
    LOSSES_DIR,
    LOSSES_SET_ASIDE_SUFFIX,
    LOSSES_SPARE_SUFFIX,
    LOSSES_SUFFIX,
    STATE_DIR,
    state_label,
)
from .sync import Fsync

_logger = logging.getLogger(__name__)

RESERVE_BYTES = 64 * 1024
"""Blocks reserved per writer: about 250 entries of 250 bytes (an entry names up to :data:`MAX_IDS` calls)."""
OVERFLOW_BYTES = 256
MAX_IDS = 8
"""Call ids named per entry; further calls of the same failure are counted (``"more"``)."""
MAX_SPARES = 8
"""Reserves kept handed on in a directory at most (each :data:`RESERVE_BYTES`); a stop past it unlinks."""
PENDING = b"!"
REPORTED = b"."
SET_ASIDE = b"x"
_ENTRY_STARTS = (PENDING, REPORTED, SET_ASIDE)

Label = Callable[[str], str]
"""How a reserve file of a directory is named in messages (relative to the capture directory, or a path)."""


def shared_label(name: str) -> str:
    return state_label(LOSSES_DIR, name)


@dataclass(frozen=True)
class Loss:
    """A loss recorded in a reserve and not yet in its rollout's marker (``rollout_id`` ``""``: overflow).
    ``problem`` says why an entry is not a loss of any rollout one may open a file for (then
    ``rollout_id`` is ``""`` and the problem quotes what the entry named), or why it was set aside."""

    rollout_id: str
    model_call_ids: tuple[str, ...]
    reason: str
    more: int = 0
    """Calls of the same failure not named in ``model_call_ids``."""
    source: str = ""
    """The reserve file, relative to the capture directory (or its path, for a node-local reserve)."""
    problem: str = ""

    def calls(self) -> str:
        more = f" and {self.more} more" if self.more else ""
        return f"{', '.join(self.model_call_ids) or 'calls'}{more}"

    def describe(self) -> str:
        return f"{self.calls()}: {self.reason} (not yet in the marker; recorded in {self.source})"


@dataclass
class Reserves:
    """What every reserve of a directory holds, as ``check`` reports it."""

    pending: list[Loss] = field(default_factory=list)
    """Losses not yet in their markers (contract D14)."""
    unsettled: list[Loss] = field(default_factory=list)
    """Entries a writer will set aside when it adopts their reserve (contract D41)."""
    set_aside: list[Loss] = field(default_factory=list)
    """Entries set aside: named here, never adopted again (contract D41)."""


def _entry(rollout_id: str, mcids: list[str], reason: str) -> bytes:
    value: dict[str, object] = {"rollout_id": rollout_id, "calls": mcids[:MAX_IDS], "reason": reason}
    if len(mcids) > MAX_IDS:
        value["more"] = len(mcids) - MAX_IDS
    value["at"] = round(time.time(), 3)
    return PENDING + orjson.dumps(value) + b"\n"


def _parse(data: bytes, source: str) -> Iterator[tuple[int, bytes, Loss]]:
    """``(offset, state, loss)`` of every complete pending or set-aside entry of a reserve's bytes, the
    overflow slot last."""
    yield from _parse_from(data[: RESERVE_BYTES - OVERFLOW_BYTES], 0, source)
    if len(data) >= RESERVE_BYTES:
        yield from _parse_from(data[:RESERVE_BYTES], RESERVE_BYTES - OVERFLOW_BYTES, source)


def _parse_from(data: bytes, offset: int, source: str) -> Iterator[tuple[int, bytes, Loss]]:
    while offset < len(data) and (state := data[offset : offset + 1]) in _ENTRY_STARTS:
        end = data.find(b"\n", offset)
        if end == -1:
            return  # being written: read next time
        if state != REPORTED:
            try:
                value = orjson.loads(data[offset + 1 : end])
            except orjson.JSONDecodeError:
                value = None
            yield offset, state, _loss(value, source, state)
        offset = end + 1


def _loss(value: object, source: str, state: bytes) -> Loss:
    """An entry as read back: checked as the front door checks an id, before anything uses it (D41)."""
    if not isinstance(value, dict):
        return Loss("", (), "a damaged entry", source=source, problem="a damaged entry, not a loss record")
    calls = value.get("calls")
    mcids = tuple(str(c)[:200] for c in calls if isinstance(c, str)) if isinstance(calls, list) else ()
    more = value.get("more")
    reason = value.get("reason")
    loss = Loss(
        "",
        mcids,
        str(reason)[:500] if isinstance(reason, str) and reason else "capture failed",
        more if isinstance(more, int) and not isinstance(more, bool) and more > 0 else 0,
        source,
    )
    rid = value.get("rollout_id")
    if rid not in (None, "") and not is_valid_rollout_id(rid):
        return dataclasses.replace(loss, problem=f"it names an invalid rollout id {str(rid)[:80]!r}")
    rid = rid if isinstance(rid, str) else ""
    if state == SET_ASIDE:
        problem = "its rollout's incomplete marker could not be written"
        return dataclasses.replace(loss, rollout_id=rid, problem=problem)
    return dataclasses.replace(loss, rollout_id=rid)


def local_reserve_dir(root: str | os.PathLike[str], base: str | os.PathLike[str] | None = None) -> Path:
    """The node-local reserve of capture directory ``root``: ``<base>/<its name>-<hash of its real path>``,
    ``base`` the setting ``OTEL_CAPTURE_LOCAL_RESERVE_DIR`` by default (contract D44)."""
    real = os.path.realpath(root)
    digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:16]
    name = os.path.basename(real)[:48] or "root"
    return Path(local_reserve_dir_from_environ() if base is None else base) / f"{name}-{digest}"


def _open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise


def read_reserves(
    root: str | os.PathLike[str], local_base: str | os.PathLike[str] | None = None, *, shared: bool = True
) -> Reserves:
    """Every entry of every reserve of ``root``, the node-local ones of this node included (no lock,
    nothing created; a reserve that is not a regular file is skipped); with ``shared=False`` this node's
    own only, for a directory this node cannot reach (contract D44)."""
    found = Reserves()
    local = local_reserve_dir(root, local_base)
    places: list[tuple[Path, Callable[[str], str]]] = [(local, lambda n: str(local / n))]
    if shared:
        places.insert(0, (Path(root) / STATE_DIR / LOSSES_DIR, shared_label))
    for path, label in places:
        dir_fd = _open_dir(path)
        if dir_fd is None:
            continue
        try:
            for name in sorted(os.listdir(dir_fd)):
                settled = name.endswith(LOSSES_SET_ASIDE_SUFFIX)
                if not settled and not name.endswith(LOSSES_SUFFIX):
                    continue
                try:
                    fd, _ = open_file(dir_fd, name, os.O_RDONLY, label(name), single_link=False)
                except OSError:  # gone meanwhile, or not a regular file: nothing of ours
                    continue
                try:
                    data = _used(fd)
                finally:
                    os.close(fd)
                for _, state, loss in _parse(data, label(name)):
                    if settled or state == SET_ASIDE:
                        found.set_aside.append(loss)
                    elif loss.problem:
                        found.unsettled.append(loss)
                    else:
                        found.pending.append(loss)
        finally:
            os.close(dir_fd)
    return found


def pending_losses(root: str | os.PathLike[str]) -> list[Loss]:
    """Every pending loss of every reserve of ``root``, this node's node-local ones included. ``[]`` when
    there is none."""
    return read_reserves(root).pending


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
    if slot[:1] in _ENTRY_STARTS:
        data = data.ljust(RESERVE_BYTES - OVERFLOW_BYTES, b"\0") + slot
    return data


def pending_for(root: str | os.PathLike[str], rollout_id: str) -> list[Loss]:
    """The pending losses of one rollout; an overflow entry (rollout unknown) counts for every rollout
    (contract D14)."""
    return [loss for loss in pending_losses(root) if loss.rollout_id in (rollout_id, "")]


def held_in_memory(root: str | os.PathLike[str]) -> bool:
    """Whether a running writer holds losses of ``root`` it could write nowhere: it holds
    ``flock(LOCK_SH)`` on the directory while it does (contract D43)."""
    dir_fd = _open_dir(Path(root))
    if dir_fd is None:
        return False
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(dir_fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(dir_fd)


class LossReserve:
    """One writer's reserve file (in the capture directory, or node-local). Used by the writer thread only."""

    def __init__(self, file_mode: int = FILE_MODE, label: Label = shared_label) -> None:
        self._file_mode = file_mode
        self._label = label
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
        return self._label(self._name)

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def ready(self, dirs: DirFds) -> bool:
        """Whether the reserve is open and still named in this capture directory (not removed with it)."""
        try:
            here = dirs.state_fd(LOSSES_DIR)
        except OSError:
            return False
        return self.ready_in(here)

    def ready_in(self, dir_fd: int) -> bool:
        """Whether the reserve is open and still named in the directory ``dir_fd``."""
        if self._fd is None or self._dir_fd is None:
            return False
        return still_named(dir_fd, self._name, *self._id) is not None

    def open(self, dirs: DirFds, fsync: Fsync) -> None:
        """:meth:`open_in` the capture directory's reserves (``.otel-capture/losses/``)."""
        self.open_in(dirs.state_fd(LOSSES_DIR), fsync)

    def open_in(self, dir_fd: int, fsync: Fsync) -> None:
        """Take a reserve handed on in ``dir_fd`` (a rename: no new inode), else create and reserve a fresh
        file; the old one, if any, is let go (its directory was removed) (contract D13, D42)."""
        self.close_fds()
        dir_fd = os.dup(dir_fd)
        name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}{LOSSES_SUFFIX}"
        try:
            taken = self._take_spare(dir_fd, name, fsync) or self._create(dir_fd, name, fsync)
        except BaseException:
            os.close(dir_fd)
            raise
        fd, st = taken
        self._fd, self._dir_fd, self._name, self._id = fd, dir_fd, name, (st.st_dev, st.st_ino)
        self._end, self._pending, self._overflowed = 0, set(), False

    def _create(self, dir_fd: int, name: str, fsync: Fsync) -> tuple[int, os.stat_result]:
        fd, st = open_file(
            dir_fd, name, os.O_RDWR | os.O_CREAT | os.O_EXCL, self._label(name), mode=self._file_mode
        )
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)  # the blocks an entry will need, taken now
            fsync(fd)  # the allocation itself survives a crash: a later entry's pwrite needs no new block
            fsync(dir_fd)  # the reserve's directory entry survives a crash
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while this writer runs: how others know it is alive
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise
        return fd, st

    def _take_spare(self, dir_fd: int, name: str, fsync: Fsync) -> tuple[int, os.stat_result] | None:
        """A reserve a stopped writer handed on, renamed to ``name`` (contract D42), or ``None``."""
        for spare in sorted(n for n in os.listdir(dir_fd) if n.endswith(LOSSES_SPARE_SUFFIX)):
            try:
                fd, st = open_file(dir_fd, spare, os.O_RDWR, self._label(spare))
            except OSError:
                continue
            try:
                if st.st_size < RESERVE_BYTES or st.st_blocks * 512 < RESERVE_BYTES:
                    raise OSError(errno.EINVAL, "not a whole reserve")
                os.pwrite(fd, bytes(RESERVE_BYTES), 0)  # its old entries gone, in blocks it already has
                fsync(fd)
                # Locked before it is named as a reserve: no adopter can take it for an orphan. Two writers
                # taking the same spare both lock it; only one rename succeeds.
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                os.rename(spare, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                fsync(dir_fd)
            except OSError:
                os.close(fd)
                continue
            return fd, st
        return None

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

    def close(self, *, hand_on: bool = False) -> None:
        """Keep the reserve when something in it is pending (``check`` goes on naming those losses, and
        another writer adopts them); else hand it on (``hand_on``: renamed a spare, blocks and inode kept for
        the next writer) or unlink it (contract D42)."""
        if self._fd is not None and self._dir_fd is not None and not self._pending and not self._overflowed:
            settle(self._dir_fd, self._name, hand_on=hand_on)
        self.close_fds()

    def close_fds(self) -> None:
        fd, dir_fd, self._fd, self._dir_fd = self._fd, self._dir_fd, None, None
        for each in (fd, dir_fd):
            if each is not None:
                with contextlib.suppress(OSError):
                    os.close(each)


def settle(dir_fd: int, name: str, *, hand_on: bool, set_aside: bool = False) -> None:
    """A reserve with nothing pending any more: renamed ``.set-aside`` when it holds entries set aside,
    a spare when ``hand_on`` and the directory has fewer than :data:`MAX_SPARES`, else unlinked. No sync:
    a rename a crash takes back leaves a reserve nobody holds, which the next writer settles again."""
    stem = name.removesuffix(LOSSES_SUFFIX)
    with contextlib.suppress(OSError):
        if set_aside:
            os.rename(name, stem + LOSSES_SET_ASIDE_SUFFIX, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return
        spares = sum(n.endswith(LOSSES_SPARE_SUFFIX) for n in os.listdir(dir_fd)) if hand_on else MAX_SPARES
        if spares < MAX_SPARES:
            spare = f"{uuid.uuid4().hex[:12]}{LOSSES_SPARE_SUFFIX}"
            os.rename(name, spare, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)


@dataclass
class Orphan:
    """A reserve whose writer is gone, locked ``LOCK_EX`` by its adopter until :meth:`done`."""

    fd: int
    dir_fd: int
    name: str
    losses: list[tuple[int, Loss]]
    """Its pending entries; one with a ``problem`` is to be set aside, never used (contract D41)."""
    had_set_aside: bool

    def done(self, reported: list[int], set_aside: list[int], fsync: Fsync, *, hand_on: bool) -> None:
        for offset in reported:
            os.pwrite(self.fd, REPORTED, offset)
        for offset in set_aside:
            os.pwrite(self.fd, SET_ASIDE, offset)
        if reported or set_aside:
            fsync(self.fd)  # flipped durably before the file may go
        try:
            if len(reported) + len(set_aside) == len(self.losses):
                settle(
                    self.dir_fd, self.name, hand_on=hand_on, set_aside=bool(set_aside) or self.had_set_aside
                )
        finally:
            os.close(self.fd)


def orphans(dir_fd: int, own: str, label: Label = shared_label) -> Iterator[Orphan]:
    """Reserves in ``dir_fd`` of writers that are gone (nobody holds their ``flock``), each locked while it
    is used (contract D15)."""
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return
    for name in names:
        if not name.endswith(LOSSES_SUFFIX) or name == own:
            continue
        try:
            fd, _ = open_file(dir_fd, name, os.O_RDWR, label(name))
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
            entries = list(_parse(read_all(fd), label(name)))
        except OSError:
            os.close(fd)
            continue
        pending = [(offset, loss) for offset, state, loss in entries if state == PENDING]
        yield Orphan(fd, dir_fd, name, pending, len(pending) < len(entries))


__all__ = [
    "LOSSES_DIR",
    "RESERVE_BYTES",
    "Loss",
    "LossReserve",
    "Reserves",
    "held_in_memory",
    "local_reserve_dir",
    "orphans",
    "pending_for",
    "pending_losses",
    "read_reserves",
]
