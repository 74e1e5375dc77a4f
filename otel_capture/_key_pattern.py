"""The pattern that reads a rollout id from an API key (``OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN``): a
setting's value, compiled and checked once when the settings are read (it sits below the settings, which
refuse an unsafe one at start), matched by :mod:`otel_capture._correlation` on every request.
"""

from __future__ import annotations

import re
import sys
import warnings
from typing import Any

# google-re2 ships no type hints: its compiled pattern is kept behind ApiKeyRolloutPattern's typed methods
import re2  # type: ignore[import-untyped]

if sys.version_info >= (3, 11):
    # typeshed stubs only the deprecated alias sre_parse (which warns on import since 3.11)
    from re import _parser as _re_parser  # type: ignore[attr-defined]
else:  # pragma: no cover - Python 3.10
    import sre_parse as _re_parser

__all__ = ["NO_ROLLOUT_GROUP", "WHOLE_KEY_RULE", "ApiKeyRolloutPattern"]

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
