"""End to end with a real tracing backend: spans go over OTLP/HTTP to Arize Phoenix (from PyPI, on
127.0.0.1) and are read back through its REST API.

An agent (this process) opens a CLIENT span and, inside ``rollout_context``, calls an unmodified FastAPI
model server that runs under ``opentelemetry-instrument`` with only ``OTEL_*`` variables; the rollout id
travels in baggage only (the httpx integration). Phoenix must show one trace, agent span → HTTP server
span → model-call span, with the names, ``rollout.id``, token counts and latencies that were sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from phoenix_backend import Phoenix, running_phoenix
from zero_code import instrumented_model_server

from otel_capture import CaptureStore, instrument_http_client, read_model_call_records, rollout_context

pytestmark = pytest.mark.phoenix

PROJECT = "otel-capture-e2e"
ROLLOUT = "phx-0"


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    with running_phoenix(tmp_path_factory.mktemp("phoenix")) as backend:
        yield backend


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def _wait_for_trace(phoenix: Phoenix, trace_id: str, count: int, timeout: float = 60) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        spans = phoenix.spans(PROJECT, trace_id=trace_id)
        if len(spans) >= count or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)  # polling interval of a bounded wait for ingestion


def test_a_rollouts_calls_reach_phoenix_as_one_trace(phoenix: Phoenix, tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "calls")
    env = {
        "OTEL_TRACES_EXPORTER": "otlp,model_call_jsonl",
        "OTEL_METRICS_EXPORTER": "none",  # Phoenix takes traces only
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url,
        "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": str(store.root),
        "OTEL_SERVICE_NAME": "recorded-model",
        "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={PROJECT}",
        "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "fastapi",  # our server span, without per-chunk spans
    }
    agent = TracerProvider(
        resource=Resource.create({"service.name": "agent", "openinference.project.name": PROJECT})
    )
    agent.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{phoenix.url}/v1/traces")))
    with instrumented_model_server(env) as server:
        with (
            openai.OpenAI(
                base_url=f"{server.url}/v1",
                api_key="k",
                max_retries=0,
                http_client=instrument_http_client(openai.DefaultHttpxClient()),
            ) as oai,
            anthropic.Anthropic(
                base_url=server.url,
                api_key="k",
                max_retries=0,
                http_client=instrument_http_client(anthropic.DefaultHttpxClient()),
            ) as claude,
            agent.get_tracer("agent").start_as_current_span("rollout phx-0", kind=SpanKind.CLIENT) as root,
            rollout_context(ROLLOUT),
        ):
            list(
                oai.chat.completions.create(
                    model="gpt-4o",
                    messages=[{"role": "user", "content": "hi"}],
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            claude.messages.create(
                model="claude-test", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
            )
        server.stop()  # flushes the server's batch processor
    agent.shutdown()
    trace_id = format(root.get_span_context().trace_id, "032x")

    records = read_model_call_records(store, ROLLOUT)
    assert [r.dialect for r in records] == ["chat", "messages"]
    spans = _wait_for_trace(phoenix, trace_id, count=5)  # agent + 2 x (HTTP server span + model-call span)
    by_id = {s["context"]["span_id"]: s for s in spans}
    assert {s["context"]["trace_id"] for s in spans} == {trace_id}
    (agent_span,) = [s for s in spans if s["name"] == "rollout phx-0"]
    for record in records:
        span = by_id[record.span_id]
        attributes = span["attributes"]
        assert span["name"] == f"chat {record.request['model']}"
        assert attributes["rollout.id"] == ROLLOUT
        assert attributes["gen_ai.usage.input_tokens"] == record.tokens_in
        assert attributes["gen_ai.usage.output_tokens"] == record.tokens_out
        # Phoenix shows the span as an LLM call, with the token counts it derived from ours
        assert span["span_kind"] == "LLM"
        assert attributes["llm.token_count.prompt"] == record.tokens_in
        # latency as sent: the span's duration in Phoenix is the call's measured latency
        duration_ms = (_seconds(span["end_time"]) - _seconds(span["start_time"])) * 1000
        assert abs(duration_ms - record.latency_total_ms) < 50
        # one trace: model-call span -> HTTP server span -> the agent's span
        http_span = by_id[span["parent_id"]]
        assert http_span["name"].startswith("POST ")
        assert http_span["parent_id"] == agent_span["context"]["span_id"]
    streamed = by_id[records[0].span_id]["attributes"]
    assert abs(streamed["gen_ai.response.time_to_first_chunk"] * 1000 - records[0].latency_ttft_ms) < 0.01
