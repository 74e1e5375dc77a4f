"""Test support: a real uvicorn server on 127.0.0.1 (port 0) in a thread, a replaying model server
built from real recorded API bodies and streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exporters.model_call_jsonl import ModelCallJsonlExporter
from otel_capture import CaptureStore
from otel_capture._proxy import bind_socket, socket_url

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
RECORDED = SHARED / "recorded_streams"
FIXTURES = SHARED / "fixtures" / "nemo_gym"


def _anthropic_cassette_body() -> bytes:
    path = RECORDED / "anthropic-sdk-python/http_cassettes/test_messages__TestSyncParse__c11eefc7-fff0-4466-8453-42eef73b8876.json"
    return json.dumps(json.loads(path.read_text())[0]["response"]["body"]).encode()


def recorded_json(dialect: str) -> bytes:
    """A real non-streaming response body of each dialect (compact, as servers send them)."""
    if dialect == "messages":
        return _anthropic_cassette_body()
    name = {
        "responses": "openai-python/responses_json/output_text.json",
        "chat": "openai-python/chat_completions_json/parse_nothing.json",
    }[dialect]
    return json.dumps(json.loads((RECORDED / name).read_text())).encode()


@dataclass
class Reply:
    status: int = 200
    content_type: str = "application/json"
    chunks: list[bytes] = field(default_factory=list)
    hang_after: int | None = None  # stop sending (but keep the connection) after this many chunks


class ReplayModelServer:
    """An ASGI model server that answers the three dialects with recorded bodies or SSE chunks.

    Tests set ``replies[dialect]`` to change what a dialect answers; ``seen`` lists (method, path, body)."""

    def __init__(self) -> None:
        self.replies: dict[str, Reply] = {
            d: Reply(chunks=[recorded_json(d)]) for d in ("responses", "chat", "messages")
        }
        self.seen: list[tuple[str, str, bytes]] = []
        self.chunk_delay = 0.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope["method"], scope["path"], body))
        dialect = {"/v1/responses": "responses", "/v1/chat/completions": "chat", "/v1/messages": "messages"}.get(
            scope["path"].rstrip("/")
        )
        if dialect is None or scope["method"] != "POST":
            payload = json.dumps({"path": scope["path"], "method": scope["method"]}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload})
            return
        reply = self.replies[dialect]
        await send({
            "type": "http.response.start",
            "status": reply.status,
            "headers": [(b"content-type", reply.content_type.encode())],
        })
        for i, chunk in enumerate(reply.chunks):
            if reply.hang_after is not None and i >= reply.hang_after:
                await asyncio.Event().wait()  # hang until the client goes away (cancelled by the server)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve ``app`` with a real uvicorn on 127.0.0.1, a free port; yields its base URL."""
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="auto", log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    started = threading.Event()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("test server failed to start")
        started.wait(0.005)
    try:
        yield socket_url(sock)
    finally:
        server.should_exit = True
        thread.join(10)


