"""The collector attaches from a snapshot while a slow streamed call of the rollout is still in flight,
through real capture proxies (one in this process, one in its own process: two nodes' directories) in
front of a real uvicorn upstream: the call is attached once it ends within ``wait_s``, else named as a
gap; ``drop=True`` drops exactly the snapshots; the call's line that comes after the freeze, and a call
that arrives after it, are refused by the fence and counted, and every client gets its whole answer."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from support import Gate, ReplayModelServer, Telemetry, serve, start_cli_proxy

from otel_capture import (
    CaptureSettings,
    CaptureStore,
    attach_model_call_capture,
    freeze_model_call_capture,
    start_proxy,
)
from otel_capture._proxy import RunningProxy

TIMEOUT = 30


def _chunk(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


STREAM = [
    _chunk({"id": "chatcmpl-s", "model": "m", "choices": [{"index": 0, "delta": {"content": "one "}}]}),
    _chunk({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {"content": "two "}}]}),
    _chunk(
        {
            "id": "chatcmpl-s",
            "choices": [{"index": 0, "delta": {"content": "three"}, "finish_reason": "stop"}],
        }
    ),
    b"data: [DONE]\n\n",
]


@pytest.fixture
def gate(replay_server: ReplayModelServer) -> Iterator[Gate]:
    """The upstream's chat stream sends two chunks, then holds the rest until the test opens the gate."""
    held = Gate()
    reply = replay_server.replies["chat"]
    reply.content_type, reply.chunks, reply.gate, reply.gate_after = "text/event-stream", STREAM, held, 2
    yield held
    held.open()


@pytest.fixture
def upstream(replay_server: ReplayModelServer) -> Iterator[str]:
    with serve(replay_server) as url:
        yield url


@pytest.fixture
def proxy(upstream: str, telemetry: Telemetry) -> Iterator[RunningProxy]:
    with start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as running:
        yield running


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` in a thread; its result (or the exception it raised) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # the test asserts on it
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _stream(base_url: str) -> Callable[[], str]:
    def call() -> str:
        with openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=TIMEOUT) as client:
            chunks = client.chat.completions.create(model="m", messages=[], stream=True)
            return "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)

    return call


def _in_flight(store: CaptureStore, rollout_id: str) -> dict[str, float | None]:
    """The rollout's calls in flight, once there is one (the other process writes its marker 20 ms in)."""
    deadline = time.monotonic() + TIMEOUT
    while not (calls := store.calls_in_flight(rollout_id)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return calls


def test_a_call_in_flight_on_another_node_is_attached_once_it_ends_and_the_snapshots_are_dropped(
    upstream: str, proxy: RunningProxy, telemetry: Telemetry, gate: Gate, tmp_path: Path
) -> None:
    node_a, node_b = telemetry.store.root, tmp_path / "node-b"
    other, other_url = start_cli_proxy(upstream, "--capture-dir", str(node_b))
    try:
        with openai.OpenAI(base_url=f"{proxy.url}/ng-rollout/r/v1", api_key="k", max_retries=0) as client:
            first = client.responses.create(model="m", input="hi")  # node a: done before the agent ends
        caller, answer = _in_thread(_stream(f"{other_url}/ng-rollout/r/v1"))  # node b: a slow stream
        assert gate.reached.wait(TIMEOUT)
        [slow_call] = _in_flight(CaptureStore(node_b), "r")  # seen from this process: its marker

        record: dict[str, Any] = {"_ng_rollout_id": "r", "reward": 1.0}
        collector, attached = _in_thread(
            lambda: attach_model_call_capture(record, [node_a, node_b], wait_s=TIMEOUT, drop=True)
        )
        time.sleep(0.3)
        assert not attached, "the collector attached while a call of the rollout was in flight"
        gate.open()
        caller.join(TIMEOUT)
        collector.join(TIMEOUT)
    finally:
        other.terminate()
        other.communicate(timeout=TIMEOUT)

    assert answer == ["one two three"]
    [attachment] = attached
    assert record["ng_model_call_capture"] is attachment and record["reward"] == 1.0
    assert "gaps" not in attachment, attachment.get("gaps")
    calls = attachment["calls"]
    assert [c["dialect"] for c in calls] == ["responses", "chat"]
    assert calls[0]["response_id"] == first.id and calls[1]["model_call_id"] == slow_call
    assert [c["call_index"] for c in calls] == [0, 1] and attachment["metrics"]["num_calls"] == 2
    # dropped exactly as attached: both directories retired the rollout and let its records go
    for directory in (node_a, node_b):
        store = CaptureStore(directory)
        assert store.rollout_state("r") == "retired"
        assert not store.data_path("r").exists()


def test_a_call_still_in_flight_when_the_wait_ends_is_a_gap_and_its_late_line_is_refused(
    proxy: RunningProxy, telemetry: Telemetry, gate: Gate
) -> None:
    store = telemetry.store
    base_url = f"{proxy.url}/ng-rollout/slow/v1"
    sent = time.time()
    caller, answer = _in_thread(_stream(base_url))
    assert gate.reached.wait(TIMEOUT)
    [model_call_id] = _in_flight(store, "slow")

    record: dict[str, Any] = {"_ng_rollout_id": "slow"}
    attachment = attach_model_call_capture(record, store, wait_s=0.5, drop=True)
    attached = time.time()
    assert attachment["calls"] == []
    gaps = attachment["gaps"]
    assert [g["code"] for g in gaps] == ["model_call_capture_incomplete", "model_call_capture_in_flight"]
    detail = gaps[1]["detail"]
    assert detail.startswith(f"{model_call_id}: began by ") and detail.endswith(
        f"still in flight after 0.5 s ({store.root})"
    )
    began = datetime.fromisoformat(detail.split("began by ")[1].split(",")[0]).timestamp()
    # an upper bound of its start: its marker's time (20 ms in), or when the collector first saw it running
    assert sent - 0.001 <= began <= attached - 0.5
    assert store.rollout_state("slow") == "retired"  # the snapshot was dropped

    # the call goes on and its client gets everything; its line is refused by the fence and counted
    gate.open()
    caller.join(TIMEOUT)
    assert answer == ["one two three"]
    assert telemetry.jsonl.force_flush()
    assert telemetry.jsonl.stats.late_write_dropped == 1
    # so is a call that arrives after the freeze
    assert _stream(base_url)() == "one two three"
    assert telemetry.jsonl.force_flush()
    assert telemetry.jsonl.stats.late_write_dropped == 2
    assert not store.data_path("slow").exists() and store.calls_in_flight("slow") == {}


def test_without_drop_the_rollout_stays_frozen_and_the_snapshot_can_be_dropped_later(
    proxy: RunningProxy, telemetry: Telemetry, gate: Gate
) -> None:
    gate.open()  # no call in flight here: the wait returns at once
    with openai.OpenAI(base_url=f"{proxy.url}/ng-rollout/keep/v1", api_key="k", max_retries=0) as client:
        client.responses.create(model="m", input="hi")
    frozen = freeze_model_call_capture(telemetry.store, "keep")
    assert len(frozen.attachment["calls"]) == 1 and "gaps" not in frozen.attachment
    assert telemetry.store.rollout_state("keep") == "frozen"
    # a mark after the snapshot changes the rollout: dropping that snapshot is refused, and said
    telemetry.store.mark_incomplete("keep", "x" * 32, "found later")
    assert frozen.drop() == {
        str(telemetry.store.root): "the rollout changed after its snapshot (not dropped; still frozen)"
    }
    assert telemetry.store.rollout_state("keep") == "frozen"
    again = freeze_model_call_capture(telemetry.store, "keep")
    assert again.drop() == {} and telemetry.store.rollout_state("keep") == "retired"
