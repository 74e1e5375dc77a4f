"""Where a capture directory keeps each rollout's files.

``<dir>/<rollout_id>.capture.jsonl`` holds one NeMo Gym ``ModelCallRecord`` line per call (append only,
``flock`` exclusive per append, shared per read, as NeMo Gym 0.7.0 does on the same files);
``<dir>/<rollout_id>.capture.incomplete`` exists when a call of that rollout could not be captured. NeMo Gym
only checks that the marker exists; we append one JSON line per failed call to it, saying which and why.
``<dir>/<rollout_id>.tokens.jsonl`` holds one token line per call whose upstream returned token ids or
log-probs (:mod:`._tokens`).

The lifecycle (freeze, drop, retire, delete; DESIGN §6) is :class:`._lifecycle.FileLifecycle`; its own
state lives in ``<dir>/.otel-capture/``, which NeMo Gym never reads (:mod:`._fences`).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from .._correlation import validate_rollout_id
from .fences import _no_hook
from .lifecycle import CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX, FileLifecycle

__all__ = ["CAPTURE_SUFFIX", "INCOMPLETE_SUFFIX", "TOKENS_SUFFIX", "CaptureStore", "RawLines"]


class RawLines(NamedTuple):
    """A data file split at ``\\n``: the complete lines (newline removed) and what follows the last one.

    A non-blank ``tail`` is a torn final line: a writer died (or the disk filled) mid-append.
    """

    lines: list[bytes]
    tail: bytes


class CaptureStore(FileLifecycle):
    """A capture directory and its lifecycle. Creating the object never touches the filesystem.

    ``fsync`` and ``crash_hook`` are seams for tests: a failing disk, and a callback named at each step of
    a lifecycle batch (crash tests SIGKILL the process there). Neither is a tuning knob.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: Callable[[int], None] = os.fsync,
        crash_hook: Callable[[str], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self._fsync = fsync
        self._hook = crash_hook or _no_hook

    def __repr__(self) -> str:
        return f"CaptureStore({str(self.root)!r})"

    def data_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + CAPTURE_SUFFIX)

    def incomplete_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + INCOMPLETE_SUFFIX)

    def tokens_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + TOKENS_SUFFIX)

    def is_incomplete(self, rollout_id: str) -> bool:
        return self.incomplete_path(rollout_id).exists()

    def rollout_ids(self) -> list[str]:
        """Every rollout with a data file or an incomplete marker, sorted."""
        if not self.root.is_dir():
            return []
        ids = set()
        for name in os.listdir(self.root):
            for suffix in (CAPTURE_SUFFIX, INCOMPLETE_SUFFIX):
                if name.endswith(suffix):
                    ids.add(name[: -len(suffix)])
        return sorted(ids)

    def read_token_lines(self, rollout_id: str) -> RawLines | None:
        """The rollout's token file split into lines (as :meth:`read_lines`); ``None`` if absent."""
        return self._read_split(self.tokens_path(rollout_id))

    def read_lines(self, rollout_id: str) -> RawLines | None:
        """The rollout's data file split into lines, read whole under ``flock(LOCK_SH)``; ``None`` if absent.

        The shared lock is the one NeMo Gym's readers take: appenders hold ``LOCK_EX`` for a whole line, so
        under it every line is either complete or was torn by a writer that died. One ``read()`` and one
        ``split`` cost no more than iterating the file, and make the torn tail plain to see.
        """
        return self._read_split(self.data_path(rollout_id))

    @staticmethod
    def _read_split(path: Path) -> RawLines | None:
        try:
            handle = path.open("rb")
        except FileNotFoundError:
            return None
        with handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH)
            try:
                data = handle.read()
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        lines = data.split(b"\n")
        tail = lines.pop()
        return RawLines(lines, tail)
