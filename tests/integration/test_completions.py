"""``/v1/completions`` captured end to end (issue 22 item 5), and tokens asked for but dropped (item 3).

A real uvicorn model server replays vLLM's answer to one completions call
(``tests/fixtures/vllm/completions_return_token_ids.{json,sse}``, built from vLLM's protocol definitions; see
``tests/unit/test_completions_dialect.py``), behind the capture proxy or wrapped in the capture middleware
in-process; the client is the official openai SDK's ``completions.create``, streamed and not, with a prompt
of token ids, ``logprobs=1`` and vLLM's ``return_token_ids``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import FIXTURES_ROOT, ReplayModelServer, Telemetry, metric_points, serve, sse_chunks

from otel_capture import (
    CaptureSettings,
    CaptureStore,
    ModelCallCaptureMiddleware,
    aggregate_model_call_metrics,
    read_model_call_records,
    start_proxy,
)

VLLM = FIXTURES_ROOT / "vllm"
STREAM = (VLLM / "completions_return_token_ids.sse").read_bytes()
BODY: dict[str, Any] = json.loads((VLLM / "completions_return_token_ids.json").read_text())
PROMPT = [2, 651, 6037, 576, 6081, 603]
MODEL = "google/gemma-3-270m"
REQUEST: dict[str, Any] = {
    "model": MODEL,
    "prompt": PROMPT,
    "n": 2,
    "max_tokens": 3,
    "logprobs": 1,
    "extra_body": {"return_token_ids": True},
}
GENERATIONS = [
    {"index": 0, "token_ids": [9079, 603, 573], "log_probs": [-0.0625, -0.8125, -1.25]},
    {"index": 1, "token_ids": [55433, 235269, 6081], "log_probs": [-2.5, -0.375, -0.5]},
]


@pytest.fixture
def proxied(
    replay_server: ReplayModelServer, telemetry: Telemetry
) -> Iterator[tuple[str, CaptureStore, InMemorySpanExporter]]:
    with serve(replay_server) as upstream, start_proxy(upstream, tracer_provider=telemetry.provider) as proxy:
        yield proxy.url, telemetry.store, telemetry.spans


def _call(base_url: str, *, stream: bool, **headers: str) -> tuple[list[str], dict[int, list[int]]]:
    """One ``completions.create``; the texts and token ids of each choice, as the SDK gave them."""
    texts = ["", ""]
    ids: dict[int, list[int]] = {0: [], 1: []}
    with openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, default_headers=headers) as client:
        if stream:
            for chunk in client.completions.create(
                **REQUEST, stream=True, stream_options={"include_usage": True}
            ):
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
                    ids[choice.index] += (choice.model_extra or {}).get("token_ids") or []
        else:
            completion = client.completions.create(**REQUEST)
            for choice in completion.choices:
                texts[choice.index] = choice.text
                ids[choice.index] = (choice.model_extra or {})["token_ids"]
    return texts, ids


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(
    ("path", "headers", "routed"),
    [
        ("/ng-rollout/r1/v1", {}, "/v1/completions"),
        ("/ng-rollout/r1", {}, "/completions"),
        ("/v1", {"x-rollout-id": "r1"}, "/v1/completions"),
        ("", {"x-rollout-id": "r1"}, "/completions"),
    ],
    ids=["prefix", "prefix-no-v1", "header", "header-no-v1"],
)
def test_a_completions_call_through_the_proxy_is_one_record_with_its_tokens(
    proxied: tuple[str, CaptureStore, InMemorySpanExporter],
    replay_server: ReplayModelServer,
    stream: bool,
    path: str,
    headers: dict[str, str],
    routed: str,
) -> None:
    url, store, spans = proxied
    if stream:
        reply = replay_server.replies["completions"]
        reply.content_type, reply.chunks = "text/event-stream", sse_chunks(STREAM)
    texts, ids = _call(url + path, stream=stream, **headers)

    assert texts == [" Paris is the", " Lyon, France"]
    assert ids == {0: [9079, 603, 573], 1: [55433, 235269, 6081]}
    assert [p for _, p, _ in replay_server.seen] == [routed]  # the prefix gone, the header too
    (record,) = read_model_call_records(store, "r1")
    assert (record.dialect, record.model, record.status_code, record.error_category) == (
        "completions",
        MODEL,
        200,
        None,
    )
    assert (record.tokens_in, record.tokens_out, record.finish_reason) == (6, 6, "length")
    assert record.stream is stream and record.request is not None and record.request["prompt"] == PROMPT
    assert record.response is not None and [c["text"] for c in record.response["choices"]] == texts
    assert record.tokens_missing is None
    raw = store.read_token_lines("r1")
    assert raw is not None
    (line,) = (json.loads(x) for x in raw.lines)
    assert (line["model_call_id"], line["prompt_token_ids"], line["generations"]) == (
        record.model_call_id,
        PROMPT,
        GENERATIONS,
    )
    (span,) = [s for s in spans.get_finished_spans() if s.attributes and "rollout.id" in s.attributes]
    assert span.name == f"text_completion {MODEL}"
    assert span.attributes is not None
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["gen_ai.provider.name"] == "openai"
    assert "openai.api.type" not in span.attributes
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length", "length")
    assert span.attributes["gen_ai.usage.output_tokens"] == 6
    assert span.attributes["gen_ai.request.stream"] is stream


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_completions_call_in_process_with_the_middleware(
    replay_server: ReplayModelServer, telemetry: Telemetry, stream: bool
) -> None:
    if stream:
        reply = replay_server.replies["completions"]
        reply.content_type, reply.chunks = "text/event-stream", sse_chunks(STREAM)
    app = ModelCallCaptureMiddleware(replay_server, tracer_provider=telemetry.provider)
    with serve(app) as url:
        texts, _ = _call(f"{url}/ng-rollout/in-process/v1", stream=stream)
    assert texts == [" Paris is the", " Lyon, France"]
    (record,) = read_model_call_records(telemetry.store, "in-process")
    assert (record.dialect, record.tokens_out, record.stream) == ("completions", 6, stream)
    (span,) = telemetry.spans.get_finished_spans()
    assert span.name == f"text_completion {MODEL}"


# -- item 3: a scripted upstream that drops the log-probs it was asked for ------------------------------


def _dropped(body: dict[str, Any]) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    for choice in body["choices"]:
        choice["logprobs"] = None
    return body


def _dropped_stream(raw: bytes) -> list[bytes]:
    """The recorded stream ``raw`` with every choice's log-probs set to null, one event per chunk."""
    events = []
    for event in raw.decode().split("\n\n"):
        if event.startswith("data: {"):
            payload = json.loads(event.removeprefix("data: "))
            for choice in payload["choices"]:
                choice["logprobs"] = None
            event = "data: " + json.dumps(payload)
        if event:
            events.append((event + "\n\n").encode())
    return events


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_log_probs_asked_for_and_dropped_are_said_counted_and_checked(
    replay_server: ReplayModelServer, telemetry: Telemetry, stream: bool
) -> None:
    store, spans, reader = telemetry.store, telemetry.spans, InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    reply = replay_server.replies["completions"]
    if stream:
        reply.content_type, reply.chunks = "text/event-stream", _dropped_stream(STREAM)
    else:
        reply.chunks = [json.dumps(_dropped(BODY)).encode()]
    app = ModelCallCaptureMiddleware(
        replay_server, tracer_provider=telemetry.provider, meter_provider=meters, settings=CaptureSettings()
    )
    with serve(app) as url:
        texts, ids = _call(f"{url}/ng-rollout/dropped/v1", stream=stream)  # never an error for the client
        assert ids == {0: [9079, 603, 573], 1: [55433, 235269, 6081]}  # the ids it did send, as sent
        with openai.OpenAI(base_url=f"{url}/ng-rollout/full/v1", api_key="k", max_retries=0) as client:
            reply.content_type, reply.chunks = "application/json", [json.dumps(BODY).encode()]
            client.completions.create(**REQUEST)
    telemetry.provider.shutdown()  # every record written
    assert texts == [" Paris is the", " Lyon, France"]

    reason = "log-probs asked for (logprobs=1), none in the response"
    (record,) = read_model_call_records(store, "dropped")
    assert (record.error_category, record.tokens_missing) == (None, reason)
    (full,) = read_model_call_records(store, "full")
    assert full.tokens_missing is None
    spans_by_rollout = {s.attributes["rollout.id"]: s for s in spans.get_finished_spans() if s.attributes}
    assert spans_by_rollout["dropped"].attributes is not None
    assert spans_by_rollout["dropped"].attributes["otel_capture.model_call.tokens_missing"] == reason
    assert "otel_capture.model_call.tokens_missing" not in (spans_by_rollout["full"].attributes or {})
    (point,) = metric_points(reader, "otel_capture.tokens_missing_calls")
    assert (point.value, dict(point.attributes)) == (1, {"otel_capture.model_call.dialect": "completions"})
    assert aggregate_model_call_metrics(store, "dropped")["num_tokens_missing"] == 1
    assert aggregate_model_call_metrics(store, "full")["num_tokens_missing"] == 0

    check = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "check", str(store.root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr  # the records are sound: not damage
    assert f"dropped: call 0: tokens missing: {reason}" in check.stdout.splitlines()
    assert "full:" not in check.stdout
    assert check.stdout.splitlines()[-1].endswith("; 1 with calls missing the tokens they asked for")


def test_chat_log_probs_dropped_from_a_stream_through_the_proxy(
    proxied: tuple[str, CaptureStore, InMemorySpanExporter], replay_server: ReplayModelServer
) -> None:
    # vLLM with top_logprobs null answers no log-probs (NeMo RL#2845): the stream carries none of them
    url, store, spans = proxied
    reply = replay_server.replies["chat"]
    reply.content_type = "text/event-stream"
    reply.chunks = _dropped_stream((VLLM / "chat_return_token_ids.sse").read_bytes())
    with openai.OpenAI(base_url=f"{url}/ng-rollout/chat-dropped/v1", api_key="k", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name two colours."}],
            n=2,
            max_tokens=4,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert sum(1 for _ in stream) > 0
    (record,) = read_model_call_records(store, "chat-dropped")
    assert (record.stream, record.error_category) == (True, None)
    assert record.tokens_missing == "log-probs asked for (logprobs=true), none in the response"
    (span,) = [s for s in spans.get_finished_spans() if (s.attributes or {}).get("rollout.id")]
    assert (span.attributes or {})["otel_capture.model_call.tokens_missing"] == record.tokens_missing
