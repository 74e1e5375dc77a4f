"""Request/response bodies → GenAI semconv v1.41.1 attributes, and content that stays valid JSON when cut."""

from __future__ import annotations

import json

import pytest

from otel_capture import _attributes as A
from otel_capture._telemetry import content_attributes, request_attributes, response_attributes
from otel_capture._telemetry.semconv import bounded_json


def test_request_parameters() -> None:
    attributes = request_attributes(
        {
            "model": "m",
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "seed": 7,
            "max_completion_tokens": 99,
            "frequency_penalty": 0.1,
            "presence_penalty": 0.2,
            "n": 2,
            "stop": "\n",
            "stream": True,
            "response_format": {"type": "json_schema"},
            "service_tier": "flex",
        }
    )
    assert attributes == {
        A.GEN_AI_REQUEST_TEMPERATURE: 0.0,
        A.GEN_AI_REQUEST_TOP_P: 0.5,
        A.GEN_AI_REQUEST_TOP_K: 40.0,
        A.GEN_AI_REQUEST_SEED: 7,
        A.GEN_AI_REQUEST_MAX_TOKENS: 99,
        A.GEN_AI_REQUEST_FREQUENCY_PENALTY: 0.1,
        A.GEN_AI_REQUEST_PRESENCE_PENALTY: 0.2,
        A.GEN_AI_REQUEST_CHOICE_COUNT: 2,
        A.GEN_AI_REQUEST_STOP_SEQUENCES: ["\n"],
        A.GEN_AI_REQUEST_STREAM: True,
        A.GEN_AI_OUTPUT_TYPE: "json",
        A.OPENAI_REQUEST_SERVICE_TIER: "flex",
    }


def test_request_choice_count_of_one_and_auto_tier_are_left_out() -> None:
    assert request_attributes({"n": 1, "service_tier": "auto", "temperature": True}) == {}


def test_responses_conversation_and_text_format() -> None:
    attributes = request_attributes({"conversation": {"id": "conv_1"}, "text": {"format": {"type": "text"}}})
    assert attributes == {A.GEN_AI_CONVERSATION_ID: "conv_1", A.GEN_AI_OUTPUT_TYPE: "text"}


def test_anthropic_input_tokens_include_cache() -> None:
    response = {
        "id": "msg_1",
        "model": "claude",
        "stop_reason": "end_turn",
        "content": [],
        "usage": {
            "input_tokens": 10,
            "cache_read_input_tokens": 100,
            "cache_creation_input_tokens": 5,
            "output_tokens": 3,
        },
    }
    attributes = response_attributes(response, "messages")
    assert attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == 115
    assert attributes[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 100
    assert attributes[A.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS] == 5
    assert attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ["end_turn"]


def test_openai_cache_reasoning_and_fingerprint() -> None:
    response = {
        "id": "chatcmpl-1",
        "model": "gpt",
        "system_fingerprint": "fp_1",
        "service_tier": "default",
        "choices": [{"finish_reason": "stop"}, {"finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 50,
            "completion_tokens": 20,
            "prompt_tokens_details": {"cached_tokens": 30},
            "completion_tokens_details": {"reasoning_tokens": 12},
        },
    }
    attributes = response_attributes(response, "chat")
    assert attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == 50  # OpenAI's input already counts the cache
    assert attributes[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] == 30
    assert attributes[A.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS] == 12
    assert attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ["stop", "length"]
    assert attributes[A.OPENAI_RESPONSE_SYSTEM_FINGERPRINT] == "fp_1"
    assert attributes[A.OPENAI_RESPONSE_SERVICE_TIER] == "default"


CHAT_REQUEST = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {"name": "get", "description": "d", "parameters": {"type": "object"}},
        }
    ],
}


def test_chat_content() -> None:
    response = {"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "Rain."}}]}
    attributes = {
        k: json.loads(v) for k, v in content_attributes("chat", CHAT_REQUEST, response, 10_000).items()
    }
    assert attributes[A.GEN_AI_INPUT_MESSAGES] == [
        {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
        {"role": "user", "parts": [{"type": "text", "content": "weather?"}]},
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": "c1", "name": "get", "arguments": {"city": "Oslo"}}],
        },
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "rain"}]},
    ]
    assert attributes[A.GEN_AI_OUTPUT_MESSAGES] == [
        {"role": "assistant", "parts": [{"type": "text", "content": "Rain."}], "finish_reason": "stop"}
    ]
    assert attributes[A.GEN_AI_TOOL_DEFINITIONS] == [
        {"type": "function", "name": "get", "description": "d", "parameters": {"type": "object"}}
    ]
    assert A.GEN_AI_SYSTEM_INSTRUCTIONS not in attributes  # Chat keeps system messages among the messages


def test_responses_content() -> None:
    request = {
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {}}],
    }
    response = {
        "status": "completed",
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        ],
    }
    attributes = {
        k: json.loads(v) for k, v in content_attributes("responses", request, response, 10_000).items()
    }
    assert attributes[A.GEN_AI_SYSTEM_INSTRUCTIONS] == [{"type": "text", "content": "be brief"}]
    assert attributes[A.GEN_AI_INPUT_MESSAGES][1] == {
        "role": "tool",
        "parts": [{"type": "tool_call_response", "id": "c1", "response": "42"}],
    }
    assert attributes[A.GEN_AI_OUTPUT_MESSAGES] == [
        {
            "role": "assistant",
            "finish_reason": "completed",
            "parts": [
                {"type": "reasoning", "content": "think"},
                {"type": "text", "content": "Hello"},
                {"type": "tool_call", "id": "c2", "name": "f", "arguments": {}},
            ],
        }
    ]


def test_anthropic_content() -> None:
    request = {
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}]}
                ],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    response = {
        "role": "assistant",
        "stop_reason": "tool_use",
        "content": [
            {"type": "thinking", "thinking": "hmm"},
            {"type": "tool_use", "id": "t2", "name": "f", "input": {"a": 1}},
        ],
    }
    attributes = {
        k: json.loads(v) for k, v in content_attributes("messages", request, response, 10_000).items()
    }
    assert attributes[A.GEN_AI_SYSTEM_INSTRUCTIONS] == [{"type": "text", "content": "be brief"}]
    assert attributes[A.GEN_AI_INPUT_MESSAGES][1]["parts"] == [
        {"type": "tool_call_response", "id": "t1", "response": ["ok"]}
    ]
    assert attributes[A.GEN_AI_OUTPUT_MESSAGES] == [
        {
            "role": "assistant",
            "finish_reason": "tool_use",
            "parts": [
                {"type": "reasoning", "content": "hmm"},
                {"type": "tool_call", "id": "t2", "name": "f", "arguments": {"a": 1}},
            ],
        }
    ]
    assert attributes[A.GEN_AI_TOOL_DEFINITIONS] == [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}
    ]


@pytest.mark.parametrize("limit", [40, 64, 100, 300, 1000])
def test_cut_content_is_still_valid_json_within_the_limit(limit: int) -> None:
    messages = [{"role": "user", "parts": [{"type": "text", "content": "é" * 500 + '"\\'}]} for _ in range(3)]
    text = bounded_json(messages, limit)
    assert len(text) <= limit
    parsed = json.loads(text)
    assert isinstance(parsed, list)
    if parsed:  # short strings (roles, types) survive whole; long ones are cut and marked
        assert parsed[-1]["role"] == "user" and parsed[-1]["parts"][0]["content"].endswith("…")


def test_messages_are_dropped_oldest_first_when_cutting_strings_is_not_enough() -> None:
    messages = [{"role": f"r{i}", "parts": []} for i in range(20)]
    parsed = json.loads(bounded_json(messages, 60))
    assert parsed and parsed[-1]["role"] == "r19"


def test_short_content_is_unchanged() -> None:
    assert json.loads(bounded_json([{"a": "b"}], 1000)) == [{"a": "b"}]


def test_content_of_unexpected_shapes_does_not_raise() -> None:
    assert content_attributes("chat", {"messages": "nope", "tools": 3}, {"choices": [1]}, 100) == {}
