"""The capture lifecycle through a running capture proxy: late calls of retired or frozen rollouts are
answered normally and dropped, warned once and counted (no failure); a deleted id captures again from empty; a freeze during a call in
flight reports the rollout incomplete; token ids travel beside the records."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import openai
import pytest
from support import Gate, ReplayModelServer, Telemetry, serve

from otel_capture import CaptureSettings, read_model_call_records, start_proxy
from otel_capture._proxy import RunningProxy

TIMEOUT = 30

VLLM_CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "qwen",
    "prompt_token_ids": [151644, 872, 198],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "finish_reason": "stop",
            "token_ids": [6023, 151645],
            "logprobs": {
                "content": [
                    {"token": "hi", "logprob": -0.25, "bytes": [104, 105], "top_logprobs": []},
                    {"token": "<|im_end|>", "logprob": -0.01, "bytes": [], "top_logprobs": []},
                ]
            },
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


@pytest.fixture
def proxy(replay_server: ReplayModelServer, telemetry: Telemetry) -> Iterator[RunningProxy]:
    replay_server.replies["chat"].chunks = [json.dumps(VLLM_CHAT).encode()]
    settings = CaptureSettings()
    with (
        serve(replay_server) as upstream,
        start_proxy(upstream, settings=settings, tracer_provider=telemetry.provider) as running,
    ):
        yield running


def _chat(proxy: RunningProxy, rollout_id: str) -> str | None:
    with openai.OpenAI(
        base_url=f"{proxy.url}/ng-rollout/{rollout_id}/v1", api_key="k", max_retries=0
    ) as client:
        reply = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hi"}])
    return reply.choices[0].message.content


def test_records_and_token_lines_are_written_together(proxy: RunningProxy, telemetry: Telemetry) -> None:
    assert _chat(proxy, "tok-1") == "hi"
    (record,) = read_model_call_records(telemetry.store, "tok-1")
    raw = telemetry.store.read_token_lines("tok-1")
    assert raw is not None and len(raw.lines) == 1
    tokens = json.loads(raw.lines[0])
    assert tokens["model_call_id"] == record.model_call_id and tokens["rollout_id"] == "tok-1"
    assert tokens["prompt_token_ids"] == [151644, 872, 198]
    assert tokens["generations"] == [{"index": 0, "token_ids": [6023, 151645], "log_probs": [-0.25, -0.01]}]
    snap = telemetry.store.freeze_now("tok-1")
    assert len(snap.records) == 1 and len(snap.tokens) == 1 and not snap.incomplete


def test_a_late_call_after_retire_is_answered_writes_nothing_and_is_counted(
    proxy: RunningProxy, telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    store = telemetry.store
    assert _chat(proxy, "abandoned") == "hi"
    assert store.retire_now(["abandoned"]) == {"removed": ["abandoned"], "absent": [], "failed": {}}
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):
            assert _chat(proxy, "abandoned") == "hi"  # answered normally
    assert telemetry.jsonl.stats.late_write_dropped == 3
    assert telemetry.jsonl.stats.failures == 0
    assert not store.data_path("abandoned").exists() and not store.tokens_path("abandoned").exists()
    assert not store.incomplete_path("abandoned").exists()
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    # no failure, no traceback: one warning (issue 33: no longer silent), then once a minute at most
    assert [(r.levelno, bool(r.exc_info)) for r in noisy] == [(logging.WARNING, False)]
    assert "rollout abandoned came after the rollout was frozen or retired" in noisy[0].getMessage()
    assert store.rollout_state("abandoned") == "retired"

    assert store.delete_now(["abandoned"])["removed"] == ["abandoned"]
    assert _chat(proxy, "abandoned") == "hi"
    assert len(read_model_call_records(store, "abandoned")) == 1  # the id captures again, from empty
    assert telemetry.jsonl.stats.late_write_dropped == 3


def test_a_freeze_during_a_call_in_flight_reports_incomplete_and_the_late_line_is_dropped(
    replay_server: ReplayModelServer, telemetry: Telemetry
) -> None:
    gate = Gate()
    chunks = [b'{"id":"chatcmpl-2","object":"chat.completion","model":"m",', b'"choices":[]}']
    replay_server.replies["chat"].chunks = chunks
    replay_server.replies["chat"].gate = gate
    settings = CaptureSettings()
    with (
        serve(replay_server) as upstream,
        start_proxy(upstream, settings=settings, tracer_provider=telemetry.provider) as running,
    ):
        client = openai.OpenAI(base_url=f"{running.url}/ng-rollout/busy/v1", api_key="k", max_retries=0)
        done = threading.Event()
        answers: list[object] = []

        def call() -> None:
            try:
                answers.append(client.chat.completions.create(model="m", messages=[]).id)
            except Exception as exc:  # the assertion below reports it
                answers.append(exc)
            done.set()

        thread = threading.Thread(target=call)
        thread.start()
        try:
            assert gate.reached.wait(TIMEOUT)
            snap = telemetry.store.freeze_now("busy")
        finally:
            gate.open()
            assert done.wait(TIMEOUT)
            thread.join()
            client.close()
    assert answers == ["chatcmpl-2"]
    assert snap.incomplete and snap.records == ()
    assert len(snap.incomplete_calls) == 1 and "in flight" in snap.incomplete_calls[0].reason
    assert telemetry.jsonl.stats.late_write_dropped == 1
    assert telemetry.store.freeze_now("busy") == snap  # the late line did not get in
