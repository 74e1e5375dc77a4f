"""Token ids and log-probs of a streamed call reach ``<rollout_id>.tokens.jsonl`` as the same call not streamed
(issue #13 item 9): vLLM's Chat Completions with ``return_token_ids`` and ``logprobs``, replayed by a real
uvicorn model server behind the capture proxy writing to a capture directory, called with the openai SDK.

The replayed call is ``tests/fixtures/vllm/chat_return_token_ids.{sse,json}``, built from vLLM's protocol
definitions (``vllm/entrypoints/openai/chat_completion/protocol.py`` at vLLM commit
002032ee2b18e1f7bd924ec47b62504ba3866063; see ``tests/unit/test_stream_tokens.py`` and the fixture's README).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from support import FIXTURES_ROOT, ReplayModelServer, call_and_tokens, serve, sse_chunks

from otel_capture import CaptureStore, start_proxy

VLLM = FIXTURES_ROOT / "vllm"
STREAM = (VLLM / "chat_return_token_ids.sse").read_bytes()
BODY = (VLLM / "chat_return_token_ids.json").read_bytes()
REQUEST: dict[str, Any] = {
    "model": "google/gemma-3-270m-it",
    "messages": [{"role": "user", "content": "Name two colours."}],
    "n": 2,
    "max_tokens": 4,
    "logprobs": True,
    "top_logprobs": 1,
    "extra_body": {"return_token_ids": True},
}


@pytest.fixture
def proxied(replay_server: ReplayModelServer, tmp_path: Path) -> Iterator[tuple[str, CaptureStore]]:
    store = CaptureStore(tmp_path / "calls")
    with serve(replay_server) as upstream, start_proxy(upstream, str(store.root)) as proxy:
        yield proxy.url, store


def _tokens(store: CaptureStore, rollout_id: str) -> dict[str, Any]:
    _, tokens = call_and_tokens(store, rollout_id)
    assert tokens is not None
    return tokens


def test_streamed_and_not_streamed_calls_write_the_same_tokens_line(
    proxied: tuple[str, CaptureStore], replay_server: ReplayModelServer
) -> None:
    url, store = proxied
    reply = replay_server.replies["chat"]

    reply.chunks = [BODY]
    with openai.OpenAI(base_url=f"{url}/ng-rollout/plain/v1", api_key="k", max_retries=0) as client:
        completion = client.chat.completions.create(**REQUEST)

    reply.content_type, reply.chunks = "text/event-stream", sse_chunks(STREAM)
    streamed_ids: dict[int, list[int]] = {0: [], 1: []}
    streamed_log_probs: dict[int, list[float]] = {0: [], 1: []}
    with openai.OpenAI(base_url=f"{url}/ng-rollout/streamed/v1", api_key="k", max_retries=0) as client:
        for chunk in client.chat.completions.create(
            **REQUEST, stream=True, stream_options={"include_usage": True}
        ):
            for choice in chunk.choices:
                streamed_ids[choice.index] += (choice.model_extra or {}).get("token_ids") or []
                if choice.logprobs is not None and choice.logprobs.content:
                    streamed_log_probs[choice.index] += [entry.logprob for entry in choice.logprobs.content]

    plain, streamed = _tokens(store, "plain"), _tokens(store, "streamed")
    assert {k: v for k, v in streamed.items() if k not in ("rollout_id", "model_call_id")} == {
        k: v for k, v in plain.items() if k not in ("rollout_id", "model_call_id")
    }
    # and both are what the SDK received
    assert plain["prompt_token_ids"] == (completion.model_extra or {})["prompt_token_ids"]
    assert [(g["token_ids"], g["log_probs"]) for g in plain["generations"]] == [
        (
            (c.model_extra or {})["token_ids"],
            [e.logprob for e in c.logprobs.content or []] if c.logprobs else None,
        )
        for c in completion.choices
    ]
    assert [(g["token_ids"], g["log_probs"]) for g in streamed["generations"]] == [
        (streamed_ids[i], streamed_log_probs[i]) for i in (0, 1)
    ]
