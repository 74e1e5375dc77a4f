"""Rollout correlation: the one id grammar and its carriers, in the order the middleware reads them: the
``/ng-rollout/<id>/`` URL prefix, the ``x-rollout-id`` header (for gateways that forward only ``x-*``
headers), then, each only when configured (:class:`RolloutRules`), the API key (``Authorization: Bearer``
or ``x-api-key``, through a pattern with a group ``rollout``) and the ``x-session-id`` header, and last the
W3C baggage entry ``rollout.id``. See ``docs/gateways.md``.

Every place that accepts a rollout id (middleware, store, collector) validates it with the one grammar
(:mod:`otel_capture._rollout_id`, on the bottom floor so the store below this package reads it too).
The API key's pattern is matched by RE2, in time linear in the key whatever the pattern, and must spell a
fixed text outside its group, so the id is never a whole key (:class:`ApiKeyRolloutPattern`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote

from .._key_pattern import ApiKeyRolloutPattern
from .._rollout_id import is_valid_rollout_id, validate_rollout_id

ROLLOUT_PATH_PREFIX = "ng-rollout"
BAGGAGE_ROLLOUT_KEY = "rollout.id"
ROLLOUT_ID_HEADER = "x-rollout-id"
SESSION_ID_HEADER = "x-session-id"
API_KEY_HEADER = "x-api-key"
# The mark the capturing layer puts on the request it passes on: a capture layer behind it (a proxy, a
# zero-code server) that sees it records nothing, so one call is one record however the layers stack.
CAPTURED_HEADER = "x-otel-capture"
CAPTURED_VALUE = "captured"

_API_KEY_HEADER = API_KEY_HEADER.encode()
_PREFIX = "/" + ROLLOUT_PATH_PREFIX + "/"


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


@dataclass(frozen=True, slots=True)
class RolloutRules:
    """The carriers read only when configured (``CaptureSettings``): the API key through ``api_key_pattern``
    (its group ``rollout``; the whole key must match), ``x-session-id``, and the key that replaces a
    matching one upstream (``None``: the key goes on as sent)."""

    api_key_pattern: ApiKeyRolloutPattern | None = None
    session_id: bool = False
    upstream_api_key: str | None = field(default=None, repr=False)


NO_RULES = RolloutRules()


@dataclass(frozen=True, slots=True)
class KeyMatch:
    """An API key the pattern matched: the rollout id it names (``None`` when the group breaks the
    grammar: never shown, it is part of a credential) and the headers with the key replaced upstream."""

    rollout_id: str | None
    headers: list[tuple[bytes, bytes]] | None  # None: forwarded as sent


def match_api_key(headers: list[tuple[bytes, bytes]], rules: RolloutRules) -> KeyMatch | None:
    """The first of ``Authorization: Bearer <key>`` and ``x-api-key: <key>`` whose key matches
    ``rules.api_key_pattern`` in full, or ``None``. The key itself is kept nowhere."""
    pattern = rules.api_key_pattern
    if pattern is None:
        return None
    rollout_id: str | None = None
    matched = False
    replaced = list(headers) if rules.upstream_api_key is not None else None
    for position, (name, value) in enumerate(headers):
        lowered = name.lower()
        if lowered == b"authorization":
            scheme, _, key = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer":
                continue
        elif lowered == _API_KEY_HEADER:
            key = value.decode("latin-1")
        else:
            continue
        found, group = pattern.rollout_group(key.strip())
        if not found:
            continue
        if not matched:
            matched, rollout_id = True, group
        if replaced is not None and rules.upstream_api_key is not None:  # every per-rollout key is replaced
            upstream = rules.upstream_api_key.encode("latin-1")
            replaced[position] = (name, b"Bearer " + upstream if lowered == b"authorization" else upstream)
    if not matched:
        return None
    return KeyMatch(rollout_id if is_valid_rollout_id(rollout_id) else None, replaced)


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
