"""The weight (policy) version a trainer declares for a capture directory, and each process's view of it.

``.otel-capture/weight_versions``: one JSON line per declaration, ``{"version": "7", "at": <UTC Unix
seconds>}``, appended under the file's ``flock`` and synced (contract L20). The version in force at ``t``
is, of the declarations whose ``at`` is at most ``t``, the one written last; the version in force now is the
one written last (contract D40). Writers keep a view refreshed once per batch with one ``stat``, as they
keep the fence journal's, reading each appended byte once whatever the file holds. The rule of a usable version, the caller's included, is
:func:`validate_weight_version`.
"""

from __future__ import annotations

import bisect
import fcntl
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import orjson

from .._records.codec import stamp_record_line
from .fs import DirFds, flock_within, open_file, problem, write_all
from .names import STATE_DIR, WEIGHT_VERSIONS, state_label
from .sync import Fsync

_logger = logging.getLogger(__name__)

_LABEL = state_label(WEIGHT_VERSIONS)
MAX_VERSION_LENGTH = 200
MAX_LINE_BYTES = 4096
"""A declaration's line is at most about 1.2 KiB (200 characters, each up to 6 bytes escaped): a longer
line is damage, skipped without being kept."""

WeightStamp = tuple["str | None", "float | None", "float | None"]
"""What a line needs to be stamped: the caller's version (or ``None``), the call's start and end times."""


class _Stamped(Protocol):
    line: bytes
    weight: WeightStamp | None


def validate_weight_version(version: object) -> str:
    """A declared or sent version: a non-empty string (an ``int`` is taken as its decimal form) of at most
    200 printable characters, no surrounding spaces; else ``ValueError`` (``TypeError`` for another type)."""
    if isinstance(version, bool) or not isinstance(version, (str, int)):
        raise TypeError(f"a weight version is a string (or an int), not {type(version).__name__}")
    text = str(version)
    if not text or len(text) > MAX_VERSION_LENGTH or not text.isprintable() or text != text.strip():
        raise ValueError(
            f"invalid weight version {text[:64]!r}: 1-{MAX_VERSION_LENGTH} printable characters, "
            "no leading or trailing space"
        )
    return text


def usable_weight_version(text: str) -> str | None:
    """A version a caller sent (a header, baggage), stripped; ``None`` when it is not one by the rule of
    :func:`validate_weight_version` (the one rule of a usable version, for both sides)."""
    try:
        return validate_weight_version(text.strip())
    except ValueError:
        return None


def declare(dirs: DirFds, version: str, fsync: Fsync, at: float | None = None) -> None:
    """Append one declaration (the caller validated ``version``) and make it durable: under the file's
    exclusive ``flock`` (so two declaring processes never interleave a line), then ``fsync`` the file, and
    the state directory when this created the file (contract L20)."""
    line = orjson.dumps({"version": version, "at": time.time() if at is None else at}) + b"\n"
    state_fd = dirs.state_fd()
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT
    existed = True
    try:
        os.stat(WEIGHT_VERSIONS, dir_fd=state_fd, follow_symlinks=False)
    except FileNotFoundError:
        existed = False
    fd, _ = open_file(state_fd, WEIGHT_VERSIONS, flags, _LABEL)
    try:
        # why: two trainers (or a retry) declaring at once must each append a whole line
        flock_within(fd, fcntl.LOCK_EX, dirs.lock_timeout, _LABEL)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line  # a torn line from a crashed declarer stays one damaged line
            write_all(fd, line)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        fsync(fd)  # why: a declaration a crash could take back would leave records naming a lost version
    finally:
        os.close(fd)
    if not existed:
        fsync(state_fd)  # why: the new file's directory entry survives a crash too


class DeclaredVersions:
    """One process's view of a directory's declarations, refreshed with one ``stat`` when nothing changed.

    ``refresh`` is called by the writer thread (once per batch) and by the store; the middleware only reads
    :attr:`current`, a plain attribute (no I/O on the event loop)."""

    def __init__(self, root: Path) -> None:
        self.path = root / STATE_DIR / WEIGHT_VERSIONS
        self._lock = threading.Lock()
        self._ino: int | None = None
        self._offset = 0  # bytes read so far, the start of an unfinished line included
        self._partial = b""  # that unfinished line (at most MAX_LINE_BYTES; a longer one is skipped)
        self._skipping = False  # inside a line longer than MAX_LINE_BYTES: skipped up to its newline
        self._written: list[tuple[float, str]] = []  # (at, version) in the order written
        self._times: list[float] = []  # every ``at``, sorted
        self._latest: list[str] = []  # _latest[i]: the last written of the declarations at _times[: i + 1]
        self.current: str | None = None
        """The declaration written last, as of the last refresh (``None`` before any)."""

    def refresh(self) -> None:
        """Bring the view up to date: one ``stat`` when the file has not changed, else a read of the bytes
        appended since, whatever they hold (contract D40). A file that is not a regular file of its own is
        never read (logged once per change; the view keeps what it had)."""
        with self._lock:
            try:
                st = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                if self._ino is not None:
                    self._reset(None)
                return
            if st.st_ino == self._ino and st.st_size == self._offset:
                return
            what = problem(st, single_link=True)
            if what is not None:
                _logger.error("%s: %s: not read (the declared weight version is unknown)", _LABEL, what)
                return
            fd, st = open_file(None, self.path, os.O_RDONLY, _LABEL)
            try:
                if st.st_ino != self._ino or st.st_size < self._offset:
                    self._reset(st.st_ino)
                self._read_from(fd, st.st_size)
            finally:
                os.close(fd)

    def _reset(self, ino: int | None) -> None:
        self._ino, self._offset, self._partial, self._skipping = ino, 0, b"", False
        self._written, self._times, self._latest = [], [], []
        self.current = None

    def _read_from(self, fd: int, size: int) -> None:
        """Read what was appended since the last refresh, once: a line still being written is kept (up to
        :data:`MAX_LINE_BYTES`) and completed by the next read, never read again from its start."""
        known = len(self._written)
        while self._offset < size:
            chunk = os.pread(fd, min(1 << 16, size - self._offset), self._offset)
            if not chunk:
                break
            self._offset += len(chunk)
            start = 0
            while (end := chunk.find(b"\n", start)) != -1:
                if self._skipping:
                    self._skipping = False  # the end of a line too long to be a declaration
                else:
                    line, self._partial = self._partial + chunk[start:end], b""
                    if line.strip():
                        self._apply(line)
                start = end + 1
            if not self._skipping:
                self._partial += chunk[start:]
                if len(self._partial) > MAX_LINE_BYTES:
                    _logger.warning(
                        "%s: a damaged declaration is skipped: a line longer than %d bytes",
                        _LABEL,
                        MAX_LINE_BYTES,
                    )
                    self._partial, self._skipping = b"", True
        if len(self._written) > known:
            self._index(known)

    def _apply(self, line: bytes) -> None:
        try:
            value = orjson.loads(line)
            version = validate_weight_version(value["version"])
            at = float(value["at"])
            if not math.isfinite(at):
                raise ValueError("at is not finite")
        except (orjson.JSONDecodeError, TypeError, KeyError, ValueError) as exc:
            _logger.warning("%s: a damaged declaration is skipped: %s", _LABEL, exc)
            return
        self._written.append((at, version))

    def _index(self, known: int) -> None:
        """Index the declarations from ``known`` on: appended in time order (the usual case) they are
        added at the end; one dated before an earlier one (a node's clock behind, or ahead before it)
        makes the index be rebuilt, once per refresh."""
        self.current = self._written[-1][1]  # the last one written is the one in force now
        times = [self._times[-1]] if self._times else []
        times += [at for at, _ in self._written[known:]]
        if all(earlier <= later for earlier, later in itertools.pairwise(times)):
            for at, version in self._written[known:]:
                self._times.append(at)
                self._latest.append(version)  # written after every one before: it wins from its time on
            return
        order = sorted(range(len(self._written)), key=lambda i: self._written[i][0])
        self._times = [self._written[i][0] for i in order]
        self._latest, winner = [], -1
        for i in order:
            winner = max(winner, i)
            self._latest.append(self._written[winner][1])

    def at(self, when: float | None) -> str | None:
        """The version in force at ``when`` (UTC Unix seconds): of the declarations dated at or before it,
        the one written last (a declaration written later replaces it, even dated earlier: a clock ahead
        never keeps a version in force after the next declaration); ``None`` before the first, or for an
        unknown time."""
        if when is None:
            return None
        index = bisect.bisect_right(self._times, when)
        return self._latest[index - 1] if index else None


def stamp_batch(view: DeclaredVersions, items: Iterable[_Stamped]) -> None:
    """The writer's hook, once per batch: refresh the view (one ``stat``), then add the declared versions
    to each line that asks for them (:attr:`_Stamped.weight`): ``weight_version`` (in force when the call
    started; only when the caller sent none) and ``weight_version_at_end`` (in force when it finished; only
    when it differs from the one in force when it started: the weights changed while it ran, whatever
    version the caller sent). Never raises: a view that cannot be read leaves the lines as they are (logged)."""
    try:
        view.refresh()
    except Exception as exc:  # the records are written either way; only their declared version is unknown
        _logger.error("cannot read %s: %s; records of this batch carry the last version seen", _LABEL, exc)
    if not view.current:
        return  # nothing ever declared: nothing to add
    for item in items:
        weight = item.weight
        if weight is None:
            continue
        caller, started_at, completed_at = weight
        declared = view.at(started_at)
        values: dict[str, str] = {}
        if caller is None and declared is not None:
            values["weight_version"] = declared
        at_end = view.at(completed_at)
        if at_end is not None and at_end != declared:  # the weights changed while the call ran
            values["weight_version_at_end"] = at_end
        if values:
            try:
                item.line = stamp_record_line(item.line, values)
            except (KeyError, ValueError) as exc:  # a line not from the codec: written as it is
                _logger.error("cannot add the weight version to a line: %s", exc)
