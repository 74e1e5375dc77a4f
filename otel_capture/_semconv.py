"""Request and response bodies → GenAI semantic-convention (v1.41.1) span attributes. Pure functions.

Two kinds of attribute come from here:

- the metadata every span carries (``gen_ai.request.*``, ``gen_ai.response.*``, ``gen_ai.usage.*``,
  ``openai.*``), from :func:`request_attributes`, :func:`response_attributes` and :func:`usage_attributes`;
- the opt-in content (``gen_ai.input.messages``, ``gen_ai.output.messages``,
  ``gen_ai.system_instructions``, ``gen_ai.tool.definitions``), from :func:`content_attributes`: each the
  semconv JSON schema's shape (messages of ``{"role", "parts": [...]}``) written as JSON text, and cut
  string by string by :func:`bounded_json` so that a length limit never leaves broken JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from . import _attributes as A
from ._dialects.derive import cache_signal, finish_reasons, token_stats

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
    for key, name, kind in _REQUEST_NUMBERS:
        value: Any = request.get(key)
        if _number(value):
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
    if dialect != "messages":
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
    values: dict[str, Any] = {}
    if request:
        system, messages = _INPUT[dialect](request)
        if messages:
            values[A.GEN_AI_INPUT_MESSAGES] = messages
        if system:
            values[A.GEN_AI_SYSTEM_INSTRUCTIONS] = system
        tools = _tool_definitions(request.get("tools"))
        if tools:
            values[A.GEN_AI_TOOL_DEFINITIONS] = tools
    if response:
        output = _OUTPUT[dialect](response)
        if output:
            values[A.GEN_AI_OUTPUT_MESSAGES] = output
    return {name: bounded_json(value, max_length) for name, value in values.items()}


def _text(content: object) -> dict[str, Any]:
    return {"type": "text", "content": content if isinstance(content, str) else ""}


def _arguments(raw: object) -> Any:
    """Tool-call arguments as an object when they are JSON text (Chat, Responses), else as given."""
    if isinstance(raw, str):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


def _generic(part: dict[str, Any]) -> dict[str, Any]:
    """A part the schema has no specific type for: its type and, when it has one, its text."""
    kind = part.get("type")
    generic: dict[str, Any] = {"type": kind if isinstance(kind, str) else "unknown"}
    for key in ("text", "content", "url", "image_url", "file_id"):
        value = part.get(key)
        if isinstance(value, str):
            generic["content"] = value
            break
    return generic


# Chat Completions


def _chat_parts(content: object) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [_text(content)]
    parts: list[dict[str, Any]] = []
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "text":
                parts.append(_text(part.get("text")))
            elif part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
                parts.append({"type": "uri", "modality": "image", "uri": str(part["image_url"].get("url", ""))})
            else:
                parts.append(_generic(part))
    return parts


def _chat_tool_calls(calls: object) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts.append({
                "type": "tool_call",
                "id": call.get("id"),
                "name": function.get("name"),
                "arguments": _arguments(function.get("arguments")),
            })
    return parts


def _chat_input(request: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    messages: list[dict[str, Any]] = []
    for message in request.get("messages") or []:
        if not isinstance(message, dict):
            continue
        role = message.get("role") if isinstance(message.get("role"), str) else "user"
        if role == "tool":
            parts = [{"type": "tool_call_response", "id": message.get("tool_call_id"),
                      "response": message.get("content")}]
        else:
            parts = _chat_parts(message.get("content")) + _chat_tool_calls(message.get("tool_calls"))
        entry: dict[str, Any] = {"role": role, "parts": parts}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        messages.append(entry)
    return [], messages  # Chat keeps system messages among the messages


def _chat_output(response: dict[str, Any]) -> list[Any]:
    output: list[dict[str, Any]] = []
    for choice in response.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        message: dict[str, Any] = choice["message"] if isinstance(choice.get("message"), dict) else {}
        parts: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            parts.append({"type": "reasoning", "content": reasoning})
        if message.get("content") is not None:
            parts += _chat_parts(message.get("content"))
        parts += _chat_tool_calls(message.get("tool_calls"))
        output.append({
            "role": message.get("role") or "assistant",
            "parts": parts,
            "finish_reason": choice.get("finish_reason") or "error",
        })
    return output


# Responses


def _responses_content(content: object) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [_text(content)]
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict):
            continue
        if part.get("type") in ("input_text", "output_text", "text"):
            parts.append(_text(part.get("text")))
        elif part.get("type") == "refusal":
            parts.append(_text(part.get("refusal")))
        else:
            parts.append(_generic(part))
    return parts


def _responses_item(item: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    kind = item.get("type")
    if kind == "function_call":
        return "assistant", [{"type": "tool_call", "id": item.get("call_id"), "name": item.get("name"),
                              "arguments": _arguments(item.get("arguments"))}]
    if kind == "function_call_output":
        return "tool", [{"type": "tool_call_response", "id": item.get("call_id"), "response": item.get("output")}]
    if kind == "reasoning":
        texts: list[str] = [s["text"] for s in (item.get("summary") or []) + (item.get("content") or [])
                            if isinstance(s, dict) and isinstance(s.get("text"), str)]
        return "assistant", [{"type": "reasoning", "content": "\n".join(texts)}]
    role: str = item["role"] if isinstance(item.get("role"), str) else "user"
    if kind in (None, "message"):
        return role, _responses_content(item.get("content"))
    return "assistant", [_generic(item)]


def _responses_input(request: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    instructions = request.get("instructions")
    system = [_text(instructions)] if isinstance(instructions, str) and instructions else []
    raw = request.get("input")
    if isinstance(raw, str):
        return system, [{"role": "user", "parts": [_text(raw)]}]
    messages: list[dict[str, Any]] = []
    for item in raw if isinstance(raw, list) else []:
        if isinstance(item, dict):
            role, parts = _responses_item(item)
            messages.append({"role": role, "parts": parts})
    return system, messages


def _responses_output(response: dict[str, Any]) -> list[Any]:
    parts: list[dict[str, Any]] = []
    for item in response.get("output") or []:
        if isinstance(item, dict):
            parts += _responses_item(item)[1]
    reasons = finish_reasons(response, "responses")
    return [{"role": "assistant", "parts": parts, "finish_reason": reasons[0] if reasons else "error"}]


# Anthropic Messages


def _anthropic_blocks(content: object) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [_text(content)]
    parts: list[dict[str, Any]] = []
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(_text(block.get("text")))
        elif kind in ("tool_use", "server_tool_use"):
            parts.append({"type": "tool_call" if kind == "tool_use" else "server_tool_call",
                          "id": block.get("id"), "name": block.get("name"), "arguments": block.get("input")})
        elif kind == "tool_result":
            response = block.get("content")
            if isinstance(response, list):
                response = [p.get("text") if isinstance(p, dict) and "text" in p else p for p in response]
            parts.append({"type": "tool_call_response", "id": block.get("tool_use_id"), "response": response})
        elif kind == "thinking":
            parts.append({"type": "reasoning", "content": block.get("thinking") or ""})
        else:
            parts.append(_generic(block))
    return parts


def _anthropic_input(request: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    system = _anthropic_blocks(request.get("system")) if request.get("system") else []
    messages = [
        {"role": m.get("role") if isinstance(m.get("role"), str) else "user",
         "parts": _anthropic_blocks(m.get("content"))}
        for m in request.get("messages") or []
        if isinstance(m, dict)
    ]
    return system, messages


def _anthropic_output(response: dict[str, Any]) -> list[Any]:
    reason = response.get("stop_reason")
    return [{
        "role": response.get("role") or "assistant",
        "parts": _anthropic_blocks(response.get("content")),
        "finish_reason": reason if isinstance(reason, str) else "error",
    }]


def _tool_definitions(tools: object) -> list[dict[str, Any]]:
    """Chat (``{"type": "function", "function": {...}}``), Responses (flat) and Anthropic
    (``input_schema``) tool lists, as ``{"type", "name", "description"?, "parameters"?}``."""
    definitions: list[dict[str, Any]] = []
    for tool in tools if isinstance(tools, list) else []:
        if not isinstance(tool, dict):
            continue
        spec: dict[str, Any] = tool["function"] if isinstance(tool.get("function"), dict) else tool
        definition: dict[str, Any] = {"type": tool.get("type") or "function", "name": spec.get("name")}
        if spec.get("description") is not None:
            definition["description"] = spec["description"]
        parameters = spec.get("parameters", spec.get("input_schema"))
        if parameters is not None:
            definition["parameters"] = parameters
        definitions.append(definition)
    return definitions


_INPUT: dict[str, Callable[[dict[str, Any]], tuple[list[Any], list[Any]]]] = {
    "chat": _chat_input, "responses": _responses_input, "messages": _anthropic_input,
}
_OUTPUT: dict[str, Callable[[dict[str, Any]], list[Any]]] = {
    "chat": _chat_output, "responses": _responses_output, "messages": _anthropic_output,
}


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
