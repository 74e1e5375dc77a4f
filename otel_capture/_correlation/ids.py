"""Rollout correlation: the one id grammar and its carriers, in the order the middleware reads them: the
``/ng-rollout/<id>/`` URL prefix, the ``x-rollout-id`` header (for gateways that forward only ``x-*``
headers), then, each only when configured (:class:`RolloutRules`), the API key (``Authorization: Bearer``
or ``x-api-key``, through a pattern with a group ``rollout``) and the ``x-session-id`` header, and last the
W3C baggage entry ``rollout.id``. See ``docs/gateways.md``.

Every place that accepts a rollout id (middleware, store, collector) validates it here, with the same rule.
The API key's pattern is matched by RE2, in time linear in the key whatever the pattern, and must spell a
fixed text outside its group, so the id is never a whole key (:class:`ApiKeyRolloutPattern`).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

# google-re2 ships no type hints: its compiled pattern is kept behind ApiKeyRolloutPattern's typed methods
import re2  # type: ignore[import-untyped]

from .._errors import InvalidRolloutIdError

if sys.version_info >= (3, 11):
    # typeshed stubs only the deprecated alias sre_parse (which warns on import since 3.11)
    from re import _parser as _re_parser  # type: ignore[attr-defined]
else:  # pragma: no cover - Python 3.10
    import sre_parse as _re_parser

ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
ROLLOUT_ID_RULE = "a rollout id is 1-200 characters of A-Z a-z 0-9 . _ -, starting with a letter or digit"
ROLLOUT_PATH_PREFIX = "ng-rollout"
BAGGAGE_ROLLOUT_KEY = "rollout.id"
ROLLOUT_ID_HEADER = "x-rollout-id"
SESSION_ID_HEADER = "x-session-id"
API_KEY_HEADER = "x-api-key"
# The mark the capturing layer puts on the request it passes on: a capture layer behind it (a proxy, a
# zero-code server) that sees it records nothing, so one call is one record however the layers stack.
CAPTURED_HEADER = "x-otel-capture"
CAPTURED_VALUE = "captured"

_ROLLOUT_ID_RE = re.compile(ROLLOUT_ID_PATTERN)
_API_KEY_HEADER = API_KEY_HEADER.encode()
_PREFIX = "/" + ROLLOUT_PATH_PREFIX + "/"


def is_valid_rollout_id(rollout_id: object) -> bool:
    return isinstance(rollout_id, str) and _ROLLOUT_ID_RE.fullmatch(rollout_id) is not None


def validate_rollout_id(rollout_id: object) -> str:
    """Return ``rollout_id`` if it follows the grammar, else raise :class:`InvalidRolloutIdError`: an id
    that passes is a file name inside the capture directory (contract D38)."""
    if not is_valid_rollout_id(rollout_id):
        raise InvalidRolloutIdError(rollout_id, ROLLOUT_ID_RULE)
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


_RE2_OPTIONS = re2.Options()
# a refused pattern is our error, raised once; not also a line on stderr from the C++ library
_RE2_OPTIONS.log_errors = False
# Flags of a compiled re.Pattern that RE2 reads as inline flags; any other (re.VERBOSE, re.ASCII...) is refused
_INLINE_FLAGS = {re.IGNORECASE: "i", re.MULTILINE: "m", re.DOTALL: "s"}
_ROLLOUT_GROUP = "rollout"
# Why a key pattern is refused, in the words the error says (docs/gateways.md, "Rollout id from the API key").
NO_ROLLOUT_GROUP = "the pattern needs a named group (?P<rollout>...): the rollout id"
WHOLE_KEY_RULE = (
    "its group rollout could be the whole key: the pattern must spell a fixed text outside the group that "
    "every key it matches has, such as the rk- of rk-(?P<rollout>[A-Za-z0-9._-]+), so a real credential "
    "never becomes a rollout id"
)


class ApiKeyRolloutPattern:
    """The pattern that reads a rollout id from an API key (``OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN``).

    Matched by RE2: its time is linear in the key's length whatever the pattern (no backtracking), so no
    pattern and no key can hold the event loop; it runs on every request. Built only through
    :meth:`compile`, which refuses, with a ``ValueError`` saying why:

    - text that RE2 cannot compile (backreferences, lookaround, repetitions or a program over RE2's bounds), or
      that Python's ``re`` cannot parse (the fixed-text check reads Python's parse tree);
    - a pattern without the named group ``rollout``;
    - a pattern whose group can be the whole key: one that spells no fixed character outside the group on
      every path through it. ``(?P<rollout>[A-Za-z0-9._-]+)`` matches ``EMPTY``, ``sk-proj-abc123`` and any
      real key, and would write it as a file name and a span attribute; ``rk-(?P<rollout>...)`` cannot,
      since every key it matches starts with ``rk-``, which is not in the id.
    """

    __slots__ = ("_regexp", "pattern")

    def __init__(self, pattern: str, regexp: Any) -> None:
        self.pattern = pattern
        self._regexp = regexp

    @classmethod
    def compile(cls, pattern: str | re.Pattern[str]) -> ApiKeyRolloutPattern:
        if isinstance(pattern, re.Pattern):
            pattern = _as_inline_flags(pattern)
        _check_fixed_text(pattern)  # first: it also says when there is no group rollout
        try:
            regexp = re2.compile(pattern, options=_RE2_OPTIONS)
        except re2.error as exc:
            reason = (
                exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
            )
            raise ValueError(
                f"RE2 cannot compile it ({reason}); RE2 takes no backreferences, lookaround, possessive or "
                "atomic groups, and bounds repetitions and program size"
            ) from None
        if _ROLLOUT_GROUP not in regexp.groupindex:  # pragma: no cover - Python's parse found it
            raise ValueError(NO_ROLLOUT_GROUP)
        return cls(pattern, regexp)

    def rollout_group(self, key: str) -> tuple[bool, str | None]:
        """Whether ``key`` matches in full, and then the text of the group ``rollout`` (``None`` when the
        group took no part in the match)."""
        found = self._regexp.fullmatch(key)
        if found is None:
            return False, None
        group = found.group(_ROLLOUT_GROUP)
        return True, group if isinstance(group, str) else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ApiKeyRolloutPattern) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)

    def __repr__(self) -> str:
        return f"ApiKeyRolloutPattern({self.pattern!r})"


def _as_inline_flags(compiled: re.Pattern[str]) -> str:
    """A compiled ``re`` pattern's text, its flags written inline as RE2 reads them."""
    flags = compiled.flags & ~re.UNICODE
    inline = "".join(letter for flag, letter in _INLINE_FLAGS.items() if flags & flag)
    if flags & ~(re.IGNORECASE | re.MULTILINE | re.DOTALL):
        raise ValueError("only the flags re.IGNORECASE, re.MULTILINE and re.DOTALL can be given to RE2")
    return f"(?{inline}){compiled.pattern}" if inline else compiled.pattern


def _check_fixed_text(pattern: str) -> None:
    """``ValueError`` unless ``pattern`` has a group ``rollout`` and spells at least one character outside
    it on every path: a literal at its top level, or inside a group or repeat (at least once) that is. A
    branch (``a|b``) or an optional part counts for nothing, so the check errs towards refusing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning ("[[" read as a set): RE2 reads it another way
        try:
            parsed = _re_parser.parse(pattern)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        except FutureWarning as exc:
            raise ValueError(f"Python's re and RE2 would read it differently: {exc}") from None
    group = parsed.state.groupdict.get(_ROLLOUT_GROUP)
    if group is None:
        raise ValueError(NO_ROLLOUT_GROUP)
    if _fixed_characters(parsed, group) == 0:
        raise ValueError(WHOLE_KEY_RULE)


def _fixed_characters(items: Any, rollout_group: int) -> int:
    """How many literal characters every match of the parsed sequence ``items`` spells outside the group
    numbered ``rollout_group``."""
    count = 0
    for op, av in items:
        if op == _re_parser.LITERAL:
            count += 1
        elif op == _re_parser.SUBPATTERN and av[0] != rollout_group:
            count += _fixed_characters(av[-1], rollout_group)
        elif op in (_re_parser.MAX_REPEAT, _re_parser.MIN_REPEAT) and av[0] >= 1:
            count += _fixed_characters(av[2], rollout_group)
    return count


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
