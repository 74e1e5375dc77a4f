"""The capture proxy's request-size limit, and :func:`redact_query`, the query string the HTTP server span
is shown (every value ``REDACTED``, so ``?api_key=...`` never reaches a span).
"""

from __future__ import annotations

import logging

import orjson

from ._asgi import ASGIApp, Message, Receive, Scope, Send

_logger = logging.getLogger(__name__)


def redact_query(query: bytes) -> bytes:
    """``a=1&key=sk-x&flag`` -> ``a=REDACTED&key=REDACTED&flag``."""
    parts = []
    for part in query.split(b"&"):
        name, sep, _value = part.partition(b"=")
        parts.append(name + b"=REDACTED" if sep else part)
    return b"&".join(parts)


class RequestSizeLimit:
    """Answers ``413`` to a request whose body is over ``max_bytes``: at once when its Content-Length says
    so, else as soon as the bytes read pass the limit (a chunked body), so an oversized body never sits in
    memory. Below it the app reads the body it would have read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(send)  # not read: uvicorn discards the rest of the body as it arrives
                return
            # The server delivers exactly the declared bytes (the rest of the stream is the next request),
            # so a body within its Content-Length is within the limit: nothing to count or hold.
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left: the app below sees it as it would have
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = orjson.dumps(
            {
                "error": {
                    "type": "request_too_large",
                    "message": (
                        f"the request body is over this proxy's limit of {self.max_bytes} bytes "
                        "(otel-capture proxy --max-request-bytes, OTEL_CAPTURE_MAX_REQUEST_BYTES)"
                    ),
                    "limit_bytes": self.max_bytes,
                }
            }
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length":
            text = bytes(value).strip()
            return int(text) if text.isdigit() else None
    return None
