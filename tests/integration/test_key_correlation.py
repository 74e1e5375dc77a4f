"""The rollout id from a per-rollout API key or from ``X-Session-ID`` (issue 22 item 4), end to end.

AReaL, slime and OpenEnv give each rollout its own API key and keep one base URL; verifiers sends its
per-rollout id as ``X-Session-ID``. Here the agent is the official openai (and anthropic) SDK with a
per-rollout ``api_key``, in front of a gateway-like hop (a real uvicorn app that forwards only
``Authorization`` and the content type), then the capture proxy, then a replaying model server.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import ReplayModelServer, Reply, read_body, recorded_json, serve, sse_chunks

from otel_capture import CaptureSettings, CaptureStore, ProxySettings, read_model_call_records, start_proxy
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

PATTERN = r"rk-(?P<rollout>[A-Za-z0-9_-]+)\.[A-Za-z0-9]+"
UPSTREAM_KEY = "sk-upstream-0123456789"
CHAT_STREAM = (
    Path(__file__).resolve().parents[1]
    / "fixtures/recorded_streams/openai-python/chat_completions_sse/parse_nothing.e2aad469b71d.sse"
).read_bytes()


def _key(rollout_id: str) -> str:
    return f"rk-{rollout_id}.S3cret{rollout_id.replace('-', '')}Part"


def _authorization_only_hop(target: str) -> Any:
    """A gateway-like hop: forwards method, path, query and body to ``target`` with only the
    ``Authorization`` and ``Content-Type`` headers (no ``x-*``, no ``baggage``, no prefix in the URL)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        headers = [(k, v) for k, v in scope["headers"] if k in (b"authorization", b"content-type")]
        query = "?" + scope["query_string"].decode() if scope["query_string"] else ""
        async with httpx.AsyncClient() as client:
            response = await client.request(
                scope["method"], target + scope["path"] + query, headers=headers, content=body
            )
        out = [(b"content-type", response.headers.get("content-type", "application/json").encode())]
        await send({"type": "http.response.start", "status": response.status_code, "headers": out})
        await send({"type": "http.response.body", "body": response.content})

    return app


@dataclass
class Stack:
    url: str  # what the agent calls
    store: CaptureStore
    spans: InMemorySpanExporter


@contextlib.contextmanager
def _stack(
    replay_server: ReplayModelServer, tmp_path: Path, settings: CaptureSettings, *, hop: bool
) -> Iterator[Stack]:
    store = CaptureStore(tmp_path / "calls")
    provider = TracerProvider()
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(store.root)))
    # the HTTP server span is asked to show the credential headers: they must read [REDACTED]
    headers = ProxySettings(capture_request_headers=("authorization", "x-api-key", "x-session-id"))
    with (
        serve(replay_server) as upstream,
        start_proxy(upstream, settings=settings, tracer_provider=provider, proxy=headers) as proxy,
    ):
        if hop:
            with serve(_authorization_only_hop(proxy.url)) as front:
                yield Stack(front, store, spans)
        else:
            yield Stack(proxy.url, store, spans)
    provider.shutdown()


def _everything_written(stack: Stack, caplog: pytest.LogCaptureFixture) -> str:
    """Every byte of the capture directory, every attribute of every span, every log line."""
    files = [
        p.read_bytes().decode("utf-8", "replace") for p in sorted(stack.store.root.rglob("*")) if p.is_file()
    ]
    spans = [
        json.dumps(dict(s.attributes or {}), default=str) + s.name for s in stack.spans.get_finished_spans()
    ]
    return "\n".join(files + spans + [r.getMessage() for r in caplog.records])


def test_per_rollout_api_keys_through_a_hop_that_forwards_only_authorization(
    replay_server: ReplayModelServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = CaptureSettings(api_key_rollout_pattern=PATTERN, upstream_api_key=UPSTREAM_KEY)  # type: ignore[arg-type]
    rollouts = [f"areal-{i}" for i in range(3)]
    with (
        caplog.at_level(logging.DEBUG, logger="otel_capture"),
        _stack(replay_server, tmp_path, settings, hop=True) as stack,
    ):
        for rollout_id in rollouts:
            replay_server.replies["chat"] = Reply(chunks=[recorded_json("chat")])
            with openai.OpenAI(base_url=f"{stack.url}/v1", api_key=_key(rollout_id), max_retries=0) as client:
                client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
                replay_server.replies["chat"].content_type = "text/event-stream"
                replay_server.replies["chat"].chunks = sse_chunks(CHAT_STREAM)
                for _ in client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "hi"}], stream=True
                ):
                    pass
                client.completions.create(model="m", prompt="The capital of France is")
                client.models.list()  # not a model call: its key is replaced upstream too
        assert stack.store.rollout_ids() == rollouts
        for rollout_id in rollouts:
            records = read_model_call_records(stack.store, rollout_id)
            assert [(r.dialect, r.stream) for r in records] == [
                ("chat", False),
                ("chat", True),
                ("completions", False),
            ]
        # the upstream saw the configured key, never a per-rollout one
        assert [h.get("authorization") for h in replay_server.headers_seen] == [f"Bearer {UPSTREAM_KEY}"] * 12
        call_spans = [s for s in stack.spans.get_finished_spans() if (s.attributes or {}).get("rollout.id")]
        assert len(call_spans) == 9
        assert {s.attributes["otel_capture.rollout.source"] for s in call_spans if s.attributes} == {
            "api_key"
        }
        written = _everything_written(stack, caplog)
    assert "[REDACTED]" in written  # the server span was asked for the header, and shows it redacted
    for rollout_id in rollouts:
        key = _key(rollout_id)
        assert key not in written and key.split(".")[1] not in written
    assert UPSTREAM_KEY not in written


def test_an_x_api_key_goes_upstream_as_sent_without_an_upstream_key(
    replay_server: ReplayModelServer, tmp_path: Path
) -> None:
    settings = CaptureSettings(api_key_rollout_pattern=PATTERN)  # type: ignore[arg-type]
    with _stack(replay_server, tmp_path, settings, hop=False) as stack:
        # the anthropic SDK sends its api_key as a bearer token; a plain client sends x-api-key
        with anthropic.Anthropic(base_url=stack.url, api_key=_key("slime-0"), max_retries=0) as client:
            client.messages.create(model="claude", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        answer = httpx.post(
            f"{stack.url}/v1/messages",
            headers={"x-api-key": _key("openenv-0"), "anthropic-version": "2023-06-01"},
            json={"model": "claude", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert answer.status_code == 200
        (record,) = read_model_call_records(stack.store, "slime-0")
        (plain,) = read_model_call_records(stack.store, "openenv-0")
    assert record.dialect == plain.dialect == "messages"
    assert replay_server.headers_seen[0]["authorization"] == f"Bearer {_key('slime-0')}"
    assert replay_server.headers_seen[1]["x-api-key"] == _key("openenv-0")


def test_a_key_whose_group_breaks_the_grammar_is_served_not_recorded_and_never_shown(
    replay_server: ReplayModelServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a fixed "sk" outside the group (a pattern whose group can be the whole key is refused at start)
    settings = CaptureSettings(api_key_rollout_pattern=r"sk(?P<rollout>.+)", upstream_api_key=UPSTREAM_KEY)  # type: ignore[arg-type]
    key = "sk proj+S3cretKeyPart"
    with (
        caplog.at_level(logging.DEBUG, logger="otel_capture"),
        _stack(replay_server, tmp_path, settings, hop=False) as stack,
    ):
        with openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0) as client:
            chat = client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
        assert chat.choices  # served
        assert stack.store.rollout_ids() == []
        written = _everything_written(stack, caplog)
    assert "its rollout group breaks the rollout id grammar" in written
    assert "no rollout id" in written  # and counted as uncorrelated, pointing to docs/gateways.md
    assert "S3cretKeyPart" not in written
    assert replay_server.headers_seen[0]["authorization"] == f"Bearer {UPSTREAM_KEY}"  # matched: replaced


@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off-by-default"])
def test_verifiers_session_ids_are_one_rollout_each_when_enabled(
    replay_server: ReplayModelServer, tmp_path: Path, enabled: bool
) -> None:
    settings = CaptureSettings(session_id_as_rollout=True) if enabled else CaptureSettings()
    sessions = [f"eval-{i}" for i in range(6)]
    with _stack(replay_server, tmp_path, settings, hop=False) as stack:
        # one base URL for the whole evaluation, the rollout in X-Session-ID (as verifiers sends it)
        for session in sessions:
            with openai.OpenAI(
                base_url=f"{stack.url}/v1",
                api_key="k",
                max_retries=0,
                default_headers={"X-Session-ID": session},
            ) as client:
                client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        if not enabled:
            assert stack.store.rollout_ids() == []
            return
        assert stack.store.rollout_ids() == sessions
        for session in sessions:
            (record,) = read_model_call_records(stack.store, session)
            assert record.client_session_id == session
        sources = {
            (s.attributes or {}).get("otel_capture.rollout.source")
            for s in stack.spans.get_finished_spans()
            if (s.attributes or {}).get("rollout.id")
        }
        assert sources == {"session_id"}
    assert [h["x-session-id"] for h in replay_server.headers_seen] == sessions  # forwarded as sent
