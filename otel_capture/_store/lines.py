"""A data file's lines as the readers see them: read whole under ``flock(LOCK_SH)`` (the lock NeMo Gym's
readers take: appenders hold ``LOCK_EX`` for a whole line, so every line is complete or was torn by a
writer that died), or streamed from below the size seen under that lock. A link, a FIFO or a device is
skipped and logged, never followed or waited on; a directory fails at once, as ``open()`` always did."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from .._errors import DamagedEntryError
from .._records.codec import chunked_lines, split_lines
from .fs import flock_within, open_file, read_shared

_logger = logging.getLogger(__name__)

__all__ = ["STREAM_CHUNK", "RawLines", "StreamedLines", "read_lines", "stream_lines"]


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
        try:
            yield from chunked_lines(self._chunks())
        finally:
            self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


def _open_data(path: Path) -> int | None:
    try:
        fd, _ = open_file(None, path, os.O_RDONLY, path.name, single_link=False)
    except FileNotFoundError:
        return None
    except DamagedEntryError as exc:
        if exc.what.startswith("a directory"):  # fails at once, as open() always did: not skipped
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path)) from None
        # A link or a FIFO: never followed or waited on; readers skip it (contract D25).
        _logger.warning("skipping %s: %s", path, exc.what)
        return None
    return fd


def read_lines(path: Path, lock_timeout: float) -> RawLines | None:
    """The file split into lines, read whole under ``flock(LOCK_SH)``; ``None`` if absent or skipped. A
    lock held by another process past ``lock_timeout`` raises :class:`LockTimeoutError`."""
    fd = _open_data(path)
    if fd is None:
        return None
    try:
        data = read_shared(fd, path.name, lock_timeout)
    finally:
        os.close(fd)
    return RawLines(*split_lines(data))


def stream_lines(path: Path, lock_timeout: float) -> StreamedLines | None:
    """The file as :func:`read_lines` sees it, without holding it in memory or holding its lock while the
    lines are used (``otel-capture show`` prints as it reads); ``None`` when absent or skipped."""
    fd = _open_data(path)
    if fd is None:
        return None
    try:
        flock_within(fd, fcntl.LOCK_SH, lock_timeout, path.name)
        try:
            size = os.fstat(fd).st_size
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    except BaseException:
        os.close(fd)
        raise
    return StreamedLines(fd, size)
