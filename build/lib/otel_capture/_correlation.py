"""Rollout correlation: the one id grammar and its three carriers, in the order the middleware reads them:
the ``/ng-rollout/<id>/`` URL prefix, the ``x-rollout-id`` header (for gateways that forward only ``x-*``
headers), and the W3C baggage entry ``rollout.id``. See ``docs/gateways.md``.

Every place that accepts a rollout id (middleware, store, collector) validates it here, with the same rule.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator
from urllib.parse import unquote

from ._errors import CaptureError

ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
ROLLOUT_ID_RULE = "a rollout id is 1-200 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"
ROLLOUT_PATH_PREFIX = "ng-rollout"
BAGGAGE_ROLLOUT_KEY = "rollout.id"
ROLLOUT_ID_HEADER = "x-rollout-id"
# The mark the capturing layer puts on the request it passes on: a capture layer behind it (a proxy, a
# zero-code server) that sees it records nothing, so one call is one record however the layers stack.
CAPTURED_HEADER = "x-otel-capture"
CAPTURED_VALUE = "captured"

_ROLLOUT_ID_RE = re.compile(ROLLOUT_ID_PATTERN)
_PREFIX = "/" + ROLLOUT_PATH_PREFIX + "/"


class InvalidRolloutIdError(CaptureError, ValueError):
    """A rollout id that breaks :data:`ROLLOUT_ID_PATTERN`."""

    def __init__(self, rollout_id: object) -> None:
        super().__init__(f"invalid rollout id {rollout_id!r}: {ROLLOUT_ID_RULE}")
        self.rollout_id = rollout_id


def is_valid_rollout_id(rollout_id: object) -> bool:
    return isinstance(rollout_id, str) and _ROLLOUT_ID_RE.fullmatch(rollout_id) is not None


def validate_rollout_id(rollout_id: object) -> str:
    """Return ``rollout_id`` if it follows the grammar, else raise :class:`InvalidRolloutIdError`."""
    if not is_valid_rollout_id(rollout_id):
        raise InvalidRolloutIdError(rollout_id)
    return rollout_id  # type: ignore[return-value]  # narrowed by is_valid_rollout_id


def split_rollout_prefix(path: str) -> tuple[str, str] | None:
    """Split the raw (percent-encoded) ``/ng-rollout/<id>/rest`` into ``(id, "/rest")``: the id decoded,
    the rest still raw; ``None`` when there is no prefix.

    The id is returned percent-decoded and *unvalidated*: the caller answers 400 for a bad one, so that
    ``/ng-rollout/a%2Fb/v1/...`` is refused rather than silently routed.
    """
    if not path.startswith(_PREFIX):
        return None
    rest_start = path.find("/", len(_PREFIX))
    if rest_start == -1:
        return unquote(path[len(_PREFIX) :]), "/"
    return unquote(path[len(_PREFIX) : rest_start]), path[rest_start:]


def rollout_id_from_baggage(header_values: list[bytes]) -> str | None:
    """The ``rollout.id`` entry of W3C ``baggage`` header values, or ``None``.

    Parsed by hand (it is a comma-separated list of ``key=value;props``) because the middleware must
    read it even when no propagator extracted it into the context.
    """
    for raw in header_values:
        for member in raw.decode("latin-1").split(","):
            key, sep, value = member.partition("=")
            if sep and key.strip() == BAGGAGE_ROLLOUT_KEY:
                return unquote(value.split(";", 1)[0].strip())
    return None


def rollout_id_from_header(header_values: list[bytes]) -> str | None:
    """The ``x-rollout-id`` header's value (unvalidated), or ``None`` when it is absent. Repeated headers
    with different values join with ``,``, which the grammar refuses."""
    values = dict.fromkeys(v.decode("latin-1").strip() for v in header_values)
    return ",".join(values) if values else None


def rollout_path_prefix(rollout_id: str) -> str:
    return _PREFIX + validate_rollout_id(rollout_id)


_current_rollout_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "otel_capture_rollout_id", default=None
)


def current_rollout_id() -> str | None:
    """The rollout id set by :func:`rollout_context` in this task or thread, if any."""
    return _current_rollout_id.get()


@contextlib.contextmanager
def rollout_context(rollout_id: str | None) -> Iterator[str | None]:
    """Make ``rollout_id`` the current rollout for the calls made inside the block (validated; ``None``
    clears it). Agent-side integrations (the httpx baggage hook) read it with :func:`current_rollout_id`."""
    if rollout_id is not None:
        validate_rollout_id(rollout_id)
    token = _current_rollout_id.set(rollout_id)
    try:
        yield rollout_id
    finally:
        _current_rollout_id.reset(token)
