"""The ASGI types the middleware, the proxy and the instrumentor share (the ASGI spec's, spelled out), and
the one JSON response they answer with when they refuse a request or its upstream fails."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_json(
    send: Send, status: int, payload: Mapping[str, Any], headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Answer with ``payload`` as a whole JSON body: ``status``, ``content-type: application/json``, its
    ``content-length`` and ``headers`` after them."""
    body = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
