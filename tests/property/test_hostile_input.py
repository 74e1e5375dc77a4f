"""Hostile input, fuzzed with Hypothesis, through the real middleware and exporter (in-process ASGI calls,
so thousands of cases run in seconds; the same code runs under uvicorn in tests/integration).

Each case gets a clear error or is recorded (raw where it does not parse): never a crash, a hang, a
changed response, or a file outside the capture directory.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from otel_capture import CaptureSettings, ModelCallCaptureMiddleware, is_valid_rollout_id
from otel_capture._correlation.ids import split_rollout_prefix
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Harness:
    """Runs one request through the middleware around an app that answers with given bytes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.provider = TracerProvider()
        self.exporter = ModelCallJsonlExporter(root, fsync=lambda fd: None)  # durability is tested elsewhere
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reply: tuple[int, bytes, list[bytes]] = (200, b"application/json", [b"{}"])
        self.app = ModelCallCaptureMiddleware(
            self._upstream, tracer_provider=self.provider, settings=CaptureSettings(max_body_bytes=4096)
        )
        self.upstream_calls = 0

    async def _upstream(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.upstream_calls += 1
        while (await receive()).get("more_body"):
            pass
        status, content_type, chunks = self.reply
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]}
        )
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def request(
        self, raw_path: bytes, body: bytes = b"{}", headers: list[tuple[bytes, bytes]] | None = None
    ) -> tuple[int, bytes]:
        sent: list[dict[str, Any]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": raw_path.decode("latin-1"),
            "raw_path": raw_path,
            "query_string": b"",
            "root_path": "",
            "headers": headers or [(b"content-type", b"application/json")],
            "server": ("127.0.0.1", 8000),
            "client": ("127.0.0.1", 5555),
        }
        asyncio.run(asyncio.wait_for(self.app(scope, receive, send), 30))
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    def files_outside(self) -> list[str]:
        parent = self.root.parent
        return [p for p in os.listdir(parent) if p != self.root.name]


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path / "calls")
    yield h
    h.provider.shutdown()


hostile_ids = st.one_of(
    st.text(max_size=300),
    st.sampled_from(
        ["..", "../etc", ".hidden", "a/b", "a%2Fb", "a%00b", "\x00", "é", "a" * 10_000, "-x", "_x", "a b"]
    ),
)


@FUZZ
@given(rollout_id=hostile_ids)
def test_any_rollout_id_is_served_and_stays_inside_the_directory(harness: Harness, rollout_id: str) -> None:
    """Served whatever the id (issue 33: an id outside the grammar was a 400; capture never fails a
    call): recorded under a valid one, inside the directory; an invalid one is never a file name."""
    raw = b"/ng-rollout/" + quote(rollout_id, safe="").encode() + b"/v1/chat/completions"
    status, body = harness.request(raw)
    assert status == 200 and body == b"{}"
    if is_valid_rollout_id(rollout_id):
        assert (harness.root / f"{rollout_id}.capture.jsonl").parent == harness.root
    assert harness.files_outside() == []
    for name in os.listdir(harness.root) if harness.root.exists() else []:
        assert ("/" not in name and not name.startswith(".")) or name.startswith(
            (".otel-capture", ".uncorrelated.")
        )
        assert is_valid_rollout_id(name.split(".capture", 1)[0]) or name.startswith(".")


@FUZZ
@given(rollout_id=st.text(max_size=300))
def test_prefix_split_never_raises_and_the_id_never_contains_a_slash_unless_encoded(rollout_id: str) -> None:
    split = split_rollout_prefix("/ng-rollout/" + quote(rollout_id, safe="") + "/v1/messages")
    assert split is not None
    decoded, rest = split
    assert rest == "/v1/messages"
    assert not is_valid_rollout_id(decoded) or "/" not in decoded


@FUZZ
@given(body=st.one_of(st.binary(max_size=6000), st.text(max_size=3000).map(str.encode)))
def test_any_request_body_is_forwarded_unchanged_and_recorded(harness: Harness, body: bytes) -> None:
    status, response = harness.request(b"/ng-rollout/fuzz/v1/responses", body=body)
    assert status == 200 and response == b"{}"
    assert harness.exporter.force_flush()
    lines = (harness.root / "fuzz.capture.jsonl").read_bytes().splitlines()
    record = orjson.loads(lines[-1])
    if record["request"] is None and body:
        assert "request_raw" in record
        assert len(record["request_raw"].encode()) <= 4096 * 3  # the cap, decoded with replacement chars


@FUZZ
@given(
    chunks=st.lists(st.binary(max_size=2000), max_size=8),
    content_type=st.sampled_from(
        [b"application/json", b"text/event-stream", b"TEXT/EVENT-STREAM; charset=utf-8", b"text/plain"]
    ),
    dialect=st.sampled_from(["responses", "chat/completions", "messages"]),
)
def test_any_response_bytes_reach_the_client_unchanged_and_are_recorded(
    harness: Harness, chunks: list[bytes], content_type: bytes, dialect: str
) -> None:
    harness.reply = (200, content_type, chunks)
    status, response = harness.request(f"/ng-rollout/fuzz/v1/{dialect}".encode())
    assert status == 200 and response == b"".join(chunks)
    assert harness.exporter.force_flush()
    record = orjson.loads((harness.root / "fuzz.capture.jsonl").read_bytes().splitlines()[-1])
    assert record["status_code"] == 200
    assert record["response"] is None or isinstance(record["response"], dict)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 1_000_000 + b"]" * 1_000_000,  # 10^6-deep nesting
        b'{"model": "m", "n": ' + b"9" * 5000 + b"}",  # a huge integer
        b'{"model": "m", "input": "\xff\xfe\xfa"}',  # not UTF-8
        b"\x00" * 100_000,
    ],
    ids=["deep-nesting", "huge-int", "non-utf8", "nul-bytes"],
)
def test_pathological_request_bodies_are_kept_raw_and_forwarded(harness: Harness, body: bytes) -> None:
    status, response = harness.request(b"/ng-rollout/path/v1/chat/completions", body=body)
    assert status == 200 and response == b"{}"
    assert harness.exporter.force_flush()
    record = orjson.loads((harness.root / "path.capture.jsonl").read_bytes().splitlines()[-1])
    assert record["request"] is None
    assert record["request_raw"]
    assert record.get("truncated") is (True if len(body) > 4096 else None)


def test_a_gigantic_sse_stream_keeps_memory_bounded_and_records_the_cut(harness: Harness) -> None:
    event = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    harness.reply = (200, b"text/event-stream", [event * 100] * 200)  # ~1.9 MB, no [DONE]
    status, response = harness.request(b"/ng-rollout/huge/v1/chat/completions")
    assert status == 200 and len(response) == len(event) * 20_000
    assert harness.exporter.force_flush()
    record = orjson.loads((harness.root / "huge.capture.jsonl").read_bytes().splitlines()[-1])
    assert record["error_category"] == "stream_truncated"
    assert record["truncated"] is True
    assert len(record["response_raw"]) <= 4096
    # the reassembly is bounded by the cap too (contract D36): the events whose data fit in it, not 20,000
    content = record["response"]["choices"][0]["message"]["content"]
    data = len(event) - len(b"data: \n\n")  # each event's data: one "x"
    assert set(content) == {"x"} and 0 < len(content) <= 4096 // data + 1
