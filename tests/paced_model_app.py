"""An unmodified FastAPI model server like ``model_app`` (the same recorded bodies and streams), but slow
enough that a call's duration is real and with the failures a model server has, for the Jaeger tests:
``opentelemetry-instrument uvicorn paced_model_app:app --app-dir tests``.

- a streamed answer sends one SSE event every ``PACE_S`` seconds;
- model ``overloaded`` is answered ``503`` with an OpenAI-style error body;
- model ``cut-stream`` streams ``CUT_AFTER`` events, then the server fails and the connection is cut.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from model_app import BODIES, STREAMS

PACE_S = 0.02
CUT_AFTER = 3
OVERLOADED = "overloaded"
CUT_STREAM = "cut-stream"

app = FastAPI(title="paced recorded model server")


class ModelServerFailure(RuntimeError):
    """What the server raises mid-stream for model ``cut-stream`` (uvicorn then aborts the connection)."""


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


async def _events(raw: bytes, cut_after: int | None) -> AsyncIterator[bytes]:
    events = [event + b"\n\n" for event in raw.split(b"\n\n") if event.strip()]
    for number, event in enumerate(events):
        if cut_after is not None and number == cut_after:
            raise ModelServerFailure(f"the model server failed after {number} events")
        yield event
        await asyncio.sleep(PACE_S)  # a model generates token by token


async def _answer(dialect: str, request: Request) -> Any:
    body = await request.json()
    model = body.get("model")
    if model == OVERLOADED:
        error = {"error": {"message": "the model is overloaded", "type": "server_error", "code": None}}
        return JSONResponse(error, status_code=503)
    if body.get("stream") and dialect in STREAMS:
        cut_after = CUT_AFTER if model == CUT_STREAM else None
        return StreamingResponse(_events(STREAMS[dialect], cut_after), media_type="text/event-stream")
    await asyncio.sleep(PACE_S)  # thinking before answering in one piece
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
