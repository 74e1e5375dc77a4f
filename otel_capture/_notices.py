"""The few notices a user must see even where the host silences logging.

vLLM (through a module it imports) sets the root logger to ERROR, and other hosts raise it too: a warning
from ``otel_capture`` then never reaches a handler, and "this model call has no rollout id" or "this
setting is ignored" vanish. :func:`notify` logs as usual when the logger is enabled for the level; when it
is not only because of the root logger's level (or ``logging.disable``), it writes the line to stderr
itself. A level set on ``otel_capture`` or one of its loggers is the user's choice about our logs, and is
obeyed. Only for the notices that say something is not captured or not as configured: rate-limited where
they can repeat, so never on a call's hot path.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

_FORMAT = "%(levelname)s %(name)s: %(message)s"


def notify(logger: logging.Logger, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
    """``logger.log(level, msg, *args)``, or the line on stderr when only the root logger's level (or
    ``logging.disable``) holds it back."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, *args, exc_info=exc_info)
        return
    if _level_chosen_for_us(logger):
        return
    record = logger.makeRecord(
        logger.name, level, "(notice)", 0, msg, args, sys.exc_info() if exc_info else None
    )
    handler = logging.StreamHandler(sys.stderr)  # the stderr of now (a test or the host may replace it)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.handle(record)


def _level_chosen_for_us(logger: logging.Logger) -> bool:
    """A level set on ``logger`` or a parent below the root: somebody chose what ours may say."""
    current: logging.Logger | None = logger
    while current is not None and current is not logging.root:
        if current.level != logging.NOTSET:
            return True
        current = current.parent
    return False


class RateLimitedNotice:
    """When to log a recurring condition: the first time, then at most once per interval, with the number
    of occurrences since the last line."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next_at: float | None = None
        self._held = 0

    def note(self) -> int | None:
        """``0`` the first time, ``None`` while held back, else the occurrences since the last line."""
        now = time.monotonic()
        if self._next_at is None:
            self._next_at = now + self._interval_s
            return 0
        self._held += 1
        if now < self._next_at:
            return None
        held, self._held = self._held, 0
        self._next_at = now + self._interval_s
        return held
