"""The weight (policy) version a trainer declares for a capture directory, and each process's view of it.

``.otel-capture/weight_versions``: one JSON line per declaration, ``{"version": "7", "at": <UTC Unix
seconds>}``, appended under the file's ``flock`` and synced (contract L20). The version in force at ``t``
is the last declaration whose ``at`` is at most ``t``. Writers keep a view refreshed once per batch with
one ``stat``, as they keep the fence journal's. The rule of a usable version, the caller's included, is
:func:`validate_weight_version`.
"""

from __future__ import annotations

import bisect
import fcntl
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
        self._offset = 0
        self._times: list[float] = []
        self._versions: list[str] = []
        self.current: str | None = None
        """The last declaration as of the last refresh (``None`` before any)."""

    def refresh(self) -> None:
        """Bring the view up to date: one ``stat`` when the file has not changed. A file that is not a
        regular file of its own is never read (logged once per change; the view keeps what it had)."""
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
                self._read_from(fd)
            finally:
                os.close(fd)

    def _reset(self, ino: int | None) -> None:
        self._ino, self._offset = ino, 0
        self._times, self._versions = [], []
        self.current = None

    def _read_from(self, fd: int) -> None:
        data = b""
        while chunk := os.pread(fd, 1 << 16, self._offset + len(data)):
            data += chunk
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        for line in data[:end].split(b"\n"):
            if line.strip():
                self._apply(line)
        self._offset += end

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
        index = bisect.bisect_right(self._times, at)  # clocks of two declaring nodes may disagree
        self._times.insert(index, at)
        self._versions.insert(index, version)
        self.current = self._versions[-1]

    def at(self, when: float | None) -> str | None:
        """The version in force at ``when`` (UTC Unix seconds): the last declaration made at or before it;
        ``None`` before the first, or for an unknown time."""
        if when is None:
            return None
        index = bisect.bisect_right(self._times, when)
        return self._versions[index - 1] if index else None


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
