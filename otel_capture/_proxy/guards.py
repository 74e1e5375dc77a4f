"""The capture proxy's request-size limit and its limit on calls at once (:class:`CallLimit`)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import socket
import time
from collections.abc import Callable

from .._asgi import ASGIApp, Message, Receive, Scope, Send, send_json
from .._records.schema import REFUSED_OVER_CAPACITY

_logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a call refused for capacity is told to wait: calls end and free their place often
_REFUSAL_LOG_INTERVAL_S = 60.0
_TRIM_DELAY_S = 1.0  # idle this long after the last call: the allocator gives freed memory back


class RequestSizeLimit:
    """Answers ``413`` to a request whose body is over ``max_bytes``: at once when its Content-Length says
    so, else as soon as the bytes read pass the limit (a chunked body), so an oversized body never sits in
    memory. Below it the app reads the body it would have read (contract D32)."""

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
        payload = {
            "error": {
                "type": "request_too_large",
                "message": (
                    f"the request body is over this proxy's limit of {self.max_bytes} bytes "
                    "(otel-capture proxy --max-request-bytes, OTEL_CAPTURE_MAX_REQUEST_BYTES)"
                ),
                "limit_bytes": self.max_bytes,
            }
        }
        await send_json(send, 413, payload)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"content-length":
            text = bytes(value).strip()
            return int(text) if text.isdigit() else None
    return None


class CallLimit:
    """At most ``max_calls`` calls forwarded at once; :meth:`enter` says whether one more may go. What each
    call holds is bounded (the relay's buffers and the record's copy of what the client was sent, up to the
    body cap), so this bounds the proxy's memory under clients that read slowly or not at all. Refusals are
    counted (``refused``) and logged the first time, then at most once a minute with their number
    (contract D34).

    When the last call ends, memory freed by the calls goes back to the system (``malloc_trim``, glibc):
    the many mid-sized buffers a burst of streams leaves behind are otherwise kept by the allocator and the
    process stays at its peak (contract D33)."""

    def __init__(self, max_calls: int) -> None:
        self.max_calls = max_calls
        self.active = 0
        self.refused = 0
        self._logged_refusals = 0
        self._next_log = 0.0
        self._trim: asyncio.TimerHandle | None = None

    def enter(self) -> bool:
        if self.active >= self.max_calls:
            self.refused += 1
            now = time.monotonic()
            if now >= self._next_log:
                self._next_log = now + _REFUSAL_LOG_INTERVAL_S
                _logger.warning(
                    "%d call(s) refused with 503: %d already in flight (--max-concurrent-calls, %s)",
                    self.refused - self._logged_refusals,
                    self.active,
                    "OTEL_CAPTURE_MAX_CONCURRENT_CALLS",
                )
                self._logged_refusals = self.refused
            return False
        self.active += 1
        return True

    def leave(self) -> None:
        self.active -= 1
        if not self.active and self._trim is None and _MALLOC_TRIM is not None:
            # not at once: a lone call ending between two others does not pay for a trim each time
            self._trim = asyncio.get_running_loop().call_later(_TRIM_DELAY_S, self._trim_if_idle)

    def _trim_if_idle(self) -> None:
        self._trim = None
        if not self.active and _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)

    async def refuse(self, send: Send) -> None:
        payload = {
            "error": {
                "type": REFUSED_OVER_CAPACITY,
                "message": (
                    f"this proxy forwards at most {self.max_calls} calls at once; retry after "
                    f"{RETRY_AFTER_S} s (otel-capture proxy --max-concurrent-calls, "
                    "OTEL_CAPTURE_MAX_CONCURRENT_CALLS)"
                ),
                "limit_calls": self.max_calls,
            }
        }
        await send_json(send, 503, payload, [(b"retry-after", str(RETRY_AFTER_S).encode())])


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where there is none (musl, macOS): memory is then left to the
    allocator."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


# The kernel's send buffer for each client connection (accepted sockets inherit it from the listening one):
# fixed instead of autotuned up to net.ipv4.tcp_wmem's maximum (4 MiB), so a client that stops reading holds
# at most this much sent-but-unread in the proxy's kernel, and the proxy's writes then wait (uvicorn's
# flow control, which pauses the relay and so the upstream read). 64 KiB (the kernel doubles it): what the
# proxy holds per slow client is mostly the record's copy of what this buffer took, 0.8 MiB less per
# client than at 256 KiB (200 slow readers: 209 MiB against 372 MiB of RSS), and a 64 MiB stream relays no
# slower (the proxy's own CPU, ~20 MiB/s, is the bound on loopback; a model stream is far slower than even
# a WAN round trip's worth of this). (contract D33, D45)
CLIENT_SEND_BUFFER = 64 * 1024


def limit_client_buffers(sock: socket.socket) -> socket.socket:
    """Fix the send buffer of the connections ``sock`` will accept to :data:`CLIENT_SEND_BUFFER`."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CLIENT_SEND_BUFFER)
    return sock
