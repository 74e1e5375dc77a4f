"""The capture proxy's upstream client: ``_Pool``, aiohttp's connector and response protocol without
``ClientSession``, and ``_Response``, the answer it hands back. :class:`.app.UpstreamProxy` forwards
every call over one of these pools, and sends a request again on a fresh connection when ``_stale`` says
the upstream dropped it before answering.

aiohttp's internals driven here (not its documented API; pinned by ``tests/unit/test_aiohttp_internals.py``,
and pyproject allows only the 3.x line the proxy's tests passed on): ``BaseConnector.connect(req, traces,
timeout)`` with a bare ``client_reqrep.ClientRequest`` (for its connection key), ``connector.Connection``'s
``protocol``, ``transport``, ``release`` and ``close``, the response protocol's ``set_response_params``,
``start_timeout`` and ``read``, and ``http_exceptions.HttpProcessingError`` and ``streams.EofStream``.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.streams import EofStream
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

_CONNECTIONS = 256  # open upstream connections at most (calls beyond wait for one): 64+ concurrent calls
_CONNECT_TIMEOUT = 30.0
# The upstream's response head: each header line (and the status line) up to 64 KiB, at most 128 header
# lines (aiohttp's count), so at most ~8 MiB of head per call in the worst case; a longer one gets the
# client a 502 naming the limit (``UpstreamHeadTooLarge``), never a connection kept half-read (contract D35).
MAX_HEADER_LINE_BYTES = 64 * 1024
MAX_HEADERS = 128


def _stale(exc: BaseException) -> bool:
    """The upstream closed the connection before any byte of the answer (aiohttp's error for a kept-alive
    connection the upstream closed while idle, just as the request went out); not a refused connect
    (contract D31)."""
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and not isinstance(
        exc, aiohttp.ClientConnectorError
    )


# aiohttp's read buffer for an upstream's body: reading pauses once twice this is buffered (plus the socket
# read in flight). 16 KiB rather than aiohttp's 64 KiB: a slow client's call holds less (200 slow readers
# stayed under 300 MB in 3 of 3 runs that had settled at ~296 MiB with 64 KiB), and a fast 64 MiB stream
# costs the proxy no more CPU (contract D45).
_READ_BUFFER = 16 * 1024


class UpstreamHeadTooLarge(aiohttp.ClientResponseError):
    """The upstream's status line or a header line is over ``MAX_HEADER_LINE_BYTES``: not forwarded."""


class _Pool:
    """aiohttp's connection pool and response side, without ``ClientSession``'s per-request work (header
    merging, cookies, auth, payload objects, a task to write the body): the request head and body go out
    in one write, and aiohttp's connector (the pool cap, DNS, connect timeout, TLS, idle connections checked
    before reuse), its response protocol (C parser, ``sock_read`` timeout, flow control) and its payload
    stream do the rest. The connector looks up an idle connection in O(1), unlike httpcore's pool, which
    polls every pooled connection per request. The upstream sees the client's headers and nothing of
    aiohttp's own (no ``User-Agent``, ``Accept``, ``Content-Type``), and its answer is never decoded."""

    def __init__(self, origin: URL, timeout: float, *, keep_alive: bool) -> None:
        self._connector = aiohttp.TCPConnector(
            limit=_CONNECTIONS, limit_per_host=0, force_close=not keep_alive, ttl_dns_cache=None
        )
        # the connector reads only where to connect from a request (its connection key, host, port, TLS)
        self._where = ClientRequest("GET", origin, loop=asyncio.get_running_loop())
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=min(_CONNECT_TIMEOUT, timeout), sock_read=timeout
        )
        self._read_timeout = timeout
        self._host = b"host: " + self._where.headers["Host"].encode("latin-1") + b"\r\n"
        self._close = b"" if keep_alive else b"connection: close\r\n"
        self._origin = origin

    async def send(self, method: str, target: bytes, headers: bytes, body: bytes) -> _Response:
        connection = await self._connector.connect(self._where, [], self._timeout)
        try:
            protocol = connection.protocol
            transport = connection.transport
            assert protocol is not None and transport is not None
            protocol.set_response_params(
                skip_payload=method == "HEAD",
                read_until_eof=True,  # an answer without a length ends when the upstream closes
                auto_decompress=False,  # the client gets the upstream's bytes; the record decodes its copy
                read_timeout=self._read_timeout,
                max_line_size=MAX_HEADER_LINE_BYTES,
                max_field_size=MAX_HEADER_LINE_BYTES,
                max_headers=MAX_HEADERS,
                read_bufsize=_READ_BUFFER,
            )
            request_line = method.encode("latin-1") + b" " + target + b" HTTP/1.1\r\n"
            transport.write(b"".join((request_line, self._host, headers, self._close, b"\r\n", body)))
            protocol.start_timeout()
            while True:  # 1xx interim answers (100 Continue) are skipped, as aiohttp does
                try:
                    message, payload = await protocol.read()
                except HttpProcessingError as exc:  # a malformed answer (too many headers among them)
                    # aiohttp re-raises its parser's error as a plain one, the original as its cause
                    if isinstance(exc, LineTooLong) or isinstance(exc.__cause__, LineTooLong):
                        raise UpstreamHeadTooLarge(
                            self._request_info(method, target), (), status=exc.code, message=exc.message
                        ) from exc
                    raise aiohttp.ClientResponseError(
                        self._request_info(method, target), (), status=exc.code, message=exc.message
                    ) from exc
                except EofStream:
                    raise aiohttp.ServerDisconnectedError() from None
                if not 100 <= message.code <= 199 or message.code == 101:
                    break
        except BaseException:
            connection.close()
            raise
        return _Response(connection, message.code, message.raw_headers, message.headers, payload)

    def _request_info(self, method: str, target: bytes) -> aiohttp.RequestInfo:
        url = self._origin.join(URL(target.decode("latin-1"), encoded=True))
        return aiohttp.RequestInfo(url, method, CIMultiDictProxy(CIMultiDict()), url)

    async def close(self) -> None:
        await self._connector.close()


class _Response:
    """The upstream's answer: status, headers, body stream, and its connection (released to the pool
    once the body is read to its end, else closed)."""

    __slots__ = ("_connection", "content", "headers", "raw_headers", "status")

    def __init__(
        self,
        connection: Connection,
        status: int,
        raw_headers: tuple[tuple[bytes, bytes], ...],
        headers: CIMultiDictProxy[str],
        content: aiohttp.StreamReader,
    ) -> None:
        self._connection = connection
        self.status = status
        self.raw_headers = raw_headers
        self.headers = headers
        self.content = content

    def release(self) -> None:
        self._connection.release()

    def close(self) -> None:
        self._connection.close()
