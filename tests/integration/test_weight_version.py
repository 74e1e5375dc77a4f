"""The weight (policy) version of every call, through a running capture proxy in front of a real uvicorn
upstream that reports its version the way SGLang does (``metadata.weight_version``): the version declared
for the directory (by another process, ``otel-capture weight-version``), a bump while a stream is in
flight, the caller's own version (header or baggage, the header not forwarded), and the span's attributes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from support import Gate, ReplayModelServer, Telemetry, serve

from otel_capture import (
    CaptureSettings,
    aggregate_model_call_metrics,
    build_model_call_capture,
    read_model_call_records,
    start_proxy,
)
from otel_capture._proxy import RunningProxy

TIMEOUT = 30


def _chunk(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


# An SGLang-style stream whose chunks say which weights produced them (SGLang's own streams carry no
# ``metadata``; a router or a patched engine that adds it is what this stands for).
STREAM = [
    _chunk(
        {
            "id": "chatcmpl-w",
            "object": "chat.completion.chunk",
            "model": "policy",
            "metadata": {"weight_version": "7"},
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "one "}}],
        }
    ),
    _chunk({"id": "chatcmpl-w", "choices": [{"index": 0, "delta": {"content": "two "}}]}),
    _chunk(
        {
            "id": "chatcmpl-w",
            "choices": [{"index": 0, "delta": {"content": "three"}, "finish_reason": "stop"}],
        }
    ),
    b"data: [DONE]\n\n",
]
# SGLang's non-streamed OpenAI answer: ``metadata={"weight_version": ...}`` (serving_chat.py).
ANSWER = {
    "id": "chatcmpl-x",
    "object": "chat.completion",
    "created": 1,
    "model": "policy",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    "metadata": {"weight_version": "12"},
}


class HeadersSeen:
    """The upstream as uvicorn serves it, keeping each request's headers (what the proxy forwarded)."""

    def __init__(self, app: ReplayModelServer) -> None:
        self.app = app
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.headers.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


@pytest.fixture
def upstream(replay_server: ReplayModelServer) -> Iterator[tuple[str, HeadersSeen]]:
    seen = HeadersSeen(replay_server)
    with serve(seen) as url:
        yield url, seen


@pytest.fixture
def proxy(upstream: tuple[str, HeadersSeen], telemetry: Telemetry) -> Iterator[RunningProxy]:
    with start_proxy(upstream[0], settings=CaptureSettings(), tracer_provider=telemetry.provider) as running:
        yield running


def _declare_in_another_process(directory: str, version: str) -> None:
    """What a trainer on another node runs when it syncs weights."""
    done = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "weight-version", directory, version],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr


def _client(proxy: RunningProxy, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/ng-rollout/{rollout_id}/v1", api_key="k", max_retries=0)


def _span_attributes(telemetry: Telemetry, rollout_id: str) -> dict[str, Any]:
    [span] = [
        s
        for s in telemetry.spans.get_finished_spans()
        if s.attributes is not None and s.attributes.get("rollout.id") == rollout_id
    ]
    return dict(span.attributes or {})


def test_a_bump_while_a_stream_is_in_flight_is_recorded_as_the_version_at_its_end(
    replay_server: ReplayModelServer, proxy: RunningProxy, telemetry: Telemetry
) -> None:
    store = telemetry.store
    store.root.mkdir(parents=True, exist_ok=True)
    _declare_in_another_process(str(store.root), "7")
    gate = Gate()
    reply = replay_server.replies["chat"]
    reply.content_type, reply.chunks, reply.gate, reply.gate_after = "text/event-stream", STREAM, gate, 2
    text: list[str] = []
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            with _client(proxy, "bump") as client:
                for chunk in client.chat.completions.create(model="policy", messages=[], stream=True):
                    text.extend(choice.delta.content or "" for choice in chunk.choices)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert gate.reached.wait(TIMEOUT)  # two chunks out, the rest held: the call is in flight
        _declare_in_another_process(str(store.root), "8")  # the trainer synced new weights meanwhile
    finally:
        gate.open()
        thread.join(TIMEOUT)
    assert not errors and "".join(text) == "one two three"

    [record] = read_model_call_records(store, "bump")
    assert (record.weight_version, record.weight_version_at_end, record.engine_weight_version) == (
        "7",
        "8",
        "7",
    )
    attributes = _span_attributes(telemetry, "bump")
    assert attributes["otel_capture.weight_version"] == "7"
    assert attributes["otel_capture.engine_weight_version"] == "7"

    # the next call is admitted under the new version, and the weights did not change while it ran
    replay_server.replies["chat"].gate = None
    with _client(proxy, "bump") as client:
        assert (
            "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(model="p", messages=[], stream=True)
            )
            == "one two three"
        )
    later = read_model_call_records(store, "bump")[1]
    # ... and the engine still answered with its old weights: the record says both
    assert (later.weight_version, later.weight_version_at_end, later.engine_weight_version) == (
        "8",
        None,
        "7",
    )
    assert store.weight_version() == "8"

    metrics = aggregate_model_call_metrics(store, "bump")
    assert metrics["weight_versions"] == ["7", "8"] and metrics["num_weight_version_changed"] == 1
    calls = build_model_call_capture(store, "bump")["calls"]
    assert [(c["weight_version"], c["weight_version_at_end"]) for c in calls] == [("7", "8"), ("8", None)]
    shown = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "show", str(store.root), "bump"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    ).stdout.splitlines()
    assert shown[0].split()[-1] == "weight"
    assert shown[1].split()[-1] == "7->8" and shown[2].endswith(" 8 (engine 7)")


def test_the_callers_version_wins_and_its_header_is_not_forwarded(
    replay_server: ReplayModelServer,
    upstream: tuple[str, HeadersSeen],
    proxy: RunningProxy,
    telemetry: Telemetry,
) -> None:
    telemetry.store.set_weight_version("7")
    replay_server.replies["chat"].chunks = [json.dumps(ANSWER).encode()]
    with _client(proxy, "mine") as client:
        client.chat.completions.create(model="policy", messages=[], extra_headers={"x-weight-version": "5"})
        client.chat.completions.create(
            model="policy", messages=[], extra_headers={"baggage": "weight.version=6"}
        )
        client.chat.completions.create(model="policy", messages=[])
    records = read_model_call_records(telemetry.store, "mine")
    assert [(r.weight_version, r.weight_version_at_end, r.engine_weight_version) for r in records] == [
        ("5", None, "12"),
        ("6", None, "12"),
        ("7", None, "12"),
    ]
    forwarded = upstream[1].headers
    assert len(forwarded) == 3 and all("x-weight-version" not in h for h in forwarded)
    assert forwarded[1]["baggage"] == "weight.version=6"  # ambient context goes on, as rollout.id does
    spans = [
        dict(s.attributes or {})
        for s in telemetry.spans.get_finished_spans()
        if (s.attributes or {}).get("rollout.id") == "mine"
    ]
    assert sorted(a["otel_capture.weight_version"] for a in spans) == ["5", "6", "7"]


def test_without_any_version_a_record_carries_none(
    replay_server: ReplayModelServer, proxy: RunningProxy, telemetry: Telemetry
) -> None:
    with _client(proxy, "plain") as client:
        client.chat.completions.create(model="m", messages=[])
    [record] = read_model_call_records(telemetry.store, "plain")
    assert (record.weight_version, record.weight_version_at_end, record.engine_weight_version) == (None,) * 3
    raw = telemetry.store.read_lines("plain")
    assert raw is not None and b"weight_version" not in raw.lines[0]
    assert "otel_capture.weight_version" not in _span_attributes(telemetry, "plain")
