"""The capture middleware around a real uvicorn model server, called with the official SDKs."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import anthropic
import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from support import Gate, ReplayModelServer, Telemetry, recorded_json, recorded_streams, serve, sse_chunks

from otel_capture import (
    CaptureSettings,
    CaptureStore,
    ModelCallCaptureMiddleware,
    read_available_model_call_records,
    read_model_call_records,
)
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter


@pytest.fixture
def server(replay_server: ReplayModelServer, telemetry: Telemetry) -> Iterator[str]:
    settings = CaptureSettings(service_name="test_policy")
    app = ModelCallCaptureMiddleware(replay_server, tracer_provider=telemetry.provider, settings=settings)
    with serve(app) as url:
        yield url


def _openai(base_url: str, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="sk-secret-openai-key", max_retries=0, **kwargs)  # type: ignore[arg-type]


def _three_calls(url: str, rollout_id: str) -> tuple[object, object, object]:
    client = _openai(f"{url}/ng-rollout/{rollout_id}/v1")
    responses = client.responses.create(model="gpt-4o-mini", input="What's the weather?")
    chat = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    messages = anthropic.Anthropic(
        base_url=f"{url}/ng-rollout/{rollout_id}", api_key="sk-ant-secret", max_retries=0
    ).messages.create(model="claude-test", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    return responses, chat, messages


def test_each_dialect_under_the_prefix_is_one_record(
    server: str, telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    responses, chat, messages = _three_calls(server, "0-0")

    # the model server routed the stripped paths and the SDKs got the recorded bodies
    assert [path for _, path, _ in replay_server.seen] == [
        "/v1/responses",
        "/v1/chat/completions",
        "/v1/messages",
    ]
    assert responses.id == json.loads(recorded_json("responses"))["id"]  # type: ignore[attr-defined]
    assert chat.id == json.loads(recorded_json("chat"))["id"]  # type: ignore[attr-defined]
    assert messages.id == json.loads(recorded_json("messages"))["id"]  # type: ignore[attr-defined]

    records = read_model_call_records(telemetry.store, "0-0")
    assert [r.call_index for r in records] == [0, 1, 2]
    assert [r.dialect for r in records] == ["responses", "chat", "messages"]
    assert [r.model for r in records] == [
        "gpt-4o-mini-2024-07-18",
        "gpt-4o-2024-08-06",
        "claude-sonnet-4-5-20250929",
    ]
    assert [r.status_code for r in records] == [200, 200, 200]
    assert all(r.error_category is None for r in records)
    assert all(r.model_ref is not None and r.model_ref.name == "test_policy" for r in records)
    usage = [json.loads(recorded_json(d))["usage"] for d in ("responses", "chat", "messages")]
    assert [(r.tokens_in, r.tokens_out) for r in records] == [
        (usage[0]["input_tokens"], usage[0]["output_tokens"]),
        (usage[1]["prompt_tokens"], usage[1]["completion_tokens"]),
        (usage[2]["input_tokens"], usage[2]["output_tokens"]),
    ]
    for record in records:
        assert record.started_at is not None and record.completed_at is not None
        assert record.started_at <= record.completed_at
        assert record.latency_total_ms is not None and record.latency_total_ms > 0
        assert record.latency_ttft_ms is not None and 0 < record.latency_ttft_ms <= record.latency_total_ms
        assert record.request is not None and record.request["model"] in (
            "gpt-4o-mini",
            "gpt-4o",
            "claude-test",
        )
        assert record.stream is False
    # the exact response bodies are kept
    assert records[1].response == json.loads(recorded_json("chat"))


def test_spans_and_records_describe_the_same_calls(server: str, telemetry: Telemetry) -> None:
    _three_calls(server, "r-spans")
    records = read_model_call_records(telemetry.store, "r-spans")
    spans = telemetry.spans.get_finished_spans()
    assert len(spans) == 3
    by_id = {format(s.context.span_id, "016x"): s for s in spans}
    for record in records:
        span = by_id[record.span_id]
        attrs = span.attributes
        assert format(span.context.trace_id, "032x") == record.trace_id
        assert attrs["rollout.id"] == "r-spans"
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.provider.name"] == ("anthropic" if record.dialect == "messages" else "openai")
        assert attrs["gen_ai.request.model"] == record.request["model"]
        assert span.name == f"chat {record.request['model']}"
        assert attrs["gen_ai.response.model"] == record.model
        assert attrs["gen_ai.response.id"] == record.response_id
        assert attrs["gen_ai.usage.input_tokens"] == record.tokens_in
        assert attrs["gen_ai.usage.output_tokens"] == record.tokens_out
        assert "error.type" not in attrs
        # raw bodies never ride on spans
        assert not any("messages" in str(v) and "content" in str(v) for v in attrs.values())


def test_unprefixed_call_is_answered_but_not_captured(server: str, telemetry: Telemetry) -> None:
    chat = _openai(f"{server}/v1").chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "x"}]
    )
    assert chat.id == json.loads(recorded_json("chat"))["id"]
    assert telemetry.store.rollout_ids() == []
    assert telemetry.spans.get_finished_spans() == ()


def test_baggage_only_call_is_captured_under_its_baggage_id(server: str, telemetry: Telemetry) -> None:
    client = _openai(f"{server}/v1", default_headers={"baggage": "user=alice, rollout.id=bag-7;prop=1"})
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert telemetry.store.rollout_ids() == ["bag-7"]
    assert len(read_model_call_records(telemetry.store, "bag-7")) == 1
    (span,) = telemetry.spans.get_finished_spans()
    assert span.attributes["rollout.id"] == "bag-7"
    assert span.attributes["otel_capture.rollout.source"] == "baggage"


def test_url_prefix_wins_over_baggage_and_the_span_says_so(server: str, telemetry: Telemetry) -> None:
    client = _openai(f"{server}/ng-rollout/from-url/v1", default_headers={"baggage": "rollout.id=from-bag"})
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert telemetry.store.rollout_ids() == ["from-url"]
    (span,) = telemetry.spans.get_finished_spans()
    assert span.attributes["rollout.id"] == "from-url"
    assert span.attributes["rollout.id.baggage"] == "from-bag"


def test_correlation_order_is_url_prefix_then_rollout_header_then_baggage(
    server: str, telemetry: Telemetry
) -> None:
    both = {"x-rollout-id": "from-header", "baggage": "rollout.id=from-bag"}
    _openai(f"{server}/ng-rollout/from-url/v1", default_headers=both).chat.completions.create(
        model="m", messages=[]
    )
    _openai(f"{server}/v1", default_headers=both).chat.completions.create(model="m", messages=[])
    assert telemetry.store.rollout_ids() == ["from-header", "from-url"]
    sources = [s.attributes["otel_capture.rollout.source"] for s in telemetry.spans.get_finished_spans()]
    assert sources == ["url_prefix", "header"]


@pytest.mark.parametrize("bad_id", ["bad%20id", "..x", "-lead", "a" * 201, "a%2Fb", "%00", "city%209"])
def test_an_invalid_rollout_id_is_served_not_recorded_counted_and_never_written_raw(
    server: str,
    telemetry: Telemetry,
    replay_server: ReplayModelServer,
    bad_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 33: capture never fails a call (this was a 400 ``invalid_rollout_id``, an eval ending in
    error). The call is served as a correlated one would be (the prefix stripped), nothing is recorded,
    the id is never a file name, and the warning shows it escaped and cut."""
    with caplog.at_level(logging.WARNING, logger="otel_capture"):
        answer = _openai(f"{server}/ng-rollout/{bad_id}/v1").chat.completions.create(model="m", messages=[])
    assert answer.choices  # the model's answer, as without capture
    assert [(method, path) for method, path, _ in replay_server.seen] == [("POST", "/v1/chat/completions")]
    assert telemetry.store.rollout_ids() == []
    decoded = unquote(bad_id)
    names = [p.name for p in telemetry.store.root.iterdir()] if telemetry.store.root.exists() else []
    assert all(n.startswith(".uncorrelated.") for n in names), names  # only the count, below
    assert not any(decoded in n for n in names if len(decoded) > 2)
    (warning,) = [r.getMessage() for r in caplog.records if "not a rollout id" in r.getMessage()]
    assert "/ng-rollout/<id>/ prefix" in warning and "served and not recorded" in warning
    assert repr(decoded[:64]) in warning and "\x00" not in warning  # escaped (%00 shows as '\\x00')
    assert decoded[:65] not in warning or len(decoded) <= 64  # cut


def test_malformed_request_body_is_kept_raw(server: str, telemetry: Telemetry) -> None:
    body = b'{"model": "gpt-4o", "messages": [oops'
    response = httpx.post(
        f"{server}/ng-rollout/bad-body/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200  # the model server decides; capture does not
    (record,) = read_model_call_records(telemetry.store, "bad-body")
    assert record.request is None
    assert record.request_raw == body.decode()


def test_non_object_request_body_is_kept_raw(server: str, telemetry: Telemetry) -> None:
    httpx.post(f"{server}/ng-rollout/list-body/v1/responses", json=[1, 2, 3])
    (record,) = read_model_call_records(telemetry.store, "list-body")
    assert record.request is None and record.request_raw == "[1,2,3]"


def test_other_paths_and_methods_pass_through_untouched(
    server: str, telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    assert httpx.get(f"{server}/ng-rollout/r1/v1/models").json() == {"path": "/v1/models", "method": "GET"}
    assert httpx.get(f"{server}/ng-rollout/r1/v1/responses").json() == {
        "path": "/v1/responses",
        "method": "GET",
    }
    assert httpx.get(f"{server}/health").json()["path"] == "/health"
    assert telemetry.store.rollout_ids() == []


def test_trailing_slash_is_captured(server: str, telemetry: Telemetry) -> None:
    httpx.post(f"{server}/ng-rollout/slash/v1/chat/completions/", json={"model": "m", "messages": []})
    assert len(read_model_call_records(telemetry.store, "slash")) == 1


def test_secret_headers_are_never_written(server: str, telemetry: Telemetry) -> None:
    secrets = {
        "authorization": "Bearer sk-very-secret-1",
        "x-api-key": "sk-very-secret-2",
        "api-key": "sk-very-secret-3",
        "cookie": "session=sk-very-secret-4",
        "proxy-authorization": "Basic sk-very-secret-5",
    }
    httpx.post(
        f"{server}/ng-rollout/secrets/v1/chat/completions",
        json={"model": "m", "messages": []},
        headers={**secrets, "x-session-id": "sess-1"},
    )
    (record,) = read_model_call_records(telemetry.store, "secrets")
    assert record.client_session_id == "sess-1"
    written = b"".join(p.read_bytes() for p in telemetry.store.root.rglob("*") if p.is_file())
    for value in secrets.values():
        assert value.encode() not in written
    for span in telemetry.spans.get_finished_spans():
        assert not any("sk-very-secret" in str(v) for v in span.attributes.values())


async def _content_length_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Sends the whole JSON body with more_body=True and Content-Length, then an empty final message:
    a client has the full response once Content-Length is reached."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = recorded_json("chat")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.mark.parametrize("app_kind", ["chunked", "content-length"])
def test_client_gets_the_terminal_chunk_only_after_the_record_is_durable(
    tmp_path: Path, replay_server: ReplayModelServer, app_kind: str
) -> None:
    entered, release = threading.Event(), threading.Event()
    synced: list[int] = []

    def slow_fsync(fd: int) -> None:
        entered.set()
        release.wait(30)
        synced.append(fd)

    provider = TracerProvider()
    exporter = ModelCallJsonlExporter(tmp_path / "calls", fsync=slow_fsync)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inner = replay_server if app_kind == "chunked" else _content_length_app
    app = ModelCallCaptureMiddleware(inner, tracer_provider=provider)
    results: list[httpx.Response] = []
    with serve(app) as url:
        thread = threading.Thread(
            target=lambda: results.append(
                httpx.post(f"{url}/ng-rollout/held/v1/chat/completions", json={"model": "m", "messages": []})
            )
        )
        thread.start()
        assert entered.wait(30), "the writer never reached fsync"
        thread.join(0.2)
        assert results == [], "the client got the response before the record was durable"
        release.set()
        thread.join(30)
    assert results[0].status_code == 200 and synced
    assert len(read_model_call_records(CaptureStore(tmp_path / "calls"), "held")) == 1
    provider.shutdown()


async def _answer(receive: Any, send: Any, content_type: bytes, bodies: list[bytes]) -> None:
    """Read the request whole, then answer with ``bodies``: each but the last with ``more_body``, the last
    as the final message."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
    for body in bodies[:-1]:
        await send({"type": "http.response.body", "body": body, "more_body": True})
    await send({"type": "http.response.body", "body": bodies[-1], "more_body": False})


@pytest.mark.parametrize("shape", ["stream", "json", "json-then-empty"])
def test_the_whole_response_goes_out_once_durable_while_the_app_is_still_tearing_down(
    tmp_path: Path, shape: str
) -> None:
    """An app's work after its last response message (a StreamingResponse's task group ending, a loop
    iteration or more on a busy server) is not waited for: once the last message is sent and the record is
    durable, the client has the whole response, while the app has not returned yet. The answer's last
    message: an empty one after the stream's events, the JSON body itself, an empty one after the body."""
    streamed = shape == "stream"
    raw = next(r for name, d, r in recorded_streams() if d == "chat") if streamed else recorded_json("chat")
    bodies = {"stream": [*sse_chunks(raw), b""], "json": [raw], "json-then-empty": [raw, b""]}[shape]
    teardown, returned = Gate(), threading.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await _answer(receive, send, b"text/event-stream" if streamed else b"application/json", bodies)
        await teardown.wait()  # the app's own work after its response, until the test has looked
        returned.set()

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(tmp_path / "calls")))
    seen: list[tuple[bytes, bool, int]] = []

    def call(url: str) -> None:
        response = httpx.post(
            f"{url}/ng-rollout/teardown/v1/chat/completions",
            json={"model": "m", "messages": [], "stream": streamed},
            timeout=30,
        )
        durable = len(read_model_call_records(CaptureStore(tmp_path / "calls"), "teardown"))
        seen.append((response.content, returned.is_set(), durable))

    try:
        with serve(ModelCallCaptureMiddleware(app, tracer_provider=provider)) as url:
            client = threading.Thread(target=call, args=(url,))
            client.start()
            client.join(15)
            got_it_first = not client.is_alive()
            teardown.open()
            client.join(30)
            assert returned.wait(30)
    finally:
        teardown.open()
        provider.shutdown()
    assert got_it_first, "the client got the response only when the app returned"
    assert len(seen) == 1, "the client's call failed"
    ((content, app_had_returned, durable),) = seen
    assert content == raw and not app_had_returned
    assert durable == 1  # the record was made at the final message, before the app returned
    (record,) = read_model_call_records(CaptureStore(tmp_path / "calls"), "teardown")
    assert record.status_code == 200 and record.error_category is None and record.stream is streamed


def test_an_error_after_the_final_message_leaves_the_record_as_the_client_saw_the_call(
    tmp_path: Path,
) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await _answer(receive, send, b"application/json", [recorded_json("chat")])
        raise RuntimeError("the app's teardown failed after its response")

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(tmp_path / "calls")))
    try:
        with serve(ModelCallCaptureMiddleware(app, tracer_provider=provider)) as url:
            response = httpx.post(
                f"{url}/ng-rollout/after/v1/chat/completions", json={"model": "m", "messages": []}, timeout=30
            )
    finally:
        provider.shutdown()
    assert response.status_code == 200 and response.content == recorded_json("chat")
    (record,) = read_model_call_records(CaptureStore(tmp_path / "calls"), "after")
    assert record.status_code == 200 and record.error_category is None
    assert record.response == json.loads(recorded_json("chat"))


def test_a_failing_disk_never_touches_the_response_and_marks_the_rollout_incomplete(
    tmp_path: Path, replay_server: ReplayModelServer, caplog: pytest.LogCaptureFixture
) -> None:
    def failing_fsync(fd: int) -> None:
        import errno
        import os

        if not os.path.isdir(f"/proc/self/fd/{fd}") and "incomplete" not in os.readlink(
            f"/proc/self/fd/{fd}"
        ):
            raise OSError(errno.EIO, "Input/output error")

    provider = TracerProvider()
    exporter = ModelCallJsonlExporter(tmp_path / "calls", fsync=failing_fsync)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = ModelCallCaptureMiddleware(replay_server, tracer_provider=provider)
    with caplog.at_level(logging.ERROR), serve(app) as url:
        response = httpx.post(
            f"{url}/ng-rollout/eio/v1/chat/completions", json={"model": "m", "messages": []}
        )
    assert response.status_code == 200
    assert response.content == recorded_json("chat")
    assert exporter.stats.failures == 1
    assert any("eio" in r.getMessage() and "Input/output error" in r.getMessage() for r in caplog.records)
    available = read_available_model_call_records(CaptureStore(tmp_path / "calls"), "eio")
    assert available.incomplete
    marker = (tmp_path / "calls" / "eio.capture.incomplete").read_text().splitlines()
    assert len(marker) == 1 and "Input/output error" in json.loads(marker[0])["reason"]
    provider.shutdown()


def test_an_unwritable_capture_directory_never_touches_the_response(
    tmp_path: Path, replay_server: ReplayModelServer
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the capture directory should be")
    provider = TracerProvider()
    exporter = ModelCallJsonlExporter(blocked)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = ModelCallCaptureMiddleware(replay_server, tracer_provider=provider)
    with serve(app) as url:
        response = httpx.post(f"{url}/ng-rollout/r/v1/messages", json={"model": "m", "messages": []})
    assert response.status_code == 200 and response.content == recorded_json("messages")
    assert exporter.stats.failures == 1
    provider.shutdown()


def test_upstream_error_status_is_recorded_with_its_category(
    server: str, telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    replay_server.replies["chat"].status = 429
    replay_server.replies["chat"].chunks = [b'{"error": {"message": "slow down", "type": "rate_limit"}}']
    with pytest.raises(openai.RateLimitError):
        _openai(f"{server}/ng-rollout/limited/v1").chat.completions.create(model="m", messages=[])
    (record,) = read_model_call_records(telemetry.store, "limited")
    assert record.status_code == 429 and record.error_category == "rate_limit"
    (span,) = telemetry.spans.get_finished_spans()
    assert span.attributes["error.type"] == "rate_limit"
    assert span.status.status_code.name == "ERROR"


def test_a_record_that_cannot_be_built_marks_the_call_incomplete_and_the_response_is_untouched(
    server: str, telemetry: Telemetry, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from otel_capture._capture.call import InFlightCall

    def broken_line(self: InFlightCall, trace_id: int, span_id: int) -> bytes:
        raise RuntimeError("cannot encode this record")

    monkeypatch.setattr(InFlightCall, "line", broken_line)  # the seam: a bug in building the record
    with caplog.at_level(logging.ERROR):
        response = httpx.post(f"{server}/ng-rollout/unbuildable/v1/chat/completions", json={"model": "m"})
    assert response.status_code == 200 and response.content == recorded_json("chat")
    assert telemetry.jsonl.force_flush()
    assert telemetry.jsonl.stats.failures == 1
    marker = (telemetry.store.root / "unbuildable.capture.incomplete").read_text().splitlines()
    assert len(marker) == 1 and "cannot encode this record" in json.loads(marker[0])["reason"]
    from otel_capture._store.inflight import INFLIGHT_REASON

    snapshot = telemetry.store.freeze_now("unbuildable")
    assert snapshot.incomplete
    # the call says why it is missing, and is not left looking like a call still in flight
    assert [c.reason for c in snapshot.incomplete_calls if "cannot encode" in c.reason]
    assert all(c.reason != INFLIGHT_REASON for c in snapshot.incomplete_calls)
    assert sum("failed while finishing" in r.getMessage() for r in caplog.records) == 1  # logged once
