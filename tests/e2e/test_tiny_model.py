"""The tiny model server answers all three dialects, streamed and not, through the official SDKs.

No capture here: these pin down what the real upstream returns, so the capture tests can rely on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from otel_capture.demo import tiny_model
from otel_capture.demo.tiny_model import TinyModel, TinyModelError, ensure_model_file, start_tiny_model

pytestmark = pytest.mark.model

MAX_TOKENS = 12
PROMPT = "Name three colours."


@pytest.fixture
def openai_client(tiny_model: TinyModel) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tiny_model.base_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def anthropic_client(tiny_model: TinyModel) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=tiny_model.base_url, api_key="x", max_retries=0, timeout=60) as c:
        yield c


def test_serves_health_on_its_base_url(tiny_model: TinyModel) -> None:
    assert tiny_model.base_url.startswith("http://127.0.0.1:")
    assert not tiny_model.base_url.endswith("/v1")
    assert httpx.get(tiny_model.base_url + "/health").json() == {"status": "ok"}


def test_responses(openai_client: openai.OpenAI, tiny_model: TinyModel) -> None:
    response = openai_client.responses.create(
        model=tiny_model.model, input=PROMPT, max_output_tokens=MAX_TOKENS
    )
    assert response.model == tiny_model.model
    # llama.cpp reports "completed" even when max_output_tokens cut the answer short.
    assert response.status == "completed"
    assert response.output_text
    assert response.usage is not None
    assert response.usage.input_tokens > 0
    assert response.usage.output_tokens == MAX_TOKENS


def test_responses_streamed(openai_client: openai.OpenAI, tiny_model: TinyModel) -> None:
    # `responses.stream()` crashes on llama.cpp's events (no output_index); `create(stream=True)` works.
    events = list(
        openai_client.responses.create(
            model=tiny_model.model, input=PROMPT, max_output_tokens=MAX_TOKENS, stream=True
        )
    )
    types = [event.type for event in events]
    assert types[0] == "response.created"
    assert types.count("response.output_text.delta") >= 3
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.status == "completed"
    assert completed.response.usage is not None
    assert completed.response.usage.input_tokens > 0
    assert completed.response.usage.output_tokens > 0


def test_chat_completions(openai_client: openai.OpenAI, tiny_model: TinyModel) -> None:
    completion = openai_client.chat.completions.create(
        model=tiny_model.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS
    )
    assert completion.model == tiny_model.model
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 0
    assert completion.usage.completion_tokens > 0


def test_chat_completions_stop_sequence_finishes_with_stop(
    openai_client: openai.OpenAI, tiny_model: TinyModel
) -> None:
    completion = openai_client.chat.completions.create(
        model=tiny_model.model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=64,
        stop=["\n"],
    )
    assert completion.choices[0].finish_reason == "stop"


def test_chat_completions_streamed(openai_client: openai.OpenAI, tiny_model: TinyModel) -> None:
    chunks = list(
        openai_client.chat.completions.create(
            model=tiny_model.model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 3
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    usage_chunk = chunks[-1]  # include_usage: a last chunk with no choices and the usage
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens > 0
    assert usage_chunk.usage.completion_tokens > 0


def test_messages(anthropic_client: anthropic.Anthropic, tiny_model: TinyModel) -> None:
    message = anthropic_client.messages.create(
        model=tiny_model.model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": PROMPT}]
    )
    assert message.model == tiny_model.model
    assert message.stop_reason in ("max_tokens", "end_turn")
    # llama.cpp reports prompt-cache hits apart from input_tokens, as Anthropic does.
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 0
    assert message.usage.output_tokens > 0


def test_messages_streamed(anthropic_client: anthropic.Anthropic, tiny_model: TinyModel) -> None:
    with anthropic_client.messages.stream(
        model=tiny_model.model,
        max_tokens=MAX_TOKENS,
        system="Be brief.",
        messages=[{"role": "user", "content": PROMPT}],
    ) as stream:
        types = [event.type for event in stream]
        message = stream.get_final_message()
    assert types[0] == "message_start"
    assert types.count("content_block_delta") >= 3
    assert types[-2:] == ["message_delta", "message_stop"]
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 0
    assert message.usage.output_tokens > 0


def test_stop_ends_the_server_and_is_idempotent() -> None:
    model = start_tiny_model()
    url = model.base_url
    model.stop()
    model.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")


def test_model_is_assembled_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_CAPTURE_CACHE", str(tmp_path))
    lines: list[str] = []
    first = ensure_model_file(lines.append)
    assert first.parent == tmp_path
    assert lines == [f"assembling model into {first}…"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, first.name + ".sha256"]
    again: list[str] = []
    assert ensure_model_file(again.append) == first
    assert again == []  # valid already: not assembled twice
    first.write_bytes(b"truncated")
    assert ensure_model_file(again.append) == first
    assert again == [f"assembling model into {first}…"]  # a damaged file is replaced
    assert first.stat().st_size > 100_000_000


def test_a_server_that_cannot_start_raises_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    monkeypatch.setattr(tiny_model, "ensure_model_file", lambda progress=None: bad)
    with pytest.raises(TinyModelError, match="did not start") as caught:
        start_tiny_model()
    assert "bad.gguf" in str(caught.value)  # the tail of llama.cpp's log says what it tried to load
