"""Every call a trainer makes to a real vLLM, recorded: Chat Completions, Responses and completions,
streamed and not, with and without vLLM's token ids and log-probs, zero-code (``opentelemetry-instrument``
around vLLM's API server) and through the capture proxy in front of it, with the official ``openai`` SDK.

Each call has one record, whose response is what the SDK received (the body as sent; for a stream, what
the SDK's events add up to), and a tokens line equal to the ids and log-probs vLLM returned: Chat's
``prompt_token_ids`` / ``token_ids`` / ``logprobs``, Responses' ``input_messages`` / ``output_messages``
(``enable_response_messages``) and its output text's log-probs, completions' per-choice ids and
``token_logprobs``. What the SDK received is read from its raw responses (``with_raw_response``,
``with_streaming_response``): the bytes it parsed, not the typed objects it made of them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from support import call_and_tokens, rollout_client
from vllm_backend import MODEL_NAME, Proxy, Vllm

from otel_capture import CaptureStore, ModelCallRecord
from otel_capture._dialects.table import DIALECT_PATHS

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Name three colours."}]
TOKENS = {"return_token_ids": True}
LOGPROBS = {"logprobs": True, "top_logprobs": 2}
# the /v1/completions dialect is issue 22's (being added on its own branch): these run once it is there
COMPLETIONS = pytest.mark.skipif(
    "/v1/completions" not in DIALECT_PATHS,
    reason="needs the /v1/completions dialect (issue 22): its tests run once it is merged",
)


def _recorded(
    store: CaptureStore, rollout_id: str, *, stream: bool
) -> tuple[ModelCallRecord, dict[str, Any] | None]:
    """The rollout's one record, of an answered call, and its tokens line's ids and log-probs (None when
    it has none)."""
    record, tokens = call_and_tokens(store, rollout_id)
    assert record.status_code == 200 and record.error_category is None
    assert record.stream is stream
    if tokens is None:
        return record, None
    assert tokens["model"] == MODEL_NAME
    return record, {"prompt_token_ids": tokens["prompt_token_ids"], "generations": tokens["generations"]}


def _events(response: Any) -> list[dict[str, Any]]:
    """The JSON of each SSE ``data:`` line the SDK received, in order (``[DONE]`` left out)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:]))
    return events


# -- Chat Completions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("options", ["plain", "tokens"])
def test_chat(front: tuple[str, CaptureStore], options: str, request: pytest.FixtureRequest) -> None:
    url, store = front
    rollout_id = f"chat-{request.node.callspec.id}"
    extra = {**TOKENS, "prompt_logprobs": 1} if options == "tokens" else {}
    with rollout_client(url, rollout_id, timeout=300) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            **(LOGPROBS if options == "tokens" else {}),  # type: ignore[arg-type]
            extra_body=extra,
        )
        received = json.loads(raw.text)
    record, tokens = _recorded(store, rollout_id, stream=False)
    assert record.response == received  # the body as vLLM sent it, vLLM's extras included
    if options == "plain":
        assert tokens is None  # vLLM sent no ids and no log-probs: no line
        return
    (choice,) = received["choices"]
    assert received["prompt_token_ids"] and choice["token_ids"] and received["prompt_logprobs"]
    assert tokens == {
        "prompt_token_ids": received["prompt_token_ids"],
        "generations": [
            {
                "index": 0,
                "token_ids": choice["token_ids"],
                "log_probs": [entry["logprob"] for entry in choice["logprobs"]["content"]],
            }
        ],
    }


@pytest.mark.parametrize("options", ["plain", "tokens"])
def test_chat_streamed(front: tuple[str, CaptureStore], options: str, request: pytest.FixtureRequest) -> None:
    url, store = front
    rollout_id = f"chat-stream-{request.node.callspec.id}"
    with (
        rollout_client(url, rollout_id, timeout=300) as client,
        client.chat.completions.with_streaming_response.create(
            model=MODEL_NAME,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **(LOGPROBS if options == "tokens" else {}),  # type: ignore[arg-type]
            extra_body=TOKENS if options == "tokens" else {},
        ) as response,
    ):
        events = _events(response)
    record, tokens = _recorded(store, rollout_id, stream=True)
    assert record.response is not None
    choices = [c for e in events for c in e["choices"]]
    (message_choice,) = record.response["choices"]
    assert message_choice["message"]["content"] == "".join(c["delta"].get("content") or "" for c in choices)
    assert message_choice["finish_reason"] == next(c["finish_reason"] for c in choices if c["finish_reason"])
    assert record.response["usage"] == events[-1]["usage"] and record.response["id"] == events[0]["id"]
    if options == "plain":
        assert tokens is None
        return
    assert events[0]["prompt_token_ids"]
    assert tokens == {
        "prompt_token_ids": events[0]["prompt_token_ids"],
        "generations": [
            {
                "index": 0,
                "token_ids": [t for c in choices for t in c.get("token_ids") or []],
                "log_probs": [
                    e["logprob"] for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]
                ],
            }
        ],
    }
    assert len(tokens["generations"][0]["token_ids"]) == events[-1]["usage"]["completion_tokens"]


# -- Responses ----------------------------------------------------------------------------------------


def _responses_request(options: str) -> dict[str, Any]:
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "input": "Name three colours.",
        "max_output_tokens": MAX_TOKENS,
    }
    if options == "tokens":
        request["include"] = ["message.output_text.logprobs"]
        request["top_logprobs"] = 2
        request["extra_body"] = {"enable_response_messages": True}
    return request


def _expected_responses_tokens(response: dict[str, Any]) -> dict[str, Any]:
    (prompt,) = response["input_messages"]
    (output,) = response["output_messages"]
    assert prompt["type"] == output["type"] == "raw_message_tokens" and prompt["tokens"] and output["tokens"]
    (index, item) = next((i, item) for i, item in enumerate(response["output"]) if item["type"] == "message")
    log_probs = [e["logprob"] for part in item["content"] for e in part.get("logprobs") or []]
    return {
        "prompt_token_ids": prompt["tokens"],
        "generations": [{"index": index, "token_ids": output["tokens"], "log_probs": log_probs or None}],
    }


@pytest.mark.parametrize("options", ["plain", "tokens"])
def test_responses(front: tuple[str, CaptureStore], options: str, request: pytest.FixtureRequest) -> None:
    url, store = front
    rollout_id = f"resp-{request.node.callspec.id}"
    with rollout_client(url, rollout_id, timeout=300) as client:
        received = json.loads(client.responses.with_raw_response.create(**_responses_request(options)).text)
    record, tokens = _recorded(store, rollout_id, stream=False)
    assert record.response == received
    if options == "plain":
        assert tokens is None
        return
    assert tokens == _expected_responses_tokens(received)  # the ids too, not only the log-probs


@pytest.mark.parametrize("options", ["plain", "tokens"])
def test_responses_streamed(
    front: tuple[str, CaptureStore], options: str, request: pytest.FixtureRequest
) -> None:
    url, store = front
    rollout_id = f"resp-stream-{request.node.callspec.id}"
    with (
        rollout_client(url, rollout_id, timeout=300) as client,
        client.responses.with_streaming_response.create(
            **_responses_request(options), stream=True
        ) as response,
    ):
        events = _events(response)
    record, tokens = _recorded(store, rollout_id, stream=True)
    (completed,) = [e["response"] for e in events if e["type"] == "response.completed"]
    assert record.response == completed
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert "".join(p["text"] for i in completed["output"] for p in i.get("content") or []) == deltas
    if options == "plain":
        assert tokens is None
        return
    assert tokens == _expected_responses_tokens(completed)


# -- completions (the dialect of issue 22) -------------------------------------------------------------


def _expected_completion_tokens(choices: list[dict[str, Any]], prompt: list[int]) -> dict[str, Any]:
    return {
        "prompt_token_ids": prompt,
        "generations": [
            {"index": 0, "token_ids": [t for c in choices for t in c.get("token_ids") or []],
             "log_probs": [v for c in choices for v in (c.get("logprobs") or {}).get("token_logprobs") or []]}
        ],
    }  # fmt: skip


@COMPLETIONS
@pytest.mark.parametrize("options", ["plain", "tokens"])
def test_completions(front: tuple[str, CaptureStore], options: str, request: pytest.FixtureRequest) -> None:
    url, store = front
    rollout_id = f"cmpl-{request.node.callspec.id}"
    extra = {**TOKENS, "prompt_logprobs": 1} if options == "tokens" else {}
    with rollout_client(url, rollout_id, timeout=300) as client:
        raw = client.completions.with_raw_response.create(
            model=MODEL_NAME,
            prompt="Red, green and",
            max_tokens=MAX_TOKENS,
            **({"logprobs": 2} if options == "tokens" else {}),  # type: ignore[arg-type]
            extra_body=extra,
        )
        received = json.loads(raw.text)
    record, tokens = _recorded(store, rollout_id, stream=False)
    assert record.response == received
    if options == "plain":
        assert tokens is None
        return
    (choice,) = received["choices"]
    assert choice["prompt_token_ids"] and choice["token_ids"]
    assert tokens == _expected_completion_tokens([choice], choice["prompt_token_ids"])


@COMPLETIONS
@pytest.mark.parametrize("options", ["plain", "tokens"])
def test_completions_streamed(
    front: tuple[str, CaptureStore], options: str, request: pytest.FixtureRequest
) -> None:
    url, store = front
    rollout_id = f"cmpl-stream-{request.node.callspec.id}"
    with (
        rollout_client(url, rollout_id, timeout=300) as client,
        client.completions.with_streaming_response.create(
            model=MODEL_NAME,
            prompt="Red, green and",
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **({"logprobs": 2} if options == "tokens" else {}),  # type: ignore[arg-type]
            extra_body=TOKENS if options == "tokens" else {},
        ) as response,
    ):
        events = _events(response)
    record, tokens = _recorded(store, rollout_id, stream=True)
    assert record.response is not None
    choices = [c for e in events for c in e["choices"]]
    assert record.response["choices"][0]["text"] == "".join(c["text"] for c in choices)
    assert record.response["usage"] == events[-1]["usage"]
    if options == "plain":
        assert tokens is None
        return
    prompt = next(c["prompt_token_ids"] for c in choices if c.get("prompt_token_ids"))
    assert tokens == _expected_completion_tokens(choices, prompt)


# -- vLLM's other endpoints ----------------------------------------------------------------------------


def test_health_metrics_and_models_are_served_as_without_capture(vllm: Vllm, proxy: Proxy) -> None:
    for base in (vllm.url, proxy.url):
        with httpx.Client(base_url=base, timeout=60) as client:
            assert client.get("/health").status_code == 200
            assert "vllm:" in client.get("/metrics").text  # vLLM's Prometheus metrics
            models = client.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == [MODEL_NAME]
            prefixed = client.get("/ng-rollout/models-1/v1/models").json()
            assert prefixed["data"][0]["id"] == MODEL_NAME  # a prefixed non-model call reaches the app too
