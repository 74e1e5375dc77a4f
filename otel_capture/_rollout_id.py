"""The rollout id grammar, the one definition every place that accepts an id uses (middleware, store,
collector): an id that passes is a file name inside the capture directory (contract D38). On the bottom
floor, so the store validates ids without importing the correlation code above it."""

from __future__ import annotations

import re

from ._errors import InvalidRolloutIdError

__all__ = ["ROLLOUT_ID_PATTERN", "ROLLOUT_ID_RULE", "is_valid_rollout_id", "validate_rollout_id"]

ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
ROLLOUT_ID_RULE = "a rollout id is 1-200 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"

_ROLLOUT_ID_RE = re.compile(ROLLOUT_ID_PATTERN)


def is_valid_rollout_id(rollout_id: object) -> bool:
    return isinstance(rollout_id, str) and _ROLLOUT_ID_RE.fullmatch(rollout_id) is not None


def validate_rollout_id(rollout_id: object) -> str:
    """Return ``rollout_id`` if it follows the grammar, else raise :class:`InvalidRolloutIdError`."""
    if not is_valid_rollout_id(rollout_id):
        raise InvalidRolloutIdError(rollout_id, ROLLOUT_ID_RULE)
    return rollout_id  # type: ignore[return-value]  # narrowed by is_valid_rollout_id
