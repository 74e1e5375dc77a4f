"""The capture proxy in front of a real upstream server: embedded (``start_proxy``) and as the
``otel-capture proxy`` command in its own process."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from otlp_receiver import OtlpReceiver, serve_grpc
from support import RECORDED, ReplayModelServer, Telemetry, recorded_json, serve, start_cli_proxy

from otel_capture import CaptureSettings, CaptureStore, read_model_call_records, start_proxy

SERVER = 2  # OTLP Span.SpanKind SPAN_KIND_SERVER


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
        anthropic.Anthropic(
            base_url=f"{proxy.url}/ng-rollout/p-1", api_key="k", max_retries=0
        ).messages.create(model="claude-test", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
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
    with (
        start_proxy(upstream, settings=settings, tracer_provider=telemetry.provider) as proxy,
        httpx.stream(
            "POST",
            f"{proxy.url}/ng-rollout/s-1/v1/chat/completions",
            json={"model": "gpt-4o", "stream": True},
        ) as response,
    ):
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


def test_an_unreachable_upstream_is_named_in_the_log_not_in_the_clients_answer(
    telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    """The client's 502 says the upstream could not be reached, without the proxy's internal address or a
    library's repr; the proxy's log names the upstream and the error, once for a burst of failures."""
    with serve(ReplayModelServer()) as dead:
        pass
    with (
        caplog.at_level(logging.WARNING, logger="otel_capture"),
        start_proxy(dead, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
    ):
        answers = [
            httpx.post(f"{proxy.url}/ng-rollout/down/v1/chat/completions", json={"model": "m"})
            for _ in range(3)
        ]
    port = dead.rsplit(":", 1)[1]
    for answer in answers:
        assert answer.status_code == 502
        assert port not in answer.text and "Error(" not in answer.text and "aiohttp" not in answer.text
        assert answer.json()["error"]["type"] == "upstream_unreachable"
    lines = [r.getMessage() for r in caplog.records if "could not be reached" in r.getMessage()]
    assert len(lines) == 1 and dead.split("//")[1] in lines[0]  # once for the burst, naming the upstream


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_cli_proxy_prints_its_address_captures_and_stops_cleanly(
    upstream: str, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    capture_dir = tmp_path / "calls"
    process, url = start_cli_proxy(
        upstream, "--port", "0", "--capture-dir", str(capture_dir), stderr=subprocess.PIPE
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/ng-rollout/cli-1/v1", api_key="k", max_retries=0)
        for _ in range(3):
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    finally:
        process.send_signal(stop_signal)
        _out, err = process.communicate(timeout=30)
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
        [sys.executable, "-m", "otel_capture._cli.main", "show", str(capture_dir)],
        capture_output=True,
        text=True,
    )
    assert listing.returncode == 0, listing.stderr
    assert "show-1" in listing.stdout
    calls = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "show", str(capture_dir), "show-1"],
        capture_output=True,
        text=True,
    )
    assert calls.returncode == 0, calls.stderr
    lines = calls.stdout.splitlines()
    assert any("responses" in line and "gpt-4o-mini" in line for line in lines)
    assert any("chat" in line and "200" in line for line in lines)


def test_cli_show_exits_nonzero_on_a_damaged_file(tmp_path: Path) -> None:
    (tmp_path / "bad.capture.jsonl").write_text('{"model_call_id": "a", "dialect": "chat"}\nnot json\n')
    result = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "show", str(tmp_path), "bad"],
        capture_output=True,
        text=True,
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
                response = client.post(
                    f"{proxy.url}/ng-rollout/fresh/v1/chat/completions", json={"model": "m"}
                )
                assert response.status_code == 200
                # the record is durable by the time the client holds the body
                assert len(read_model_call_records(telemetry.store, "fresh")) >= 1
    records = read_model_call_records(telemetry.store, "fresh")
    assert len(records) == 10
    assert [r.error_category for r in records] == [None] * 10


# -- the standard OTEL_* variables, as the SDK reads them (a real OTLP receiver, HTTP and gRPC) -------------


def _two_calls_through_the_cli_proxy(upstream: str, capture_dir: Path, env: dict[str, str]) -> str:
    """Two prefixed calls through ``otel-capture proxy``, stopped (SIGTERM) before returning: everything it
    exports has been sent by then. Returns its stderr."""
    process, url = start_cli_proxy(
        upstream, "--capture-dir", str(capture_dir), env=env, stderr=subprocess.PIPE
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/ng-rollout/otlp-1/v1", api_key="k", max_retries=0)
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        client.responses.create(model="gpt-4o-mini", input="hi")
    finally:
        process.terminate()
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    return err


@pytest.fixture(params=["http/protobuf", "grpc"])
def otlp_endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[OtlpReceiver, str, str]]:
    otlp = OtlpReceiver()
    with serve(otlp) if request.param == "http/protobuf" else serve_grpc(otlp) as endpoint:
        yield otlp, endpoint, request.param


def test_cli_proxy_sends_spans_where_the_standard_variables_say(
    upstream: str, tmp_path: Path, otlp_endpoint: tuple[OtlpReceiver, str, str]
) -> None:
    otlp, endpoint, protocol = otlp_endpoint
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": "capture-proxy-under-test",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=test",
    }
    err = _two_calls_through_the_cli_proxy(upstream, tmp_path / "calls", env)
    assert "not installed" not in err and "ignoring" not in err, err
    otlp.wait_for(lambda r: sum(s.kind == SERVER for s in r.spans) == 2)
    records = read_model_call_records(CaptureStore(tmp_path / "calls"), "otlp-1")
    by_id = {s.span_id: s for s in otlp.spans}
    assert [by_id[r.span_id].name for r in records] == ["chat gpt-4o", "chat gpt-4o-mini"]
    servers = sorted((s for s in otlp.spans if s.kind == SERVER), key=lambda s: s.start_ns)
    # named by the route, never by the rollout: one operation for every rollout in the backend
    assert [s.name for s in servers] == ["POST /v1/chat/completions", "POST /v1/responses"]
    assert [s.attributes["http.route"] for s in servers] == ["/v1/chat/completions", "/v1/responses"]
    assert not [s.name for s in otlp.spans if "ng-rollout" in s.name]
    for span in otlp.spans:
        assert span.resource["service.name"] == "capture-proxy-under-test"
        assert span.resource["deployment.environment.name"] == "test"


def test_cli_proxy_with_sampler_always_off_sends_no_spans_and_still_writes_every_record(
    upstream: str, tmp_path: Path
) -> None:
    otlp = OtlpReceiver()
    with serve(otlp) as endpoint:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_TRACES_SAMPLER": "always_off",
        }
        _two_calls_through_the_cli_proxy(upstream, tmp_path / "calls", env)
    assert otlp.spans == []  # the proxy has exited: whatever it was going to export is sent
    records = read_model_call_records(CaptureStore(tmp_path / "calls"), "otlp-1")
    assert [r.dialect for r in records] == ["chat", "responses"]
    assert all(r.status_code == 200 for r in records)
