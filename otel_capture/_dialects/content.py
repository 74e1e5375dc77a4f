"""Each dialect's messages in the GenAI semconv shape: request and response bodies in, lists out. Pure.

The semconv JSON schema's messages are ``{"role", "parts": [...]}``; :mod:`otel_capture._telemetry.semconv` turns
these lists into the opt-in content attributes. One ``*_input`` (system instructions, messages) and one
``*_output`` (output messages) per dialect, named in the dialect table (:mod:`.table`).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from .derive import responses_finish_reasons

__all__ = [
    "chat_input",
    "chat_output",
    "messages_input",
    "messages_output",
    "responses_input",
    "responses_output",
    "tool_definitions",
]

_logger = logging.getLogger(__name__)


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
                parts.append(
                    {"type": "uri", "modality": "image", "uri": str(part["image_url"].get("url", ""))}
                )
            else:
                parts.append(_generic(part))
    return parts


def _chat_tool_calls(calls: object) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts.append(
                {
                    "type": "tool_call",
                    "id": call.get("id"),
                    "name": function.get("name"),
                    "arguments": _arguments(function.get("arguments")),
                }
            )
    return parts


def chat_input(request: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    messages: list[dict[str, Any]] = []
    for message in request.get("messages") or []:
        if not isinstance(message, dict):
            continue
        role = message.get("role") if isinstance(message.get("role"), str) else "user"
        if role == "tool":
            parts = [
                {
                    "type": "tool_call_response",
                    "id": message.get("tool_call_id"),
                    "response": message.get("content"),
                }
            ]
        else:
            parts = _chat_parts(message.get("content")) + _chat_tool_calls(message.get("tool_calls"))
        entry: dict[str, Any] = {"role": role, "parts": parts}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        messages.append(entry)
    return [], messages  # Chat keeps system messages among the messages


def chat_output(response: dict[str, Any]) -> list[Any]:
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
        output.append(
            {
                "role": message.get("role") or "assistant",
                "parts": parts,
                "finish_reason": choice.get("finish_reason") or "error",
            }
        )
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
        return "assistant", [
            {
                "type": "tool_call",
                "id": item.get("call_id"),
                "name": item.get("name"),
                "arguments": _arguments(item.get("arguments")),
            }
        ]
    if kind == "function_call_output":
        return "tool", [
            {"type": "tool_call_response", "id": item.get("call_id"), "response": item.get("output")}
        ]
    if kind == "reasoning":
        texts: list[str] = [
            s["text"]
            for s in (item.get("summary") or []) + (item.get("content") or [])
            if isinstance(s, dict) and isinstance(s.get("text"), str)
        ]
        return "assistant", [{"type": "reasoning", "content": "\n".join(texts)}]
    role: str = item["role"] if isinstance(item.get("role"), str) else "user"
    if kind in (None, "message"):
        return role, _responses_content(item.get("content"))
    return "assistant", [_generic(item)]


def responses_input(request: dict[str, Any]) -> tuple[list[Any], list[Any]]:
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


def responses_output(response: dict[str, Any]) -> list[Any]:
    parts: list[dict[str, Any]] = []
    for item in response.get("output") or []:
        if isinstance(item, dict):
            parts += _responses_item(item)[1]
    reasons = responses_finish_reasons(response)
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
            parts.append(
                {
                    "type": "tool_call" if kind == "tool_use" else "server_tool_call",
                    "id": block.get("id"),
                    "name": block.get("name"),
                    "arguments": block.get("input"),
                }
            )
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


def messages_input(request: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    system = _anthropic_blocks(request.get("system")) if request.get("system") else []
    messages = [
        {
            "role": m.get("role") if isinstance(m.get("role"), str) else "user",
            "parts": _anthropic_blocks(m.get("content")),
        }
        for m in request.get("messages") or []
        if isinstance(m, dict)
    ]
    return system, messages


def messages_output(response: dict[str, Any]) -> list[Any]:
    reason = response.get("stop_reason")
    return [
        {
            "role": response.get("role") or "assistant",
            "parts": _anthropic_blocks(response.get("content")),
            "finish_reason": reason if isinstance(reason, str) else "error",
        }
    ]


def tool_definitions(tools: object) -> list[dict[str, Any]]:
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
