"""Token integrity per call, end to end (issue 31 item 2): a real uvicorn model server replays the
token-integrity cases (``tests/fixtures/token_integrity/``: real vLLM 0.32.0 answers with one field edited
each, see its README), behind the capture proxy and wrapped in-process by the capture middleware; the client
is the official openai SDK. What a user reads: the record (``token_mismatch``, ``tokens_missing``), the tokens
line, the span attribute and the counter."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support import (
    FIXTURES_ROOT,
    ReplayModelServer,
    Telemetry,
    call_and_tokens,
    metric_points,
    serve,
    sse_chunks,
)

from otel_capture import (
    CaptureSettings,
    CaptureStore,
    ModelCallCaptureMiddleware,
    ModelCallRecord,
    start_proxy,
)

CASES = FIXTURES_ROOT / "token_integrity"
MISMATCH = "otel_capture.model_call.token_mismatch"
NAN_REASON = "generation 0: 1 of 16 log-probs null, NaN or infinite (written as null)"


def _request(case: str) -> dict[str, Any]:
    """The case's request as the SDK sends it (vLLM's own keys through ``extra_body``)."""
    request: dict[str, Any] = json.loads((CASES / f"{case}.request.json").read_text())
    extra = {k: request.pop(k) for k in ("return_token_ids", "return_tokens_as_token_ids") if k in request}
    request.pop("stream_options", None)
    if extra:
        request["extra_body"] = extra
    return request


def _replay(server: ReplayModelServer, case: str, *, stream: bool) -> None:
    reply = server.replies["chat" if case.startswith("chat") else "completions"]
    if stream:
        reply.content_type, reply.chunks = (
            "text/event-stream",
            sse_chunks((CASES / f"{case}.sse").read_bytes()),
        )
    else:
        reply.content_type, reply.chunks = "application/json", [(CASES / f"{case}.json").read_bytes()]


def _chat(base_url: str, case: str, *, stream: bool) -> list[float | None]:
    """One ``chat.completions.create``; the log-probs the SDK gave the caller."""
    with openai.OpenAI(base_url=base_url, api_key="k", max_retries=0) as client:
        if not stream:
            completion = client.chat.completions.create(**_request(case))
            content = completion.choices[0].logprobs.content if completion.choices[0].logprobs else None
            return [e.logprob for e in content or []]
        got: list[float | None] = []
        for chunk in client.chat.completions.create(**_request(case), stream=True):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    got += [e.logprob for e in choice.logprobs.content or []]
        return got


def _read(store: CaptureStore, rollout_id: str) -> tuple[ModelCallRecord, dict[str, Any]]:
    record, tokens = call_and_tokens(store, rollout_id)
    assert tokens is not None
    return record, tokens


@pytest.fixture
def proxied(replay_server: ReplayModelServer, tmp_path: Path) -> Iterator[tuple[str, CaptureStore]]:
    store = CaptureStore(tmp_path / "calls")
    with serve(replay_server) as upstream, start_proxy(upstream, str(store.root)) as proxy:
        yield proxy.url, store


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_nan_log_prob_through_the_proxy_is_null_and_said(
    proxied: tuple[str, CaptureStore], replay_server: ReplayModelServer, stream: bool
) -> None:
    url, store = proxied
    _replay(replay_server, "chat_nan_log_prob", stream=stream)
    received = _chat(f"{url}/ng-rollout/nan/v1", "chat_nan_log_prob", stream=stream)
    assert len(received) == 16 and math.isnan(received[3] or 0.0)  # the client got vLLM's answer as sent

    record, tokens = _read(store, "nan")
    assert record.error_category is None  # was a capture_parse_error: the record kept no answer
    assert record.token_mismatch == NAN_REASON
    assert record.tokens_missing is None
    (generation,) = tokens["generations"]
    assert generation["log_probs"] == [None if math.isnan(v or 0.0) else v for v in received]
    assert len(generation["token_ids"]) == 16 and len(tokens["prompt_token_ids"]) == 13
    assert record.response is not None  # the answer is on the record, its NaN written null
    assert record.response["choices"][0]["logprobs"]["content"][3]["logprob"] is None
    if not stream:
        assert record.tokens_out == 16  # the usage read (the recorded stream has none)
        assert record.response_raw == (CASES / "chat_nan_log_prob.json").read_text()  # the bytes as sent


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_token_id_tokens_through_the_proxy_are_decoded(
    proxied: tuple[str, CaptureStore], replay_server: ReplayModelServer, stream: bool
) -> None:
    url, store = proxied
    _replay(replay_server, "chat_token_id_tokens", stream=stream)
    received = _chat(f"{url}/ng-rollout/spelled/v1", "chat_token_id_tokens", stream=stream)
    record, tokens = _read(store, "spelled")
    recorded = json.loads(
        (FIXTURES_ROOT / "recorded_streams/vllm_0.32.0_cpu/chat_completions.json").read_text()
    )
    assert tokens["generations"] == [
        {"index": 0, "token_ids": recorded["choices"][0]["token_ids"], "log_probs": received}
    ]
    assert (record.token_mismatch, record.tokens_missing) == (None, None)


def test_an_id_lost_in_process_is_a_mismatch_on_the_record_the_span_and_the_counter(
    replay_server: ReplayModelServer, telemetry: Telemetry
) -> None:
    store, spans, reader = telemetry.store, telemetry.spans, InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    app = ModelCallCaptureMiddleware(
        replay_server, tracer_provider=telemetry.provider, meter_provider=meters, settings=CaptureSettings()
    )
    with serve(app) as url:
        for stream in (False, True):
            _replay(replay_server, "chat_short_token_ids", stream=stream)
            _chat(f"{url}/ng-rollout/short-{stream}/v1", "chat_short_token_ids", stream=stream)
        _replay(replay_server, "completions_best_of", stream=False)
        with openai.OpenAI(base_url=f"{url}/ng-rollout/best-of/v1", api_key="k", max_retries=0) as client:
            client.completions.create(**_request("completions_best_of"))
        for stream in (False, True):
            _replay(replay_server, "completions_echo", stream=stream)
            with openai.OpenAI(
                base_url=f"{url}/ng-rollout/echo-{stream}/v1", api_key="k", max_retries=0
            ) as c:
                if stream:
                    chunks = c.completions.create(
                        **_request("completions_echo"), stream=True, stream_options={"include_usage": True}
                    )
                    assert sum(1 for _ in chunks) > 0
                else:
                    c.completions.create(**_request("completions_echo"))
    telemetry.provider.shutdown()  # every record written

    reasons = {
        False: "generation 0: 16 log-probs for 15 token ids; output: 15 token ids for 16 completion tokens (usage)",
        True: "generation 0: 16 log-probs for 15 token ids",  # the recorded stream has no usage
    }
    by_rollout = {
        s.attributes["rollout.id"]: s.attributes for s in spans.get_finished_spans() if s.attributes
    }
    for stream, reason in reasons.items():
        record, tokens = _read(store, f"short-{stream}")
        assert (record.token_mismatch, record.tokens_missing) == (reason, None)
        assert len(tokens["generations"][0]["token_ids"]) == 15
        assert by_rollout[f"short-{stream}"][MISMATCH] == reason
    (point,) = metric_points(reader, "otel_capture.token_mismatch_calls")
    assert (point.value, dict(point.attributes)) == (2, {"otel_capture.model_call.dialect": "chat"})
    assert metric_points(reader, "otel_capture.tokens_missing_calls") == []  # best_of and echo: nothing false

    record, tokens = _read(store, "best-of")  # usage 32 for best_of=2, 16 returned: no false alarm
    assert (record.token_mismatch, record.tokens_missing) == (None, None)
    assert MISMATCH not in by_rollout["best-of"]
    recorded = json.loads((FIXTURES_ROOT / "recorded_streams/vllm_0.32.0_cpu/completions.json").read_text())
    for stream in (False, True):  # echo without ids: the output's log-probs, the prompt's left out
        record, tokens = _read(store, f"echo-{stream}")
        assert (record.token_mismatch, record.tokens_missing) == (None, None)
        assert tokens["generations"] == [
            {"index": 0, "token_ids": None, "log_probs": recorded["choices"][0]["logprobs"]["token_logprobs"]}
        ]
