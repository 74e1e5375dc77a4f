"""An unmodified FastAPI model server (it knows nothing of OpenTelemetry or otel-capture), for the
zero-code tests: ``opentelemetry-instrument uvicorn model_app:app --app-dir tests``.

It answers the three dialects with real recorded API bodies and streams (``tests/fixtures/recorded_streams``),
streamed when the request says ``"stream": true``, one SSE event per chunk, as a real server flushes them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

RECORDED = Path(__file__).resolve().parent / "fixtures" / "recorded_streams"  # support.RECORDED; no import
_CASSETTE = "test_messages__TestSyncParse__c11eefc7-fff0-4466-8453-42eef73b8876.json"

BODIES: dict[str, Any] = {
    "responses": json.loads((RECORDED / "openai-python/responses_json/output_text.json").read_text()),
    "chat": json.loads((RECORDED / "openai-python/chat_completions_json/parse_nothing.json").read_text()),
    "messages": json.loads((RECORDED / "anthropic-sdk-python/http_cassettes" / _CASSETTE).read_text())[0][
        "response"
    ]["body"],
}
STREAMS: dict[str, bytes] = {
    "chat": (RECORDED / "openai-python/chat_completions_sse/parse_nothing.e2aad469b71d.sse").read_bytes(),
    "messages": (RECORDED / "anthropic-sdk-python/messages_sse/basic_response.sse").read_bytes(),
}

app = FastAPI(title="recorded model server")


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


async def _events(raw: bytes) -> AsyncIterator[bytes]:
    for event in raw.split(b"\n\n"):
        if event.strip():
            yield event + b"\n\n"
            await asyncio.sleep(0.002)  # a model generates token by token


async def _answer(dialect: str, request: Request) -> Any:
    body = await request.json()
    if body.get("stream") and dialect in STREAMS:
        return StreamingResponse(_events(STREAMS[dialect]), media_type="text/event-stream")
    return JSONResponse(BODIES[dialect])


@app.post("/v1/chat/completions")
async def chat(request: Request) -> Any:
    return await _answer("chat", request)


@app.post("/v1/responses")
async def responses(request: Request) -> Any:
    return await _answer("responses", request)


@app.post("/v1/messages")
async def messages(request: Request) -> Any:
    return await _answer("messages", request)
