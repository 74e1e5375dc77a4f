"""How :class:`.writer.JsonlWriter`'s thread ends calls whose line does not reach the disk: a failed batch
or append fails its calls and marks the rollout incomplete with the reason (best effort, logged either
way), an abandoned call is counted and marked incomplete, and a discarded call (a redirect) has its ``-``
marker written if its ``+`` was.

:class:`WriterFailures` is a base class of the writer, so these methods run on the writer thread with the
writer's state, exactly as when they were written inside it.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .dirstate import DirState
from .journal import Fence
from .lifecycle_io import fenced_mark_incomplete
from .types import UnsafeDirectoryError
from .writer_items import _Abandon, _Discard, _Item

if TYPE_CHECKING:
    from .writer import WriterStats

# The writer's own logger: its failures are logged under the writer's name.
_logger = logging.getLogger("otel_capture._store.writer")


class WriterFailures:
    """The failure and incomplete-marking half of :class:`.writer.JsonlWriter` (which sets the attributes
    below and resolves items)."""

    stats: WriterStats
    _state: DirState
    _lock_timeout: float
    _fsync: Callable[[int], None]
    _file_mode: int

    if TYPE_CHECKING:

        def _resolve(self, item: _Item, error: BaseException | None = None) -> None: ...

    def _fail_all(self, items: list[_Item], exc: OSError) -> None:
        if isinstance(exc, UnsafeDirectoryError):  # refused: not even an incomplete marker is written there
            self.stats.failures += len(items)
            self.stats.last_failure = str(exc)
            _logger.error("capture of %d call(s) failed: %s", len(items), exc)
            for item in items:
                self._resolve(item, exc)
            return
        by_rollout: dict[str, list[_Item]] = {}
        for item in items:
            by_rollout.setdefault(item.rollout_id, []).append(item)
        for rollout_id, group in by_rollout.items():
            self._fail(rollout_id, group, exc)

    def _fail(self, rollout_id: str, items: list[_Item], exc: OSError) -> None:
        reason = _describe(exc)
        self.stats.failures += len(items)
        self.stats.last_failure = reason
        _logger.error("capture of %d call(s) of rollout %s failed: %s", len(items), rollout_id, reason)
        self._mark_incomplete(rollout_id, [item.model_call_id for item in items], reason)
        for item in items:
            self._resolve(item, exc)

    def _fail_append(self, rollout_id: str, items: list[_Item], begun: list[str], exc: OSError) -> None:
        """A rollout's append failed: its lines fail, and the calls begun without their ``+`` marker are
        marked incomplete too (a freeze in another process could not see them in flight)."""
        if items:
            self._fail(rollout_id, items, exc)
        in_batch = {item.model_call_id for item in items}
        unmarked = [mcid for mcid in begun if mcid not in in_batch]
        if unmarked:
            reason = f"in-flight marker not written: {_describe(exc)}"
            _logger.error("rollout %s: %s", rollout_id, reason)
            self._mark_incomplete(rollout_id, unmarked, reason)

    def _abandon(self, abandoned: _Abandon) -> None:
        self.stats.failures += 1
        self.stats.last_failure = abandoned.reason  # logged by the middleware, with its traceback
        self._mark_incomplete(abandoned.rollout_id, [abandoned.model_call_id], abandoned.reason)

    def _discard(self, discarded: _Discard) -> None:
        rid, mcid = discarded.rollout_id, discarded.model_call_id
        try:
            if discarded.marked:  # its "+" is on disk: a freeze elsewhere must not take it for in flight
                with (
                    self._state.dirs(lock_timeout=self._lock_timeout) as dirs,
                    self._state.locks.hold_ids(dirs, [rid]),
                ):
                    self._state.markers.write(dirs, rid, [], [mcid])
        except OSError as exc:
            _logger.error("could not end the in-flight marker of rollout %s, call %s: %s", rid, mcid, exc)
        finally:
            self._state.calls.end(rid, [mcid])

    def _mark_incomplete(self, rollout_id: str, model_call_ids: list[str], reason: str) -> None:
        try:
            with self._state.dirs(lock_timeout=self._lock_timeout) as dirs:
                fenced_mark_incomplete(
                    self._state,
                    dirs,
                    rollout_id,
                    [(mcid, reason) for mcid in model_call_ids],
                    fsync=self._fsync,
                    check=self._fence,
                    file_mode=self._file_mode,
                )
        except OSError as exc:
            # The disk that refused the record may refuse the marker too; the log line is all that is left.
            _logger.error("could not mark rollout %s incomplete: %s", rollout_id, exc)

    def _fence(self, rollout_id: str) -> Fence | None:
        self._state.journal.refresh()
        return self._state.journal.fence(rollout_id)


def _describe(exc: OSError) -> str:
    return f"{type(exc).__name__}: {errno.errorcode.get(exc.errno or 0, '')} {exc.strerror or exc}".strip()
