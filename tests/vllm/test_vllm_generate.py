"""Token-in/token-out on a real vLLM 0.32.0 (``--enable-scale-out``): ``POST /inference/v1/generate`` with
prompt ids the trainer rendered itself (here from vLLM's own ``/tokenize``), streamed and not, zero-code
and through the capture proxy, is recorded equal to what the client received, and its tokens line carries
the prompt ids, the output ids and their log-probs. The routes around it (``/tokenize``, ``/v1/models``,
``/health``) stay unrecorded (issue 32, items 2 and 3)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from support import call_and_tokens
from vllm_backend import MODEL_NAME

from otel_capture import CaptureStore

pytestmark = pytest.mark.vllm

MAX_TOKENS = 6


def _prompt_ids(client: httpx.Client, url: str) -> list[int]:
    answer = client.post(f"{url}/tokenize", json={"model": MODEL_NAME, "prompt": "The capital of France is"})
    answer.raise_for_status()
    ids: list[int] = answer.json()["tokens"]
    assert ids
    return ids


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_generate_call_is_recorded_as_the_client_got_it(
    front: tuple[str, CaptureStore], stream: bool, request: pytest.FixtureRequest
) -> None:
    url, store = front
    rollout_id = f"generate-{request.node.callspec.id}"
    with httpx.Client(timeout=300, headers={"x-rollout-id": rollout_id}) as client:
        prompt = _prompt_ids(client, url)
        for method, path in (("GET", "/v1/models"), ("GET", "/health")):
            client.request(method, url + path).raise_for_status()
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "token_ids": prompt,
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1},
            "return_token_ids": True,
        }
        if not stream:
            answer = client.post(f"{url}/inference/v1/generate", json=body)
            assert answer.status_code == 200, answer.text
            received = answer.json()
            (choice,) = received["choices"]
            ids, content = choice["token_ids"], choice["logprobs"]["content"]
            usage, finish = received["usage"], choice["finish_reason"]
            prompt_back = received["prompt_token_ids"]
        else:
            body.update(stream=True, stream_options={"include_usage": True})
            with client.stream("POST", f"{url}/inference/v1/generate", json=body) as answer:
                assert answer.status_code == 200
                lines = [line for line in answer.iter_lines() if line.startswith("data:")]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[5:]) for line in lines[:-1]]
            ids, content, finish = [], [], None
            for chunk in chunks:
                for choice in chunk["choices"]:
                    ids += choice["token_ids"]
                    content += choice["logprobs"]["content"]
                    finish = choice["finish_reason"] or finish
            usage, prompt_back = chunks[-1]["usage"], chunks[0]["prompt_token_ids"]

    assert ids and len(content) == len(ids) and prompt_back == prompt
    record, line = call_and_tokens(store, rollout_id)  # the one model call: /tokenize & co unrecorded
    assert (record.dialect, record.status_code, record.error_category, record.stream) == (
        "generate",
        200,
        None,
        stream,
    )
    assert record.request is not None and record.request["token_ids"] == prompt
    assert record.response is not None
    if not stream:
        assert record.response == received  # the body as vLLM sent it
    else:
        (recorded,) = record.response["choices"]
        assert (recorded["token_ids"], recorded["logprobs"]["content"]) == (ids, content)
        assert (recorded["finish_reason"], record.response["usage"]) == (finish, usage)
        assert record.response["prompt_token_ids"] == prompt
    assert (record.tokens_in, record.tokens_out) == (len(prompt), len(ids))
    assert (record.tokens_in, record.tokens_out) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert record.finish_reason == finish and record.model == MODEL_NAME
    assert line is not None and line["prompt_token_ids"] == prompt
    assert line["generations"] == [
        {"index": 0, "token_ids": ids, "log_probs": [entry["logprob"] for entry in content]}
    ]
