"""All three dialects streamed from the real tiny model (llama.cpp + Gemma 3 270M) through the capture
proxy with the official SDKs: each record's reassembled response is what the SDK accumulated."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from otel_capture import CaptureStore, ModelCallRecord, read_model_call_records
from otel_capture.demo.tiny_model import TinyModel

pytestmark = pytest.mark.model


def _only_record(store: CaptureStore, rollout_id: str) -> ModelCallRecord:
    (record,) = read_model_call_records(store, rollout_id)
    assert record.stream is True and record.error_category is None and record.status_code == 200
    assert record.response_raw is None  # a clean stream is stored once, reassembled
    assert record.latency_ttft_ms is not None and record.latency_total_ms is not None
    assert 0 < record.latency_ttft_ms < record.latency_total_ms
    assert record.tokens_out is not None and record.tokens_out > 0
    return record


def test_responses_stream(proxied: tuple[str, CaptureStore], tiny_model: TinyModel) -> None:
    url, store = proxied
    with openai.OpenAI(base_url=f"{url}/ng-rollout/tiny-resp/v1", api_key="k", max_retries=0) as client:
        # responses.stream() cannot parse llama.cpp's events (no output_index): iterate create(stream=True)
        deltas: list[str] = []
        completed: dict[str, Any] | None = None
        for event in client.responses.create(
            model=tiny_model.model, input="Count to five.", max_output_tokens=12, stream=True
        ):
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                completed = event.response.model_dump(mode="json", exclude_unset=True)
    assert completed is not None and deltas
    record = _only_record(store, "tiny-resp")
    assert record.response is not None
    text = "".join(part["text"] for item in record.response["output"] for part in item.get("content") or [])
    assert text == "".join(deltas)
    assert record.response["usage"] == completed["usage"]
    assert record.response["id"] == completed["id"]


def test_chat_stream(proxied: tuple[str, CaptureStore], tiny_model: TinyModel) -> None:
    url, store = proxied
    with openai.OpenAI(base_url=f"{url}/ng-rollout/tiny-chat/v1", api_key="k", max_retries=0) as client:
        state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(
            model=tiny_model.model,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        ):
            state.handle_chunk(chunk)
    sdk = state.current_completion_snapshot
    record = _only_record(store, "tiny-chat")
    assert record.response is not None
    (choice,) = record.response["choices"]
    assert choice["message"]["content"] == sdk.choices[0].message.content
    assert choice["finish_reason"] == sdk.choices[0].finish_reason == record.finish_reason
    assert sdk.usage is not None
    assert (record.tokens_in, record.tokens_out) == (sdk.usage.prompt_tokens, sdk.usage.completion_tokens)


def test_messages_stream(proxied: tuple[str, CaptureStore], tiny_model: TinyModel) -> None:
    url, store = proxied
    with (
        anthropic.Anthropic(base_url=f"{url}/ng-rollout/tiny-msg", api_key="k", max_retries=0) as client,
        client.messages.stream(
            model=tiny_model.model, max_tokens=12, messages=[{"role": "user", "content": "Count to five."}]
        ) as stream,
    ):
        final = stream.get_final_message().model_dump(mode="json", exclude_unset=True)
    record = _only_record(store, "tiny-msg")
    assert record.response is not None
    assert record.response["content"] == final["content"]
    assert record.response["stop_reason"] == final["stop_reason"] == record.finish_reason
    assert record.response["usage"]["output_tokens"] == final["usage"]["output_tokens"]
    assert record.response["id"] == final["id"]
