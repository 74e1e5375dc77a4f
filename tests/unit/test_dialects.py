"""The dialect table: every dialect the code can name has one entry, and each request path selects one."""

from __future__ import annotations

from typing import get_args

from otel_capture._dialects import DIALECT_PATHS, DIALECTS, Dialect
from otel_capture._dialects.sse import SSEDecoder


def test_every_dialect_has_exactly_one_entry() -> None:
    assert set(DIALECTS) == set(get_args(Dialect))
    assert all(name == spec.name for name, spec in DIALECTS.items())


def test_each_path_selects_the_dialect_that_lists_it() -> None:
    assert DIALECT_PATHS == {
        "/v1/responses": "responses",
        "/v1/chat/completions": "chat",
        "/v1/messages": "messages",
        "/v1/completions": "completions",
        "/inference/v1/generate": "generate",  # vLLM's token-in/token-out (--enable-scale-out)
        "/generate": "generate",  # SGLang's native one
    }


def test_only_the_openai_dialects_carry_an_openai_api_type() -> None:
    assert {name: spec.openai_api_type for name, spec in DIALECTS.items()} == {
        "responses": "responses",
        "chat": "chat_completions",
        "messages": None,
        "completions": None,  # the semconv names no api type for the legacy completions
        "generate": None,
    }
    assert {name: spec.provider_name for name, spec in DIALECTS.items()} == {
        "responses": "openai",
        "chat": "openai",
        "messages": "anthropic",
        "completions": "openai",
        "generate": "_OTHER",  # one dialect of two engines (vLLM, SGLang): the semconv's fallback
    }


def test_each_entry_reassembles_and_reads_finish_reasons_of_its_own_dialect() -> None:
    streams = {
        "chat": b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
        b"data: [DONE]\n\n",
        "messages": b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","role":"assistant",'
        b'"content":[]}}\n\nevent: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
        b'"end_turn"}}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n',
        "responses": b'data: {"type":"response.completed","response":{"id":"r","status":"completed",'
        b'"output":[]}}\n\n',
        "completions": b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"hi",'
        b'"finish_reason":"length"}]}\n\ndata: [DONE]\n\n',
        "generate": b'data: {"request_id":"g","choices":[{"index":0,"token_ids":[7],"finish_reason":"stop"}]}'
        b"\n\ndata: [DONE]\n\n",
    }
    expected = {
        "chat": ["stop"],
        "messages": ["end_turn"],
        "responses": ["completed"],
        "completions": ["length"],
        "generate": ["stop"],
    }
    for name, spec in DIALECTS.items():
        accumulator = spec.accumulator()
        for event in SSEDecoder().feed(streams[name]):
            accumulator.add(event)
        result = accumulator.result()
        assert accumulator.terminal == "completed", name
        assert result is not None
        assert spec.finish_reasons(result) == expected[name]
