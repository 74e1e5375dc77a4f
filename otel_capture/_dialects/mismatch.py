"""Token integrity: the invariants an answer's token ids and log-probs keep, checked per call. A pure
function of the request, the response and the dialect; the record's ``token_mismatch``, the span attribute
and the counter say what it returns (``docs/tokens.md``, "Token integrity: ``token_mismatch``").

Checked on what the tokens line holds (:func:`.tokens.extract_tokens`):

- every entry is a value: an id that is not one, a log-prob ``null``/NaN/±inf (written ``null``);
- each generation has as many log-probs as token ids, when it has both;
- Chat Completions and Completions, with a usage: the generated tokens of all choices (each choice's ids,
  else its log-probs) add up to ``usage.completion_tokens`` (the usage counts all choices together), when
  every choice has some; with ``best_of`` above ``n`` the usage also counts the candidates not returned,
  so only more tokens than it counts is a mismatch; log-probs without ids may also leave out the hidden
  reasoning tokens, and are not counted for an answer with tool calls (OpenAI's cover the text only); the prompt's ids are ``usage.prompt_tokens`` (a
  request of several prompts: each prompt's ids once, choice ``i`` answering prompt ``i // n``).

Responses are checked for the first two only: their usage counts reasoning and tool-call tokens that the
output text's log-probs do not cover. Tokens the request asked for and the answer does not have at all are
:mod:`.missing`'s, not a mismatch.
"""

from __future__ import annotations

from typing import Any

from .tokens import extract_tokens

__all__ = ["token_mismatch"]


def _usage(response: dict[str, Any], key: str) -> int | None:
    usage = response.get("usage")
    return _count(usage.get(key)) if isinstance(usage, dict) else None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _odd_entries(where: str, ids: list[Any] | None, log_probs: list[Any] | None) -> list[str]:
    reasons = []
    if ids is not None and (odd := ids.count(None)):
        reasons.append(f"{where}: {odd} of {len(ids)} token ids not an id (written as null)")
    if log_probs is not None and (odd := log_probs.count(None)):
        reasons.append(
            f"{where}: {odd} of {len(log_probs)} log-probs null, NaN or infinite (written as null)"
        )
    return reasons


def _output_against_usage(
    request: dict[str, Any], response: dict[str, Any], generations: list[dict[str, Any]]
) -> str | None:
    completion = _usage(response, "completion_tokens")
    choices = response.get("choices")
    if completion is None or not isinstance(choices, list) or len(generations) < len(choices) or not choices:
        return None  # no usage, or a choice without tokens (missing.py's, when they were asked for)
    with_ids = all(g["token_ids"] is not None for g in generations)
    if not with_ids and _tool_calls(choices):
        return None  # log-probs cover a message's text, not its tool calls' tokens (OpenAI)
    have = sum(len(g["token_ids"] if g["token_ids"] is not None else g["log_probs"]) for g in generations)
    n = _count(request.get("n")) or 1
    best_of = _count(request.get("best_of"))
    if have == completion or (best_of is not None and best_of > n and have < completion):
        return None
    details = response["usage"].get("completion_tokens_details")
    hidden = _count(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    if not with_ids and hidden and have == completion - hidden:
        return None  # reasoning the answer does not show has no log-probs (OpenAI)
    what = "token ids" if with_ids else "generated tokens (token ids, else log-probs)"
    return f"output: {have} {what} for {completion} completion tokens (usage)"


def _tool_calls(choices: list[Any]) -> bool:
    return any(
        isinstance(choice, dict)
        and isinstance(message := choice.get("message"), dict)
        and bool(message.get("tool_calls"))
        for choice in choices
    )


def _prompt_against_usage(
    request: dict[str, Any], response: dict[str, Any], found: dict[str, Any]
) -> str | None:
    expected = _usage(response, "prompt_tokens")
    if expected is None:
        return None
    prompt = found["prompt_token_ids"]
    if prompt is not None:
        have = len(prompt)
    else:
        n = _count(request.get("n")) or 1
        own = [g["prompt_token_ids"] for g in found["generations"] if "prompt_token_ids" in g]
        if not own:
            return None
        have = sum(len(g["prompt_token_ids"]) for g in found["generations"] if g.get("index", 0) % n == 0)
    if have == expected:
        return None
    return f"prompt: {have} token ids for {expected} prompt tokens (usage)"


def token_mismatch(
    request: object, response: object, dialect: str, found: dict[str, Any] | None = None
) -> str | None:
    """Which token invariants the answer breaks, as text (reasons joined by ``; ``), or ``None``.
    ``found``: the response's :func:`.tokens.extract_tokens`, when the caller has it (read once per call).
    Never raises on odd bodies."""
    if not isinstance(response, dict) or dialect == "messages":
        return None
    found = found or extract_tokens(response)
    if found is None:
        return None
    request = request if isinstance(request, dict) else {}
    generations: list[dict[str, Any]] = found["generations"]
    prompt = found["prompt_token_ids"]
    # the answer's own list, as id_list returns only a list of ids alone (a long prompt's thousands of
    # entries, not looked at again); a list read entry by entry is a new one, odd entries None
    clean = prompt is not None and prompt is response.get("prompt_token_ids")
    reasons = [] if clean else _odd_entries("prompt", prompt, None)
    for generation in generations:
        ids, log_probs = generation["token_ids"], generation["log_probs"]
        own_prompt = generation.get("prompt_token_ids")
        if not (  # the usual generation: nothing odd, as many log-probs as ids (no reason worded)
            (ids is None or None not in ids)
            and (log_probs is None or None not in log_probs)
            and (own_prompt is None or None not in own_prompt)
            and (ids is None or log_probs is None or len(ids) == len(log_probs))
        ):
            where = f"generation {generation['index']}"
            reasons += _odd_entries(where, ids, log_probs)
            reasons += _odd_entries(f"{where} prompt", own_prompt, None)
            if ids is not None and log_probs is not None and len(ids) != len(log_probs):
                reasons.append(f"{where}: {len(log_probs)} log-probs for {len(ids)} token ids")
    if dialect in ("chat", "completions"):
        for reason in (
            _output_against_usage(request, response, generations),
            _prompt_against_usage(request, response, found),
        ):
            if reason is not None:
                reasons.append(reason)
    return "; ".join(reasons) or None
