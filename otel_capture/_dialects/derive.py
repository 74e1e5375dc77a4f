"""Facts derived from one model call's request and response bodies (pure functions, no I/O).

Two users:

- the record reader, which must derive *exactly* what NeMo Gym 0.7.0's ``build_model_call_record``
  derives, so that Gym's files give Gym's records (token stats, cache signal, tool calls, reasoning,
  finish reason, response id/status, model). These rules are shape-based, as in Gym: a response with an
  ``output`` list is read as Responses, else one with ``choices`` as Chat Completions, else one with
  ``content`` as Anthropic Messages; the dialect is not consulted. Their odd corners are kept on purpose
  (see the notes in each function): changing them would make our records differ from Gym's.
- the span code, which also wants *every* finish reason: one function per dialect (``*_finish_reasons``),
  named in the dialect table (:mod:`.table`).

One addition of ours, for the ``generate`` dialect only (which Gym never writes, so Gym's files still give
Gym's records): where Gym's rules find nothing, a token-in/token-out answer's own fields fill the gap
(:func:`generate_facts`): SGLang's ``meta_info`` (counts, finish reason, id) and vLLM's ``request_id``.

Malformed shapes that Gym's code trips over (for example a non-iterable ``tool_calls``) raise here too, so
the readers count the same lines as damaged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, TypedDict, cast

from .generate import is_sglang_body, sglang_facts

_logger = logging.getLogger(__name__)

_EMPTY: Mapping[str, Any] = {}


class TokenStats(TypedDict):
    tokens_in: int | None
    tokens_out: int | None
    tokens_reasoning: int | None
    tokens_total: int | None
    cache_creation_tokens: int | None


class CallFacts(TypedDict):
    """Every record field that is derived from the bodies rather than copied from the line."""

    response_id: str | None
    model: str | None
    response_status: str | None
    finish_reason: str | None
    tokens_in: int | None
    tokens_out: int | None
    tokens_reasoning: int | None
    tokens_total: int | None
    cache_creation_tokens: int | None
    cache_hit: bool | None
    cached_tokens: int | None
    tool_calls: list[dict[str, Any]]
    reasoning_content: str | None


# --- usage -------------------------------------------------------------------------------------------


def _token_count(value: object) -> int | None:
    """A token count is an exact ``int`` >= 0 (``bool`` and ``float`` are refused, as in Gym)."""
    return value if type(value) is int and value >= 0 else None


def _usage_detail_token(
    usage: Mapping[str, Any], detail_groups: tuple[str, ...], field_names: tuple[str, ...]
) -> int | None:
    """The first valid count among ``usage[group][field]``, groups then fields in order."""
    for group_name in detail_groups:
        details = usage.get(group_name)
        if not isinstance(details, Mapping):
            continue
        for field_name in field_names:
            value = _token_count(details.get(field_name))
            if value is not None:
                return value
    return None


def token_stats(usage: object) -> TokenStats:
    """Normalized token counts from a Responses, Chat Completions or Anthropic ``usage`` object.

    Anthropic's ``input_tokens`` excludes cached tokens, so top-level ``cache_read_input_tokens`` and
    ``cache_creation_input_tokens`` are folded into ``tokens_in`` (only when ``input_tokens`` is known or
    their sum is positive). OpenAI-style usage already counts cached tokens in its input.
    """
    if not isinstance(usage, Mapping):
        return TokenStats(
            tokens_in=None,
            tokens_out=None,
            tokens_reasoning=None,
            tokens_total=None,
            cache_creation_tokens=None,
        )
    tokens_in = _token_count(usage.get("input_tokens"))
    if tokens_in is None:
        tokens_in = _token_count(usage.get("prompt_tokens"))
    tokens_out = _token_count(usage.get("output_tokens"))
    if tokens_out is None:
        tokens_out = _token_count(usage.get("completion_tokens"))
    cache_read = _token_count(usage.get("cache_read_input_tokens"))
    cache_creation = _token_count(usage.get("cache_creation_input_tokens"))
    if cache_read is not None or cache_creation is not None:
        cache_total = (cache_read or 0) + (cache_creation or 0)
        if tokens_in is not None or cache_total > 0:
            tokens_in = (tokens_in or 0) + cache_total
    tokens_total = _token_count(usage.get("total_tokens"))
    if tokens_total is None and tokens_in is not None and tokens_out is not None:
        tokens_total = tokens_in + tokens_out
    tokens_reasoning = _usage_detail_token(
        usage, ("output_tokens_details", "completion_tokens_details"), ("reasoning_tokens",)
    )
    if tokens_reasoning is None:
        tokens_reasoning = _token_count(usage.get("reasoning_output_tokens"))
    return TokenStats(
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        tokens_reasoning=tokens_reasoning,
        tokens_total=tokens_total,
        cache_creation_tokens=cache_creation,
    )


def cache_signal(usage: object) -> tuple[bool | None, int | None]:
    """``(cache_hit, cached_tokens)``: the cache-read count and whether it is positive."""
    if not isinstance(usage, Mapping):
        return None, None
    cached = _usage_detail_token(
        usage, ("prompt_tokens_details", "input_tokens_details"), ("cached_tokens", "cached_input_tokens")
    )
    if cached is None:
        cached = _token_count(usage.get("cache_read_input_tokens"))  # Anthropic
    if cached is None:
        cached = _token_count(usage.get("cached_input_tokens"))
    if cached is None:
        return None, None
    return cached > 0, cached


# --- tool calls and reasoning ------------------------------------------------------------------------


def _as_arguments(arguments: object) -> Any:
    """Tool-call arguments as Gym stores them: a dict as is, a JSON string parsed, anything else ``{}``.

    Parsed with the stdlib ``json`` (not orjson) because the two differ on integers past 64 bits and on
    ``NaN``; a string that parses to a non-object is kept as parsed (Gym does the same).
    """
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except Exception:  # any failure (ValueError, RecursionError) keeps the text, as Gym does
            return {"_raw": arguments}
    return {}


def _responses_items(output: list[Any], tool_calls: list[dict[str, Any]], reasoning: list[str]) -> None:
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "function_call":
            tool_calls.append(
                {
                    "call_id": item.get("call_id") or item.get("id"),
                    "name": item.get("name"),
                    "arguments": _as_arguments(item.get("arguments")),
                }
            )
        elif item.get("type") == "reasoning":
            # Only ``summary[].text``: Gym ignores ``reasoning.content[]`` (reasoning_text parts).
            for summary in item.get("summary") or []:
                text = summary.get("text") if isinstance(summary, dict) else None
                if isinstance(text, str) and text:
                    reasoning.append(text)


def _chat_choices(choices: list[Any], tool_calls: list[dict[str, Any]], reasoning: list[str]) -> None:
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, Mapping):
            continue
        for tc in message.get("tool_calls") or []:
            if not isinstance(tc, dict):
                continue
            fn = tc.get("function") or {}
            if not isinstance(fn, Mapping):
                fn = {}
            tool_calls.append(
                {
                    "call_id": tc.get("id"),
                    "name": fn.get("name"),
                    "arguments": _as_arguments(fn.get("arguments")),
                }
            )
        # ``reasoning_content`` wins when truthy, even if it is not a string (then nothing is taken).
        reasoning_text = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning_text, str) and reasoning_text:
            reasoning.append(reasoning_text)


def _anthropic_blocks(content: list[Any], tool_calls: list[dict[str, Any]], reasoning: list[str]) -> None:
    for block in content:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_use":
            # Gym keeps ``input`` as is (a string input is *not* parsed, unlike the other dialects).
            tool_calls.append(
                {"call_id": block.get("id"), "name": block.get("name"), "arguments": block.get("input") or {}}
            )
        elif block.get("type") in ("thinking", "redacted_thinking") and isinstance(
            block.get("thinking"), str
        ):
            reasoning.append(block["thinking"])


def tool_calls_and_reasoning(response: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """``([{call_id, name, arguments}], reasoning)`` from a response of any of the three shapes.

    Responses: ``function_call`` items only; Chat: the tool calls of every choice; Anthropic: ``tool_use``
    blocks. Reasoning parts are joined with ``"\\n"``; ``None`` when there are none.
    """
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    output = response.get("output")
    if isinstance(output, list):
        _responses_items(output, tool_calls, reasoning)
        return tool_calls, ("\n".join(reasoning) or None)
    choices = response.get("choices")
    if isinstance(choices, list):
        _chat_choices(choices, tool_calls, reasoning)
        return tool_calls, ("\n".join(reasoning) or None)
    content = response.get("content")
    if isinstance(content, list):
        _anthropic_blocks(content, tool_calls, reasoning)
        return tool_calls, ("\n".join(reasoning) or None)
    return tool_calls, None


# --- scalar facts ------------------------------------------------------------------------------------


def finish_reason(response: Mapping[str, Any]) -> str | None:
    """Gym's single finish reason: the first string among Anthropic ``stop_reason``, the *first* chat
    choice's ``finish_reason`` and Responses ``incomplete_details.reason`` (a completed Responses call
    therefore has none)."""
    choices = response.get("choices")
    first_choice = (
        choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else _EMPTY
    )
    incomplete_details = response.get("incomplete_details")
    if not isinstance(incomplete_details, dict):
        incomplete_details = _EMPTY
    for value in (
        response.get("stop_reason"),
        first_choice.get("finish_reason"),
        incomplete_details.get("reason"),
    ):
        if isinstance(value, str):
            return value
    return None


def response_model(response: Mapping[str, Any], request: Mapping[str, Any]) -> str | None:
    """``response.model``, else ``request.model`` (a truthy non-string response model gives ``None``)."""
    model = response.get("model") or request.get("model")
    return model if isinstance(model, str) else None


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def derive_call_facts(response: object, request: object, dialect: object = None) -> CallFacts:
    """Every derived record field, exactly as NeMo Gym 0.7.0 derives it (for the ``generate`` dialect,
    completed by :func:`generate_facts`). Non-dict bodies count as ``{}``.

    May raise (``TypeError``, ``AttributeError``) on response shapes that Gym's own code trips over.
    """
    resp: Mapping[str, Any] = response if isinstance(response, dict) else _EMPTY
    req: Mapping[str, Any] = request if isinstance(request, dict) else _EMPTY
    usage = resp.get("usage")
    tokens = token_stats(usage)
    cache_hit, cached_tokens = cache_signal(usage)
    tool_calls, reasoning_content = tool_calls_and_reasoning(resp)
    facts = CallFacts(
        response_id=_str_or_none(resp.get("id")),
        model=response_model(resp, req),
        response_status=_str_or_none(resp.get("status")),
        finish_reason=finish_reason(resp),
        tokens_in=tokens["tokens_in"],
        tokens_out=tokens["tokens_out"],
        tokens_reasoning=tokens["tokens_reasoning"],
        tokens_total=tokens["tokens_total"],
        cache_creation_tokens=tokens["cache_creation_tokens"],
        cache_hit=cache_hit,
        cached_tokens=cached_tokens,
        tool_calls=tool_calls,
        reasoning_content=reasoning_content,
    )
    if dialect == "generate":
        generate_facts(facts, resp)
    return facts


def generate_facts(facts: CallFacts, response: Mapping[str, Any]) -> None:
    """Fill the facts Gym's rules left empty from a token-in/token-out answer: an SGLang body's
    ``meta_info`` (:func:`.generate.sglang_facts`), a vLLM body's ``request_id`` as its response id (its
    usage, finish reasons and model are where Gym reads them already)."""
    found: dict[str, Any] = {}
    if is_sglang_body(response):
        found = sglang_facts(response)
    elif isinstance(response.get("choices"), list):
        found = {"response_id": _str_or_none(response.get("request_id"))}
    fields = cast("dict[str, Any]", facts)  # the names found are CallFacts' own
    for name, value in found.items():
        if value is not None and fields[name] is None:
            fields[name] = value


# --- span facts (ours, not Gym's): every finish reason, per dialect -----------------------------------


def chat_finish_reasons(response: Mapping[str, Any]) -> list[str]:
    """Each choice's ``finish_reason``, in list order (non-strings skipped)."""
    choices = response.get("choices")
    if not isinstance(choices, list):
        return []
    return [
        reason
        for choice in choices
        if isinstance(choice, Mapping) and isinstance(reason := choice.get("finish_reason"), str)
    ]


def messages_finish_reasons(response: Mapping[str, Any]) -> list[str]:
    """Anthropic's ``stop_reason``."""
    stop_reason = response.get("stop_reason")
    return [stop_reason] if isinstance(stop_reason, str) else []


def responses_finish_reasons(response: Mapping[str, Any]) -> list[str]:
    """``incomplete_details.reason`` when present, else ``status``."""
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, Mapping) else None
    if not isinstance(reason, str):
        reason = response.get("status")
    return [reason] if isinstance(reason, str) else []
