"""Log-probs end to end with the real tiny model (llama.cpp + Gemma 3 270M) through the capture proxy writing
to a capture directory (issue #13 item 9): the same call streamed and not gives the same tokens line, and
its log-probs are real numbers, the ones the SDK received.

``temperature: 0`` and llama.cpp's ``cache_prompt: false``: with the prompt cache on, the second call reuses
the first one's cached prompt and its log-probs differ in the second decimal (different batches); without
it both calls compute the same numbers, bit for bit.

What llama.cpp's server sends (checked here, so a change shows): Chat Completions ``logprobs.content[]``
with each token's ``id`` (no ``prompt_token_ids``, no ``token_ids``: ``return_token_ids`` is vLLM's);
Responses ``"logprobs": []`` on every part, whatever ``include`` asks (``top_logprobs`` is refused), so no
tokens line; Messages no log-probs at all (the Anthropic API has none), so no tokens line.
"""

from __future__ import annotations

import json
import math
from typing import Any

import anthropic
import pytest
from support import call_and_tokens, rollout_client

from otel_capture import CaptureStore, read_model_call_records
from otel_capture.demo.tiny_model import TinyModel

pytestmark = pytest.mark.model

MAX_TOKENS = 6
MESSAGES = [{"role": "user", "content": "Name three colours."}]
SAME_NUMBERS = {"cache_prompt": False}  # llama.cpp: compute the prompt afresh, so both calls agree exactly


def _tokens(store: CaptureStore, rollout_id: str) -> dict[str, Any] | None:
    """The rollout's one call's tokens line (without its ids), or None when it has none."""
    record, tokens = call_and_tokens(store, rollout_id)
    assert record.status_code == 200 and record.error_category is None
    if tokens is None:
        return None
    return {k: v for k, v in tokens.items() if k not in ("rollout_id", "model_call_id")}


def test_chat_streamed_and_not_give_the_same_tokens_line(
    proxied: tuple[str, CaptureStore], tiny_model: TinyModel
) -> None:
    url, store = proxied
    request: dict[str, Any] = {
        "model": tiny_model.model,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": 1,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": SAME_NUMBERS,
    }
    with rollout_client(url, "chat-plain", timeout=120) as client:
        completion = client.chat.completions.create(**request)
    received: list[tuple[int, float]] = []
    with rollout_client(url, "chat-streamed", timeout=120) as client:
        for chunk in client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    received += [
                        ((e.model_extra or {})["id"], e.logprob) for e in choice.logprobs.content or []
                    ]

    plain, streamed = _tokens(store, "chat-plain"), _tokens(store, "chat-streamed")
    assert plain is not None and streamed is not None
    assert streamed == plain
    (generation,) = streamed["generations"]
    assert streamed["prompt_token_ids"] is None  # llama.cpp does not send them
    assert completion.usage is not None and len(generation["token_ids"]) == completion.usage.completion_tokens
    assert all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in generation["log_probs"])
    assert any(v < 0 for v in generation["log_probs"])
    # the numbers are the ones the SDK received, streamed and not
    assert list(zip(generation["token_ids"], generation["log_probs"], strict=True)) == received
    content = completion.choices[0].logprobs.content if completion.choices[0].logprobs else None
    assert content is not None
    assert [((e.model_extra or {})["id"], e.logprob) for e in content] == received
    assert all(len(e.top_logprobs) == 2 for e in content)


def test_responses_streamed_and_not_agree(proxied: tuple[str, CaptureStore], tiny_model: TinyModel) -> None:
    url, store = proxied
    request: dict[str, Any] = {
        "model": tiny_model.model,
        "input": "Name three colours.",
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "extra_body": SAME_NUMBERS,
    }
    with rollout_client(url, "resp-plain", timeout=120) as client:
        response = client.responses.create(**request)
    delta_log_probs: list[float] = []
    with rollout_client(url, "resp-streamed", timeout=120) as client:
        for event in client.responses.create(**request, stream=True):
            if event.type == "response.output_text.delta":
                delta_log_probs += [entry.logprob for entry in event.logprobs or []]
    plain, streamed = _tokens(store, "resp-plain"), _tokens(store, "resp-streamed")
    assert streamed == plain
    parts = [part for item in response.output if item.type == "message" for part in item.content]
    received = [e.logprob for part in parts if part.type == "output_text" for e in part.logprobs or []]
    assert delta_log_probs == received
    if plain is None:  # llama.cpp sends "logprobs": [] on every part
        assert received == []
    else:
        assert [g["log_probs"] for g in plain["generations"]] == [received]


def test_messages_carry_no_log_probs(proxied: tuple[str, CaptureStore], tiny_model: TinyModel) -> None:
    url, store = proxied
    request: dict[str, Any] = {
        "model": tiny_model.model,
        "max_tokens": MAX_TOKENS,
        "messages": MESSAGES,
        "extra_body": {"logprobs": True, "top_logprobs": 2},  # not Anthropic's API: llama.cpp ignores it
    }
    with anthropic.Anthropic(
        base_url=f"{url}/ng-rollout/msg", api_key="k", max_retries=0, timeout=120
    ) as client:
        received = [client.messages.create(**request).model_dump(mode="json")]
        received += [
            event.model_dump(mode="json") for event in client.messages.create(**request, stream=True)
        ]
    assert "logprobs" not in json.dumps(received)  # nothing for the capture to keep, streamed or not
    first, second = read_model_call_records(store, "msg")
    assert (first.stream, second.stream) == (False, True)
    assert first.status_code == second.status_code == 200
    assert store.read_token_lines("msg") is None
