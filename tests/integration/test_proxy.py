"""The capture proxy in front of a real upstream server: embedded (``start_proxy``) and as the
``otel-capture proxy`` command in its own process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from support import RECORDED, ReplayModelServer, Telemetry, recorded_json, serve, start_cli_proxy

from otel_capture import CaptureSettings, CaptureStore, read_model_call_records, start_proxy


@pytest.fixture
def upstream(replay_server: ReplayModelServer) -> Iterator[str]:
    with serve(replay_server) as url:
        yield url


def test_proxy_captures_all_three_dialects_and_nests_the_call_span_under_the_http_span(
    upstream: str, telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    settings = CaptureSettings()
    with start_proxy(upstream, settings=settings, tracer_provider=telemetry.provider) as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/ng-rollout/p-1/v1", api_key="k", max_retries=0)
        client.responses.create(model="gpt-4o-mini", input="hi")
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        anthropic.Anthropic(base_url=f"{proxy.url}/ng-rollout/p-1", api_key="k", max_retries=0).messages.create(
            model="claude-test", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert [p for _, p, _ in replay_server.seen] == ["/v1/responses", "/v1/chat/completions", "/v1/messages"]
    records = read_model_call_records(telemetry.store, "p-1")
    assert [r.dialect for r in records] == ["responses", "chat", "messages"]
    assert records[2].response == json.loads(recorded_json("messages"))
    spans = telemetry.spans.get_finished_spans()
    calls = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    servers = {s.context.span_id: s for s in spans if s.kind.name == "SERVER"}
    assert len(calls) == 3 and len(servers) == 3
    for call in calls:
        assert call.kind.name == "CLIENT"
        assert call.parent is not None and call.parent.span_id in servers
        assert call.context.trace_id == servers[call.parent.span_id].context.trace_id


def test_proxy_relays_a_stream_byte_for_byte_and_records_the_reassembled_response(
    upstream: str, telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    sse = (RECORDED / "openai-python/chat_completions_sse/parse_strict_tools.a247c49c5fcd.sse").read_bytes()
    events = [e + b"\n\n" for e in sse.split(b"\n\n") if e.strip()]
    replay_server.replies["chat"].content_type = "text/event-stream"
    replay_server.replies["chat"].chunks = events
    settings = CaptureSettings()
    with start_proxy(upstream, settings=settings, tracer_provider=telemetry.provider) as proxy:
        with httpx.stream(
            "POST", f"{proxy.url}/ng-rollout/s-1/v1/chat/completions", json={"model": "gpt-4o", "stream": True}
        ) as response:
            received = b"".join(response.iter_raw())
    assert received == b"".join(events)
    (record,) = read_model_call_records(telemetry.store, "s-1")
    assert record.stream is True and record.error_category is None
    assert record.response_raw is None  # a clean stream is not stored twice
    assert record.tool_calls and record.tool_calls[0]["name"]
    assert record.tokens_in is not None and record.tokens_out is not None


def test_unreachable_upstream_is_a_502_recorded_as_upstream_error(telemetry: Telemetry) -> None:
    with serve(ReplayModelServer()) as dead:
        pass  # the server is gone: its port now refuses connections
    settings = CaptureSettings()
    with start_proxy(dead, settings=settings, tracer_provider=telemetry.provider) as proxy:
        response = httpx.post(f"{proxy.url}/ng-rollout/down/v1/messages", json={"model": "m"})
    assert response.status_code == 502
    assert response.json()["error"]["type"] == "upstream_unreachable"
    (record,) = read_model_call_records(telemetry.store, "down")
    assert record.status_code == 502 and record.error_category == "upstream_error"


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_cli_proxy_prints_its_address_captures_and_stops_cleanly(
    upstream: str, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    capture_dir = tmp_path / "calls"
    process, url = start_cli_proxy(upstream, "--port", "0", "--capture-dir", str(capture_dir), stderr=subprocess.PIPE)
    try:
        client = openai.OpenAI(base_url=f"{url}/ng-rollout/cli-1/v1", api_key="k", max_retries=0)
        for _ in range(3):
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    finally:
        process.send_signal(stop_signal)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert len(read_model_call_records(CaptureStore(capture_dir), "cli-1")) == 3


def test_cli_proxy_takes_its_directory_from_the_standard_variable(upstream: str, tmp_path: Path) -> None:
    capture_dir = tmp_path / "from-env"
    process, url = start_cli_proxy(upstream, env={"OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": str(capture_dir)})
    try:
        httpx.post(f"{url}/ng-rollout/env-1/v1/responses", json={"model": "m", "input": "x"})
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert len(read_model_call_records(CaptureStore(capture_dir), "env-1")) == 1


def test_cli_show_lists_rollouts_and_calls(upstream: str, tmp_path: Path) -> None:
    capture_dir = tmp_path / "calls"
    with start_proxy(upstream, str(capture_dir)) as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/ng-rollout/show-1/v1", api_key="k", max_retries=0)
        client.responses.create(model="gpt-4o-mini", input="hi")
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    listing = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "show", str(capture_dir)], capture_output=True, text=True
    )
    assert listing.returncode == 0, listing.stderr
    assert "show-1" in listing.stdout
    calls = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "show", str(capture_dir), "show-1"], capture_output=True, text=True
    )
    assert calls.returncode == 0, calls.stderr
    lines = calls.stdout.splitlines()
    assert any("responses" in line and "gpt-4o-mini" in line for line in lines)
    assert any("chat" in line and "200" in line for line in lines)


def test_cli_show_exits_nonzero_on_a_damaged_file(tmp_path: Path) -> None:
    (tmp_path / "bad.capture.jsonl").write_text('{"model_call_id": "a", "dialect": "chat"}\nnot json\n')
    result = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "show", str(tmp_path), "bad"], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "line 2" in result.stderr


def test_a_client_that_closes_right_after_reading_a_json_body_is_not_a_cancelled_call(
    upstream: str, telemetry: Telemetry
) -> None:
    """The upstream answers with Content-Length; each call uses a fresh connection that closes at once."""
    settings = CaptureSettings()
    with start_proxy(upstream, settings=settings, tracer_provider=telemetry.provider) as proxy:
        for _ in range(10):
            with httpx.Client() as client:
                response = client.post(f"{proxy.url}/ng-rollout/fresh/v1/chat/completions", json={"model": "m"})
                assert response.status_code == 200
                # the record is durable by the time the client holds the body
                assert len(read_model_call_records(telemetry.store, "fresh")) >= 1
    records = read_model_call_records(telemetry.store, "fresh")
    assert len(records) == 10
    assert [r.error_category for r in records] == [None] * 10
