"""Request and response bodies → GenAI semantic-convention (v1.41.1) span attributes. Pure functions.

Two kinds of attribute come from here:

- the metadata every span carries (``gen_ai.request.*``, ``gen_ai.response.*``, ``gen_ai.usage.*``,
  ``openai.*``), from :func:`request_attributes`, :func:`response_attributes` and :func:`usage_attributes`;
- the opt-in content (``gen_ai.input.messages``, ``gen_ai.output.messages``,
  ``gen_ai.system_instructions``, ``gen_ai.tool.definitions``), from :func:`content_attributes`: each the
  semconv JSON schema's shape (messages of ``{"role", "parts": [...]}``) written as JSON text, and cut
  string by string by :func:`bounded_json` so that a length limit never leaves broken JSON. The message
  shapes of each dialect are in :mod:`otel_capture._dialects.content`, named in the dialect table.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from .. import _attributes as A
from .._dialects import DIALECTS, finish_reasons
from .._dialects.content import tool_definitions
from .._dialects.derive import cache_signal, token_stats

_logger = logging.getLogger(__name__)

# request key -> span attribute, numbers only (GenAI semconv "gen_ai.request.*")
_REQUEST_NUMBERS = (
    ("temperature", A.GEN_AI_REQUEST_TEMPERATURE, float),
    ("top_p", A.GEN_AI_REQUEST_TOP_P, float),
    ("top_k", A.GEN_AI_REQUEST_TOP_K, float),
    ("seed", A.GEN_AI_REQUEST_SEED, int),
    ("frequency_penalty", A.GEN_AI_REQUEST_FREQUENCY_PENALTY, float),
    ("presence_penalty", A.GEN_AI_REQUEST_PRESENCE_PENALTY, float),
    ("n", A.GEN_AI_REQUEST_CHOICE_COUNT, int),
)
_MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_TRUNCATED = "…"


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def request_attributes(request: dict[str, Any] | None) -> dict[str, Any]:
    """``gen_ai.request.*`` parameters present in the request body, plus the output type, conversation
    id and OpenAI service tier when the request names them."""
    if not request:
        return {}
    attributes: dict[str, Any] = {}
    get = request.get
    for key, name, kind in _REQUEST_NUMBERS:
        value: Any = get(key)
        if value is not None and (value.__class__ is int or value.__class__ is float or _number(value)):
            attributes[name] = kind(value)
    if attributes.get(A.GEN_AI_REQUEST_CHOICE_COUNT) == 1:
        del attributes[A.GEN_AI_REQUEST_CHOICE_COUNT]  # conditionally required only when != 1
    for key in _MAX_TOKENS_KEYS:
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            attributes[A.GEN_AI_REQUEST_MAX_TOKENS] = value
            break
    stop = request.get("stop", request.get("stop_sequences"))
    if isinstance(stop, str):
        attributes[A.GEN_AI_REQUEST_STOP_SEQUENCES] = [stop]
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        attributes[A.GEN_AI_REQUEST_STOP_SEQUENCES] = stop
    if isinstance(request.get("stream"), bool):
        attributes[A.GEN_AI_REQUEST_STREAM] = request["stream"]
    output_type = _output_type(request)
    if output_type is not None:
        attributes[A.GEN_AI_OUTPUT_TYPE] = output_type
    conversation = request.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    if isinstance(conversation, str) and conversation:
        attributes[A.GEN_AI_CONVERSATION_ID] = conversation
    tier = request.get("service_tier")
    if isinstance(tier, str) and tier != "auto":
        attributes[A.OPENAI_REQUEST_SERVICE_TIER] = tier
    return attributes


def _output_type(request: dict[str, Any]) -> str | None:
    fmt = request.get("response_format")  # Chat Completions
    text = request.get("text")  # Responses: text.format
    if fmt is None and isinstance(text, dict):
        fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("json_object", "json_schema"):
        return "json"
    if kind == "text":
        return "text"
    return None


def response_attributes(response: dict[str, Any], dialect: str) -> dict[str, Any]:
    """``gen_ai.response.*``, ``gen_ai.usage.*`` and the OpenAI response attributes of a response."""
    attributes: dict[str, Any] = {}
    if isinstance(response.get("id"), str):
        attributes[A.GEN_AI_RESPONSE_ID] = response["id"]
    if isinstance(response.get("model"), str):
        attributes[A.GEN_AI_RESPONSE_MODEL] = response["model"]
    reasons = finish_reasons(response, dialect)
    if reasons:
        attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] = reasons
    spec = DIALECTS.get(dialect)
    if spec is None or spec.provider_name == "openai":  # an OpenAI API (or unknown: what it says)
        if isinstance(response.get("service_tier"), str):
            attributes[A.OPENAI_RESPONSE_SERVICE_TIER] = response["service_tier"]
        if isinstance(response.get("system_fingerprint"), str):
            attributes[A.OPENAI_RESPONSE_SYSTEM_FINGERPRINT] = response["system_fingerprint"]
    attributes.update(usage_attributes(response))
    return attributes


def usage_attributes(response: dict[str, Any]) -> dict[str, Any]:
    """``gen_ai.usage.*`` from a response, with NeMo Gym's token rules (Anthropic input includes cache)."""
    usage = response.get("usage")
    stats = token_stats(usage)
    _, cached = cache_signal(usage)
    values = (
        (A.GEN_AI_USAGE_INPUT_TOKENS, stats["tokens_in"]),
        (A.GEN_AI_USAGE_OUTPUT_TOKENS, stats["tokens_out"]),
        (A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, cached),
        (A.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS, stats["cache_creation_tokens"]),
        (A.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS, stats["tokens_reasoning"]),
    )
    return {name: value for name, value in values if value is not None}


# -- content -----------------------------------------------------------------------------------------


def content_attributes(
    dialect: str, request: dict[str, Any] | None, response: dict[str, Any] | None, max_length: int
) -> dict[str, str]:
    """The four opt-in content attributes as JSON text, each at most ``max_length`` characters. Never
    raises: an unexpected body shape gives fewer attributes, not an error."""
    spec = DIALECTS[dialect]
    values: dict[str, Any] = {}
    if request:
        system, messages = spec.input_messages(request)
        if messages:
            values[A.GEN_AI_INPUT_MESSAGES] = messages
        if system:
            values[A.GEN_AI_SYSTEM_INSTRUCTIONS] = system
        tools = tool_definitions(request.get("tools"))
        if tools:
            values[A.GEN_AI_TOOL_DEFINITIONS] = tools
    if response:
        output = spec.output_messages(response)
        if output:
            values[A.GEN_AI_OUTPUT_MESSAGES] = output
    return {name: bounded_json(value, max_length) for name, value in values.items()}


# -- truncation that keeps the JSON valid --------------------------------------------------------------


def _dumps(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


def _longest_string(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return max((_longest_string(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return max((_longest_string(v) for v in value), default=0)
    return 0


def _cap_strings(value: Any, cap: int) -> Any:
    if isinstance(value, str):
        return value if len(value) <= cap else value[:cap] + _TRUNCATED
    if isinstance(value, dict):
        return {k: _cap_strings(v, cap) for k, v in value.items()}
    if isinstance(value, list):
        return [_cap_strings(v, cap) for v in value]
    return value


def bounded_json(value: Any, max_length: int) -> str:
    """``value`` as JSON text of at most ``max_length`` characters that still parses.

    Too long, every string longer than some cap is cut to it (and marked with ``…``), the cap being the
    largest that fits (binary search), so short strings such as roles and ids survive whole. When even
    empty strings do not fit, list entries are dropped from the front (the oldest messages go first);
    the last resort is ``[]``.
    """
    text = _dumps(value)
    if len(text) <= max_length:
        return text
    if isinstance(value, list):
        items = list(value)
        while items:
            fitted = _fit_strings(items, max_length)
            if fitted is not None:
                return fitted
            items.pop(0)
        return "[]"
    fitted = _fit_strings(value, max_length)
    return fitted if fitted is not None else "{}" if isinstance(value, dict) else '""'


def _fit_strings(value: Any, max_length: int) -> str | None:
    low, high = 0, _longest_string(value)
    best = _dumps(_cap_strings(value, 0))
    if len(best) > max_length:
        return None
    while low < high:
        middle = (low + high + 1) // 2
        candidate = _dumps(_cap_strings(value, middle))
        if len(candidate) <= max_length:
            low, best = middle, candidate
        else:
            high = middle - 1
    return best
