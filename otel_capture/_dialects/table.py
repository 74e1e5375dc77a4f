"""The five dialects a model server speaks, and what each one means: one :class:`DialectSpec` per dialect.

Everything that depends on the dialect is named here: the request paths that select it, the span's GenAI
operation and provider, the ``openai.api.type``, the stream accumulator, the finish reasons and the
semconv message shapes. What is read by shape instead is not: usage and the derived record fields
(:mod:`.derive`) and token lines (:mod:`.tokens`) are read as NeMo Gym reads them, from whatever keys a
response carries, because Gym never consults a line's dialect. The data path is in
``docs/architecture.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .._attributes import OPERATION_CHAT, OPERATION_TEXT_COMPLETION
from . import content
from .chat import ChatCompletionsAccumulator
from .completions import CompletionsAccumulator, completions_input, completions_output
from .derive import chat_finish_reasons, messages_finish_reasons, responses_finish_reasons
from .generate import GenerateAccumulator, generate_finish_reasons, generate_input, generate_output
from .messages import MessagesAccumulator
from .responses import ResponsesAccumulator
from .stream import JsonDict, StreamAccumulator

__all__ = [
    "DIALECTS",
    "DIALECT_PATHS",
    "Dialect",
    "DialectSpec",
    "finish_reasons",
    "shape_dialect",
]

_logger = logging.getLogger(__name__)

Dialect = Literal["responses", "chat", "messages", "completions", "generate"]
InputMessages = Callable[[JsonDict], tuple[list[Any], list[Any]]]


@dataclass(frozen=True)
class DialectSpec:
    """What one dialect means, from its request path to its span attributes."""

    name: Dialect
    paths: tuple[str, ...]  # POST routes that select it (the middleware's lookup)
    operation_name: str  # gen_ai.operation.name
    provider_name: str  # gen_ai.provider.name
    openai_api_type: str | None  # openai.api.type; None for a dialect that is not an OpenAI API
    accumulator: Callable[[], StreamAccumulator]  # a fresh one per streamed call
    finish_reasons: Callable[[Mapping[str, Any]], list[str]]  # gen_ai.response.finish_reasons
    input_messages: InputMessages  # request -> (system instructions, input messages), semconv shape
    output_messages: Callable[[JsonDict], list[Any]]  # response -> output messages, semconv shape


RESPONSES = DialectSpec(
    name="responses",
    paths=("/v1/responses",),
    operation_name=OPERATION_CHAT,
    provider_name="openai",
    openai_api_type="responses",
    accumulator=ResponsesAccumulator,
    finish_reasons=responses_finish_reasons,
    input_messages=content.responses_input,
    output_messages=content.responses_output,
)
CHAT = DialectSpec(
    name="chat",
    paths=("/v1/chat/completions",),
    operation_name=OPERATION_CHAT,
    provider_name="openai",
    openai_api_type="chat_completions",
    accumulator=ChatCompletionsAccumulator,
    finish_reasons=chat_finish_reasons,
    input_messages=content.chat_input,
    output_messages=content.chat_output,
)
MESSAGES = DialectSpec(
    name="messages",
    paths=("/v1/messages",),
    operation_name=OPERATION_CHAT,
    provider_name="anthropic",
    openai_api_type=None,
    accumulator=MessagesAccumulator,
    finish_reasons=messages_finish_reasons,
    input_messages=content.messages_input,
    output_messages=content.messages_output,
)

COMPLETIONS = DialectSpec(  # the legacy text completions (token-in/token-out training): .completions
    name="completions",
    paths=("/v1/completions",),
    operation_name=OPERATION_TEXT_COMPLETION,
    provider_name="openai",
    openai_api_type=None,  # the semconv names chat_completions and responses only
    accumulator=CompletionsAccumulator,
    finish_reasons=chat_finish_reasons,  # each choice's finish_reason, as Chat
    input_messages=completions_input,
    output_messages=completions_output,
)

# Token-in/token-out (.generate): vLLM's /inference/v1/generate (--enable-scale-out) and SGLang's native
# /generate. The prompt is token ids the trainer rendered itself, continued by the model: a text completion
# in the semconv's words ("text_completion": OpenAI's legacy Completions is its example), not
# "generate_content" (Gemini's multimodal message API). One dialect serves two engines, so no one provider
# name is true of it: the semconv's "_OTHER".
GENERATE = DialectSpec(
    name="generate",
    paths=("/inference/v1/generate", "/generate"),
    operation_name=OPERATION_TEXT_COMPLETION,
    provider_name="_OTHER",
    openai_api_type=None,
    accumulator=GenerateAccumulator,
    finish_reasons=generate_finish_reasons,
    input_messages=generate_input,
    output_messages=generate_output,
)

DIALECTS: dict[str, DialectSpec] = {
    spec.name: spec for spec in (RESPONSES, CHAT, MESSAGES, COMPLETIONS, GENERATE)
}
DIALECT_PATHS: dict[str, Dialect] = {path: spec.name for spec in DIALECTS.values() for path in spec.paths}


def shape_dialect(response: Mapping[str, Any]) -> Dialect | None:
    """The dialect a response's shape suggests, with NeMo Gym's precedence (output, choices, content)."""
    if isinstance(response.get("output"), list):
        return "responses"
    if isinstance(response.get("choices"), list):
        return "chat"
    if isinstance(response.get("content"), list) or "stop_reason" in response:
        return "messages"
    return None


def finish_reasons(response: object, dialect: str | None = None) -> list[str]:
    """Every finish reason of a call, for ``gen_ai.response.finish_reasons``; never raises.

    An unknown or missing ``dialect`` is guessed from the response's shape (:func:`shape_dialect`).
    """
    if not isinstance(response, Mapping):
        return []
    spec = DIALECTS.get(dialect) if dialect is not None else None
    if spec is None:
        guessed = shape_dialect(response)
        spec = DIALECTS[guessed] if guessed is not None else None
    return spec.finish_reasons(response) if spec is not None else []
