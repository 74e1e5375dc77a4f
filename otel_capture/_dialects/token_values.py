"""One token id or one log-prob as an answer spells it, read whatever it holds: the value, or ``None``
(written ``null`` on the tokens line) for an odd entry, so one odd entry never costs the rest of its list
(``docs/tokens.md``, "Odd entries").
"""

from __future__ import annotations

import math
import sys
from array import array
from itertools import repeat
from typing import Any

__all__ = ["id_list", "log_prob", "log_prob_list", "spelled_ids", "token_id"]

_SPELLED = "token_id:"
_ID_LIMIT = (
    2**63
)  # an id is far below it; past it orjson cannot write the line (and int() of 5000 digits raises)
_MAX_ID_DIGITS = 19
_INT, _FLOAT, _NONE, _STR = {int}, {float}, {type(None)}, {str}
_TOP_BYTES = slice(7, None, 8) if sys.byteorder == "little" else slice(0, None, 8)  # of each packed word


def token_id(value: object) -> int | None:
    """An id: a non-negative integer below 2**63 (not a bool), or vLLM's ``return_tokens_as_token_ids``
    spelling ``"token_id:<int>"`` decoded; ``None`` for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 <= value < _ID_LIMIT else None
    if isinstance(value, str) and value.startswith(_SPELLED):
        digits = value[len(_SPELLED) :]
        if digits.isascii() and digits.isdigit() and len(digits) <= _MAX_ID_DIGITS:
            return token_id(int(digits))
    return None


def log_prob(value: object) -> float | None:
    """A log-prob: a finite number (not a bool) as a float; ``None`` for ``null``, NaN, ±inf or anything
    else."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range
        return None
    return number if math.isfinite(number) else None


def id_list(value: object) -> list[int | None] | None:
    """A list of ids, each entry read by :func:`token_id`; ``None`` when ``value`` is not a list or none
    of its entries is an id (``["a"]`` is not a list of ids with one odd entry). ``value`` itself only when
    every entry is an id (:func:`.mismatch.token_mismatch` then looks for no odd entry in it); else a new
    list."""
    if not isinstance(value, list):
        return None
    types = set(map(type, value))
    if types == _INT and _in_id_range(value):
        return value  # the usual list, read at C speed
    if types == _NONE:
        return None
    ids = [token_id(v) for v in value]
    return ids if not ids or any(i is not None for i in ids) else None


def _in_id_range(ints: list[int]) -> bool:
    """Whether every int of ``ints`` is from 0 to 2**63 - 1, at C speed (twice as fast as ``min`` and ``max``
    on a prompt's thousands of ids, read on every call): packed as unsigned 64-bit words, which refuses
    any outside 0 to 2**64 - 1, with no word's most significant bit set."""
    try:
        words = array("Q", ints).tobytes()
    except OverflowError:
        return False
    return words[_TOP_BYTES].isascii()


def log_prob_list(value: object) -> list[float | None] | None:
    """A list of log-probs, each entry read by :func:`log_prob`; ``None`` when ``value`` is not a list. A
    list of NaN only is kept, all ``null``: that its log-probs were sent and are unusable is the news."""
    if not isinstance(value, list):
        return None
    if set(map(type, value)) == _FLOAT and math.isfinite(sum(value)):
        return value  # the usual list (a NaN or an infinity makes the sum one), read at C speed
    return [log_prob(v) for v in value]


def spelled_ids(tokens: list[Any]) -> list[int | None] | None:
    """The ids of tokens spelled ``"token_id:<int>"`` (vLLM's ``return_tokens_as_token_ids``), ``None`` for
    a token spelled otherwise; ``None`` when no token is so spelled (a token ``"7"`` is the text 7)."""
    if set(map(type, tokens)) == _STR and not any(map(str.startswith, tokens, repeat(_SPELLED))):
        return None  # the usual text tokens, looked at at C speed
    ids = [token_id(t) if isinstance(t, str) else None for t in tokens]
    return ids if any(i is not None for i in ids) else None
