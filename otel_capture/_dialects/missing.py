"""Tokens expected but absent: a request that asked for token ids or log-probs, answered without them (in
no choice, or not in some choices). A pure function of the request, the response and the dialect; the
record's ``tokens_missing``, the span attribute and the counter say what it returns (``docs/tokens.md``).
Tokens that are there but disagree (with each other, or in number with the usage) are a
``token_mismatch`` (:mod:`.mismatch`), not missing.

What asks for what (whatever the server; a key the server does not know is simply not honoured, which is
exactly what this catches):

- token ids: ``return_token_ids: true`` (vLLM, Chat and Completions): the generated ids of every choice
  and the prompt's;
- log-probs: Chat ``logprobs: true`` or ``top_logprobs: N``; Completions ``logprobs: N`` (``0`` too);
  Responses ``include: ["message.output_text.logprobs"]`` or ``top_logprobs: N``; SGLang
  ``return_logprob: true``;
- prompt log-probs: ``prompt_logprobs: N`` (vLLM): a non-empty ``prompt_logprobs`` (top level for Chat, on
  each choice for Completions).

An answer that generated nothing (``usage`` says 0 output tokens: echo with ``max_tokens: 0``) misses
nothing. Legacy log-probs sent with ``echo`` that cannot be told apart from the prompt's (no token ids, no
usage: a stream without ``include_usage``) are not called absent: the reason says so.
"""

from __future__ import annotations

from typing import Any

from .derive import token_stats
from .token_values import token_id
from .tokens import extract_tokens

__all__ = ["tokens_missing"]

_RESPONSES_LOGPROBS = "message.output_text.logprobs"
# every request key :func:`_asked` reads: a request with none of them asks for nothing
_ASKING_KEYS = frozenset(
    ("return_token_ids", "logprobs", "top_logprobs", "include", "return_logprob", "prompt_logprobs")
)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _asked(request: dict[str, Any], dialect: str) -> tuple[list[str], list[str], str | None]:
    """``(why token ids were asked for, why log-probs were, why prompt log-probs were)``."""
    ids: list[str] = []
    probs: list[str] = []
    if request.get("return_token_ids") is True:
        ids.append("return_token_ids")
    logprobs = request.get("logprobs")
    if dialect == "completions":
        if _count(logprobs):
            probs.append(f"logprobs={logprobs}")
    elif logprobs is True:
        probs.append("logprobs=true")
    top = request.get("top_logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and top > 0 and not probs:
        probs.append(f"top_logprobs={top}")
    include = request.get("include")
    if dialect == "responses" and isinstance(include, list) and _RESPONSES_LOGPROBS in include:
        probs.append(f"include={_RESPONSES_LOGPROBS}")
    if request.get("return_logprob") is True:
        probs.append("return_logprob")
    prompt = request.get("prompt_logprobs")
    return ids, probs, f"prompt_logprobs={prompt}" if _count(prompt) or prompt == -1 else None


def _expected_outputs(response: dict[str, Any], dialect: str) -> int | None:
    """The output tokens the ids and log-probs should cover, when the usage says (``None``: not compared)."""
    stats = token_stats(response.get("usage"))
    out = stats["tokens_out"]
    if out is None:
        return None
    if dialect == "responses":
        output = response.get("output")
        if isinstance(output, list) and any(
            isinstance(item, dict) and item.get("type") not in ("message", "reasoning") for item in output
        ):
            return None
        out -= stats["tokens_reasoning"] or 0
    return out


def _choice_indices(response: dict[str, Any], dialect: str) -> list[int]:
    """The indices of a Chat or Completions answer's choices (Responses: none, its output items are not
    each a generation)."""
    choices = response.get("choices")
    if dialect == "responses" or not isinstance(choices, list):
        return []
    indices = []
    for position, choice in enumerate(choices):
        if isinstance(choice, dict):
            index = token_id(choice.get("index"))
            indices.append(index if index is not None else position)
    return indices


def _echoed_log_probs(response: dict[str, Any]) -> bool:
    """Whether a choice sent legacy log-probs that start with echo's ``null`` (the prompt's first token)."""
    choices = response.get("choices")
    return isinstance(choices, list) and any(
        isinstance(choice, dict)
        and isinstance(logprobs := choice.get("logprobs"), dict)
        and isinstance(values := logprobs.get("token_logprobs"), list)
        and bool(values)
        and values[0] is None
        for choice in choices
    )


def _prompt_log_probs(response: dict[str, Any]) -> bool:
    if response.get("prompt_logprobs"):
        return True
    choices = response.get("choices")
    return isinstance(choices, list) and any(
        isinstance(choice, dict) and choice.get("prompt_logprobs") for choice in choices
    )


def tokens_missing(
    request: object, response: object, dialect: str, found: dict[str, Any] | None = None
) -> str | None:
    """Why the answer lacks tokens its request asked for, or ``None`` (nothing asked, or all there).
    ``found``: the response's :func:`.tokens.extract_tokens`, when the caller has it (read once per call).
    Never raises on odd bodies: an unreadable shape gives ``None``."""
    if not isinstance(request, dict) or not isinstance(response, dict) or dialect == "messages":
        return None
    if _ASKING_KEYS.isdisjoint(request):  # most requests ask for no tokens: nothing more to read
        return None
    ids_asked, probs_asked, prompt_asked = _asked(request, dialect)
    if not ids_asked and not probs_asked and prompt_asked is None:
        return None
    found = found or extract_tokens(response) or {"prompt_token_ids": None, "generations": []}
    generations = found["generations"]
    expected: int | None = None  # the usage's output tokens: read only when something lacks
    expected_read = False
    indices: list[int] | None = None  # the choices' indices, read once
    reasons: list[str] = []
    for asked, key, what in ((ids_asked, "token_ids", "token ids"), (probs_asked, "log_probs", "log-probs")):
        if not asked:
            continue
        having = {g["index"] for g in generations if g.get(key) is not None}
        if having and indices is None:
            indices = _choice_indices(response, dialect)
        lacking = [i for i in indices if i not in having] if having and indices else None
        if having and not lacking:  # every choice has them (the usual answer)
            continue
        if not expected_read:
            expected, expected_read = _expected_outputs(response, dialect), True
        if expected == 0:  # nothing generated (echo with max_tokens=0): nothing to cover
            continue
        why = ", ".join(asked)
        if not having:
            if key == "log_probs" and request.get("echo") is True and _echoed_log_probs(response):
                reasons.append(
                    f"{what} asked for ({why}), sent with echo's prompt entries that neither token ids nor a"
                    " usage tell apart from the output's"
                )
            else:
                reasons.append(f"{what} asked for ({why}), none in the response")
        elif lacking:
            choices = ", ".join(map(str, lacking))
            reasons.append(f"{what} asked for ({why}), none for choice{'s' * (len(lacking) > 1)} {choices}")
    if (
        ids_asked
        and found["prompt_token_ids"] is None
        and not any("prompt_token_ids" in g for g in generations)
    ):
        reasons.append("prompt token ids asked for (return_token_ids), none in the response")
    if prompt_asked is not None and not _prompt_log_probs(response):
        reasons.append(f"prompt log-probs asked for ({prompt_asked}), none in the response")
    return "; ".join(reasons) or None
