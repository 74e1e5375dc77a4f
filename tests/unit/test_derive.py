"""The derivation rules of NeMo Gym 0.7.0, and our span-side ``finish_reasons``."""

from __future__ import annotations

from typing import Any

import pytest

from otel_capture._dialects import finish_reasons, shape_dialect
from otel_capture._dialects.derive import (
    cache_signal,
    derive_call_facts,
    finish_reason,
    response_model,
    token_stats,
    tool_calls_and_reasoning,
)

# --- token stats --------------------------------------------------------------------------------------


def test_chat_usage() -> None:
    usage = {
        "prompt_tokens": 30,
        "completion_tokens": 7,
        "total_tokens": 37,
        "completion_tokens_details": {"reasoning_tokens": 3},
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert token_stats(usage) == {
        "tokens_in": 30,
        "tokens_out": 7,
        "tokens_reasoning": 3,
        "tokens_total": 37,
        "cache_creation_tokens": None,
    }
    assert cache_signal(usage) == (False, 0)


def test_responses_usage() -> None:
    usage = {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 8},
        "output_tokens": 12,
        "output_tokens_details": {"reasoning_tokens": 5},
        "total_tokens": 32,
    }
    assert token_stats(usage)["tokens_reasoning"] == 5
    assert cache_signal(usage) == (True, 8)


def test_anthropic_cache_is_folded_into_tokens_in() -> None:
    usage = {
        "input_tokens": 5,
        "output_tokens": 9,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 20,
    }
    stats = token_stats(usage)
    assert stats["tokens_in"] == 125
    assert stats["cache_creation_tokens"] == 20
    assert stats["tokens_total"] == 134  # no total_tokens: in + out
    assert cache_signal(usage) == (True, 100)


def test_zero_cache_fields_alone_do_not_invent_an_input_count() -> None:
    assert token_stats({"cache_read_input_tokens": 0, "cache_creation_input_tokens": 0})["tokens_in"] is None
    assert token_stats({"cache_read_input_tokens": 4})["tokens_in"] == 4


@pytest.mark.parametrize("bad", [True, 3.0, -1, "3", None])
def test_counts_must_be_exact_non_negative_ints(bad: object) -> None:
    stats = token_stats({"input_tokens": bad, "prompt_tokens": 11, "output_tokens": bad})
    assert stats["tokens_in"] == 11  # falls back to prompt_tokens
    assert stats["tokens_out"] is None
    assert stats["tokens_total"] is None


def test_reasoning_falls_back_to_top_level_key_and_usage_must_be_a_mapping() -> None:
    assert token_stats({"reasoning_output_tokens": 4})["tokens_reasoning"] == 4
    assert token_stats("nope")["tokens_in"] is None
    assert cache_signal(None) == (None, None)
    assert cache_signal({"cached_input_tokens": 2}) == (True, 2)
    assert cache_signal({"prompt_tokens_details": {"cached_input_tokens": 6}}) == (True, 6)


# --- tool calls and reasoning -------------------------------------------------------------------------


def test_responses_function_calls_and_reasoning_from_summary_only() -> None:
    response = {
        "output": [
            {
                "type": "reasoning",
                "summary": [{"text": "a"}, {"text": ""}, {"text": "b"}],
                "content": [{"type": "reasoning_text", "text": "ignored"}],
            },
            {"type": "function_call", "id": "fc_1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "not json"},
            {"type": "custom_tool_call", "call_id": "c3", "name": "h", "input": "x"},
            "junk",
        ]
    }
    calls, reasoning = tool_calls_and_reasoning(response)
    assert calls == [
        {"call_id": "fc_1", "name": "f", "arguments": {"x": 1}},
        {"call_id": "c2", "name": "g", "arguments": {"_raw": "not json"}},
    ]
    assert reasoning == "a\nb"


def test_reasoning_text_content_alone_gives_no_reasoning() -> None:
    response = {"output": [{"type": "reasoning", "summary": [], "content": [{"text": "hidden"}]}]}
    assert tool_calls_and_reasoning(response) == ([], None)


def test_chat_tool_calls_of_every_choice() -> None:
    response = {
        "choices": [
            {
                "message": {
                    "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}],
                    "reasoning_content": "r0",
                },
                "finish_reason": "tool_calls",
            },
            {
                "message": {
                    "tool_calls": [
                        {"id": "b", "function": {"name": "g", "arguments": {"k": "v"}}},
                        {"id": "c", "function": None},
                    ],
                    "reasoning": "r1",
                },
                "finish_reason": "stop",
            },
            {"message": {"reasoning_content": ["not", "a", "string"], "reasoning": "skipped"}},
        ]
    }
    calls, reasoning = tool_calls_and_reasoning(response)
    assert calls == [
        {"call_id": "a", "name": "f", "arguments": {}},
        {"call_id": "b", "name": "g", "arguments": {"k": "v"}},
        {"call_id": "c", "name": None, "arguments": {}},
    ]
    # A truthy non-string reasoning_content wins over ``reasoning`` and then gives nothing (as in Gym).
    assert reasoning == "r0\nr1"


def test_anthropic_tool_use_and_thinking() -> None:
    response = {
        "content": [
            {"type": "thinking", "thinking": "t1"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "tu", "name": "w", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "tu2", "name": "w", "input": '{"not": "parsed"}'},
            {"type": "text", "text": "hi"},
        ]
    }
    calls, reasoning = tool_calls_and_reasoning(response)
    assert calls[0] == {"call_id": "tu", "name": "w", "arguments": {"city": "Paris"}}
    assert calls[1]["arguments"] == '{"not": "parsed"}'  # Gym does not parse Anthropic string input
    assert reasoning == "t1"


def test_arguments_are_parsed_with_stdlib_json() -> None:
    big = 2**70
    calls, _ = tool_calls_and_reasoning(
        {"output": [{"type": "function_call", "arguments": f'{{"n": {big}}}'}]}
    )
    assert calls[0]["arguments"] == {"n": big}
    assert type(calls[0]["arguments"]["n"]) is int


def test_shapes_gym_trips_over_raise() -> None:
    with pytest.raises(TypeError):
        derive_call_facts({"choices": [{"message": {"tool_calls": 5}}]}, None)


# --- scalar facts -------------------------------------------------------------------------------------


def test_finish_reason_is_gyms_first_string() -> None:
    assert finish_reason({"status": "completed", "incomplete_details": None}) is None
    assert finish_reason({"incomplete_details": {"reason": "max_output_tokens"}}) == "max_output_tokens"
    assert finish_reason({"choices": [{"finish_reason": "length"}, {"finish_reason": "stop"}]}) == "length"
    assert finish_reason({"stop_reason": "end_turn"}) == "end_turn"
    assert finish_reason({"choices": ["x"]}) is None


def test_response_model_falls_back_to_request() -> None:
    assert response_model({"model": "m"}, {"model": "r"}) == "m"
    assert response_model({"model": ""}, {"model": "r"}) == "r"
    assert response_model({"model": 5}, {"model": "r"}) is None


def test_derive_call_facts_ignores_non_dict_bodies() -> None:
    facts = derive_call_facts(["not", "a", "dict"], "nor this")
    assert facts["tool_calls"] == [] and facts["model"] is None and facts["tokens_in"] is None


# --- finish_reasons (span side) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "dialect", "expected"),
    [
        (
            {"choices": [{"finish_reason": "stop"}, {"finish_reason": None}, {"finish_reason": "length"}]},
            "chat",
            ["stop", "length"],
        ),
        ({"stop_reason": "tool_use", "content": []}, "messages", ["tool_use"]),
        ({"status": "completed", "output": []}, "responses", ["completed"]),
        (
            {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}, "output": []},
            "responses",
            ["max_output_tokens"],
        ),
        ({"choices": [{"finish_reason": "stop"}]}, None, ["stop"]),
        ({"stop_reason": "end_turn"}, "unknown", ["end_turn"]),
        ({"status": "failed", "output": []}, None, ["failed"]),
        ({}, None, []),
        (None, "chat", []),
        ({"choices": "x"}, "chat", []),
    ],
)
def test_finish_reasons(response: Any, dialect: str | None, expected: list[str]) -> None:
    assert finish_reasons(response, dialect) == expected


def test_shape_dialect_uses_gyms_precedence() -> None:
    assert shape_dialect({"output": [], "choices": []}) == "responses"
    assert shape_dialect({"choices": [], "content": []}) == "chat"
    assert shape_dialect({"content": []}) == "messages"
    assert shape_dialect({"detail": "x"}) is None
