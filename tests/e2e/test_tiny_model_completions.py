"""``/v1/completions`` end to end with the real tiny model (llama.cpp + Gemma 3 270M) through the capture
proxy writing to a capture directory (issue 22 item 5), called with the openai SDK's ``completions.create``:
a text prompt and a prompt of token ids, streamed and not, give one record each and the same tokens line,
the log-probs the SDK received, and no ``tokens_missing`` (the log-probs asked for are there).

What llama.cpp's server sends (checked here, so a change shows): the Completions shape with Chat's
log-probs, ``choices[i].logprobs.content[]`` with each token's ``id`` (not the legacy four lists), in a
stream one token per chunk and the ``finish_reason`` in a last chunk without log-probs; no
``prompt_token_ids`` (``return_token_ids`` is vLLM's). ``temperature: 0`` and ``cache_prompt: false`` so
both calls compute the same numbers (see ``test_tiny_model_tokens.py``). Only ``/v1/completions``:
llama.cpp's ``/completions`` without ``/v1`` is its own native API, another shape (``docs/tokens.md``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from support import call_and_tokens, rollout_client

from otel_capture import CaptureStore, read_model_call_records
from otel_capture.demo.tiny_model import TinyModel

pytestmark = pytest.mark.model

MAX_TOKENS = 5


def _tokens(store: CaptureStore, rollout_id: str) -> dict[str, Any]:
    record, tokens = call_and_tokens(store, rollout_id)
    assert (record.dialect, record.status_code, record.error_category) == ("completions", 200, None)
    assert record.tokens_out == MAX_TOKENS and record.finish_reason == "length"
    assert record.tokens_missing is None
    assert tokens is not None
    return {k: v for k, v in tokens.items() if k not in ("rollout_id", "model_call_id")}


@pytest.mark.parametrize(
    "prompt", ["The capital of France is", [2, 818, 5279, 529, 7001, 563]], ids=["text", "ids"]
)
def test_completions_streamed_and_not_give_the_same_tokens_line(
    proxied: tuple[str, CaptureStore], tiny_model: TinyModel, prompt: Any
) -> None:
    url, store = proxied
    request: dict[str, Any] = {
        "model": tiny_model.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": 1,
        "logprobs": 2,
        "extra_body": {"cache_prompt": False},
    }
    with rollout_client(url, "plain", timeout=120) as client:
        completion = client.completions.create(**request)
    text = ""
    received: list[float] = []
    with rollout_client(url, "streamed", timeout=120) as client:
        for chunk in client.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        ):
            for choice in chunk.choices:
                text += choice.text
                content = ((choice.logprobs.model_extra or {}) if choice.logprobs else {}).get(
                    "content"
                ) or []
                received += [entry["logprob"] for entry in content]

    plain, streamed = _tokens(store, "plain"), _tokens(store, "streamed")
    assert streamed == plain
    (generation,) = plain["generations"]
    assert len(generation["token_ids"]) == len(generation["log_probs"]) == MAX_TOKENS
    assert all(math.isfinite(p) and p <= 0 for p in generation["log_probs"])
    assert generation["log_probs"] == received  # what the SDK received, streamed
    assert text == completion.choices[0].text
    (record,) = read_model_call_records(store, "streamed")
    assert record.response is not None and record.response["choices"][0]["text"] == text
