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
