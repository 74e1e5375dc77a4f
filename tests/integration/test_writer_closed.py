"""A call that ends after the record writer was closed (issue 20, item 3): its client gets the model's
exact answer, and the lost record is counted, logged once and its rollout marked incomplete, never a
silent ``RuntimeError``."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from support import Gate, ReplayModelServer, serve

from otel_capture import CaptureStore, ModelCallCaptureMiddleware
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

BOUND = 60.0
CHUNKS = [b'{"id":"chatcmpl-5","object":"chat.completion","model":"m",', b'"choices":[]}']


def test_calls_that_end_after_the_writer_closed_are_counted_logged_once_and_marked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    upstream = ReplayModelServer()
    gate = upstream.replies["chat"].gate = Gate()
    upstream.replies["chat"].chunks = list(CHUNKS)
    provider = TracerProvider()
    exporter = ModelCallJsonlExporter(tmp_path / "calls")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = ModelCallCaptureMiddleware(upstream, tracer_provider=provider)
    answers: list[object] = []

    def call() -> None:
        try:
            response = httpx.post(f"{url}/ng-rollout/late/v1/chat/completions", json={}, timeout=BOUND)
            answers.append((response.status_code, response.content))
        except Exception as exc:  # the assertion on answers reports it
            answers.append(exc)

    with caplog.at_level(logging.ERROR), serve(app) as url:
        threads = [threading.Thread(target=call) for _ in range(3)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + BOUND
        while len(upstream.seen) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        provider.shutdown()  # the writer closes with three calls in flight
        gate.open()
        for thread in threads:
            thread.join(BOUND)
    assert answers == [(200, b"".join(CHUNKS))] * 3  # the answers are untouched
    store = CaptureStore(tmp_path / "calls")
    marker = store.incomplete_path("late")
    deadline = time.monotonic() + BOUND  # the marks are written off the event loop
    while not marker.exists() or marker.read_bytes().count(b"\n") < 3:
        assert time.monotonic() < deadline, "the calls after close were not marked incomplete"
        time.sleep(0.05)
    marks = [orjson.loads(line) for line in marker.read_bytes().splitlines()]
    assert len({mark["model_call_id"] for mark in marks}) == 3
    assert all("writer closed" in mark["reason"] for mark in marks)
    assert exporter.stats.after_close == 3 and exporter.stats.failures == 3
    logged = [r for r in caplog.records if "capture writer closed" in r.getMessage()]
    assert len(logged) == 1  # once, not once per call
    assert store.read_lines("late") is None  # no record line: the writer was gone
    assert store.freeze_now("late").incomplete


def test_a_call_abandoned_after_the_exporter_shut_down_is_counted_and_marked(tmp_path: Path) -> None:
    """A call whose record could not be built (or missed its durability deadline) after the exporter shut
    down is still counted and its rollout marked, as a late line is: the exporter passes it on."""
    exporter = ModelCallJsonlExporter(tmp_path / "calls")
    exporter.begin_call("gone", "c" * 32)
    exporter.shutdown()
    exporter.abandon_call("gone", "c" * 32, "record could not be built")
    store = CaptureStore(tmp_path / "calls")
    deadline = time.monotonic() + BOUND
    while not store.incomplete_path("gone").exists():
        assert time.monotonic() < deadline, "the abandoned call was not marked incomplete"
        time.sleep(0.05)
    marks = [orjson.loads(line) for line in store.incomplete_path("gone").read_bytes().splitlines()]
    assert [mark["model_call_id"] for mark in marks] == ["c" * 32]
    assert exporter.stats.after_close == 1
    assert store.freeze_now("gone").incomplete
