"""Floors: the least a capture and a forwarding proxy can cost on this stack, served by ``bench._servers``
(variants ``floor``, ``floor-onloop``, ``floor-forward``, ``floor-raw``) beside the goals of ``bench_goals``.

Nothing here is the product: each piece does only what any implementation must do per call, so its cost
next to the app's is the ceiling any capture (goals 1 and 2) or any Python proxy (goal 3) reaches here.

* :class:`FloorCapture` (goals 1 and 2): a pure ASGI middleware that takes the rollout id from the
  ``/ng-rollout/<id>/`` prefix (and strips it, so the app's routes match), keeps the request and response
  bodies as they pass (``receive`` and ``send`` wrapped), builds one JSON line (``orjson.dumps`` of a small
  dict, both bodies as ``orjson.Fragment``: no parsing of either; an SSE answer, not JSON, as one string) at
  the last body message and, durable, hands it to :class:`FloorWriter`'s thread and holds that last
  message until the line is on disk, as the capture does; ``on_loop``: writes the line on the event loop
  instead, no thread, no fsync (the absolute floor: no durability at all).
* :class:`FloorWriter`: one writer thread, group commit: it takes every line queued, appends each rollout's
  lines to its ``<rollout>.capture.jsonl`` in one ``write``, makes the batch durable with one ``syncfs``
  (two files or more, as the capture's writer does on a local filesystem) or one ``fsync``, then resolves
  the batch's futures with one ``call_soon_threadsafe``. No in-flight markers, no failure handling.
* :class:`FloorForwarder` (goal 3): a pure ASGI app that reads the request body, sends the request over the
  proxy's own upstream pool (``_Pool``: aiohttp's connector and response parser, kept-alive connections),
  reads the answer whole and sends it back in one body message. No capture, no span, no client watch, no
  streaming relay, no retry.
* :func:`serve_raw_forwarder` (goal 3, no ASGI, no uvicorn): uvloop protocols with httptools' parsers; a
  client connection's request is rebuilt (hop-by-hop headers out, ``host`` and ``content-length`` set),
  sent on an idle kept-alive upstream connection, and the parsed answer written back in one piece.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from otel_capture._store.libc import name_native_thread

PREFIX = "/ng-rollout/"
_HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
)
_REQUEST_DROP = _HOP_BY_HOP | {b"host", b"content-length"}
_RESPONSE_DROP = _HOP_BY_HOP | {b"content-length"}  # the raw forwarder sets its own
_STATS_ZERO = {"records": 0, "fsyncs": 0, "batches": 0, "failures": 0}


# --- goals 1 and 2: the barest durable capture --------------------------------------------------------


def _libc_syncfs() -> Callable[[int], None] | None:
    function = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
    if function is None:
        return None

    def syncfs(fd: int) -> None:
        if function(fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))

    return syncfs


class FloorWriter:
    """Appends lines to ``<directory>/<rollout>.capture.jsonl``: on the writer thread, a batch at a time
    (:meth:`submit`), or at once on the caller's thread without fsync (:meth:`write_now`)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fds: dict[str, int] = {}
        self._queue: queue.SimpleQueue[tuple[str, bytes, asyncio.Future[None]] | None] = queue.SimpleQueue()
        self._syncfs = _libc_syncfs()
        self.records = self.fsyncs = self.batches = 0
        self.sync_ns = 0  # wall time the thread spent in syncfs/fsync: the disk's latency, not CPU
        self._thread: threading.Thread | None = None

    def stats(self) -> dict[str, int]:
        return {
            "records": self.records,
            "fsyncs": self.fsyncs,
            "batches": self.batches,
            "failures": 0,
            "sync_ns": self.sync_ns,
        }

    def _fd(self, rollout: str) -> int:
        fd = self._fds.get(rollout)
        if fd is None:
            fd = os.open(
                self.directory / f"{rollout}.capture.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
            )
            directory = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(directory)  # the new file's entry is durable too (once per file)
            finally:
                os.close(directory)
            self._fds[rollout] = fd
        return fd

    def write_now(self, rollout: str, line: bytes) -> None:
        """The line appended on this thread, no fsync."""
        os.write(self._fd(rollout), line)
        self.records += 1

    def submit(self, rollout: str, line: bytes) -> asyncio.Future[None]:
        """The line queued for the writer thread; the future is done once it is durable."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="floor-writer", daemon=True)
            self._thread.start()
        future = asyncio.get_running_loop().create_future()
        self._queue.put((rollout, line, future))
        return future

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _run(self) -> None:
        name_native_thread("floor-writer")  # named in the kernel too, as the capture's writer is
        get, get_nowait = self._queue.get, self._queue.get_nowait
        while True:
            item = get()
            if item is None:
                return
            batch = [item]
            try:
                while True:
                    more = get_nowait()
                    if more is None:
                        self._queue.put(None)  # ends the loop after this batch
                        break
                    batch.append(more)
            except queue.Empty:
                pass
            by_rollout: dict[str, list[bytes]] = {}
            for rollout, line, _ in batch:
                by_rollout.setdefault(rollout, []).append(line)
            fds = [self._fd(rollout) for rollout in by_rollout]
            for fd, lines in zip(fds, by_rollout.values(), strict=True):
                os.write(fd, b"".join(lines))
            t0 = time.perf_counter_ns()
            if len(fds) >= 2 and self._syncfs is not None:
                self._syncfs(fds[0])
            else:
                for fd in fds:
                    os.fsync(fd)
            self.sync_ns += time.perf_counter_ns() - t0
            self.fsyncs += 1
            self.batches += 1
            self.records += len(batch)
            futures = [future for _, _, future in batch]
            futures[0].get_loop().call_soon_threadsafe(_resolve, futures)


def _resolve(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


class FloorCapture:
    """The barest durable capture around ``app`` (a 10-line ``__call__``; per-call state in
    :class:`_FloorCall`). Requests without the rollout prefix (``prefix``), and lifespan, pass through."""

    def __init__(self, app: Any, writer: FloorWriter, *, on_loop: bool = False, prefix: str = PREFIX) -> None:
        self.app = app
        self.writer = writer
        self.on_loop = on_loop
        self.prefix = prefix  # another than the capture's when both run in one server (bench_vllm --floor)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        prefix = self.prefix
        if not path.startswith(prefix):
            await self.app(scope, receive, send)
            return
        rollout, _, rest = path[len(prefix) :].partition("/")
        scope["path"] = "/" + rest  # the app's routes see the path without the prefix
        call = _FloorCall(self, rollout, receive, send)
        await self.app(scope, call.receive, call.send)


class _FloorCall:
    __slots__ = (
        "_receive",
        "_send",
        "capture",
        "request",
        "response",
        "rollout",
        "started",
        "status",
        "stream",
    )

    def __init__(self, capture: FloorCapture, rollout: str, receive: Any, send: Any) -> None:
        self.capture = capture
        self.rollout = rollout
        self._receive = receive
        self._send = send
        self.request: list[bytes] = []
        self.response: list[bytes] = []
        self.started = time.time()
        self.status = 0
        self.stream = False  # an SSE answer: not JSON, kept as one string (the least a line can hold it as)

    async def receive(self) -> Any:
        message = await self._receive()
        if message["type"] == "http.request":
            self.request.append(message.get("body", b""))
        return message

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.stream = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message.get("headers", ())
            )
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                self.response.append(body)
            if not message.get("more_body", False):
                line = orjson.dumps(
                    {
                        "rollout_id": self.rollout,
                        "started_at": self.started,
                        "completed_at": time.time(),
                        "status": self.status,
                        "request": orjson.Fragment(b"".join(self.request)),
                        "response": b"".join(self.response).decode("utf-8", "replace")
                        if self.stream
                        else orjson.Fragment(b"".join(self.response)),
                    },
                    option=orjson.OPT_APPEND_NEWLINE,
                )
                if self.capture.on_loop:
                    self.capture.writer.write_now(self.rollout, line)
                else:
                    await self.capture.writer.submit(self.rollout, line)  # the last chunk waits for the disk
        await self._send(message)


# --- goal 3: the barest forwarding ---------------------------------------------------------------------


class FloorForwarder:
    """Forwards each HTTP request to ``upstream`` over the proxy's own pool; nothing else."""

    def __init__(self, upstream: str) -> None:
        from yarl import URL

        self._origin = URL(upstream.rstrip("/")).origin()
        self._pool: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._pool is not None:
                        await self._pool.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if self._pool is None:
            from otel_capture._proxy.pool import _Pool

            self._pool = _Pool(self._origin, 60.0, keep_alive=True)
        lines = [k + b": " + v + b"\r\n" for k, v in scope["headers"] if k.lower() not in _REQUEST_DROP]
        lines.append(b"content-length: %d\r\n" % len(body))
        response = await self._pool.send(scope["method"], scope["raw_path"], b"".join(lines), body)
        try:
            answer = await response.content.read()
        except BaseException:
            response.close()
            raise
        response.release()
        headers = [(k, v) for k, v in response.raw_headers if k.lower() not in _HOP_BY_HOP]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})


class _UpstreamConnection(asyncio.Protocol):
    """One kept-alive connection to the upstream, one exchange at a time (httptools' response parser)."""

    def __init__(self, idle: list[_UpstreamConnection]) -> None:
        import httptools

        self._idle = idle
        self._parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.client: _ClientConnection | None = None
        self._reason = b""
        self._head: list[bytes] = []
        self._body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self._idle:
            self._idle.remove(self)
        if self.client is not None:
            self.client.transport.close()

    def exchange(self, request: bytes, client: _ClientConnection) -> None:
        self.client = client
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _RESPONSE_DROP:
            self._head.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        status = b"HTTP/1.1 %d %s\r\n" % (self._parser.get_status_code(), self._reason)
        answer = b"".join((status, *self._head, b"content-length: %d\r\n\r\n" % len(body), body))
        client, self.client = self.client, None
        self._reason, self._head, self._body = b"", [], []
        self._idle.append(self)
        if client is not None:
            client.answer(answer)


class _ClientConnection(asyncio.Protocol):
    """One client connection: a request parsed (httptools), rebuilt, and sent upstream."""

    def __init__(self, upstream: tuple[str, int], idle: list[_UpstreamConnection]) -> None:
        import httptools

        self._upstream = upstream
        self._host = b"host: %s:%d\r\n" % (upstream[0].encode(), upstream[1])
        self._idle = idle
        self._parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self._url = b""
        self._head: list[bytes] = []
        self._body: list[bytes] = []
        self._keep_alive = True

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _REQUEST_DROP:
            self._head.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        method, url = self._parser.get_method(), self._url
        self._keep_alive = self._parser.should_keep_alive()
        head = self._head
        self._url, self._head, self._body = b"", [], []
        if url == b"/_bench/stats":  # the benchmark's counters: nothing is recorded here
            stats = orjson.dumps(_STATS_ZERO)
            self.answer(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(stats), stats)
            )
            return
        request = b"".join(
            (
                method,
                b" ",
                url,
                b" HTTP/1.1\r\n",
                self._host,
                *head,
                b"content-length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        if self._idle:
            self._idle.pop().exchange(request, self)
        else:
            asyncio.get_running_loop().create_task(self._connect_and_send(request))

    async def _connect_and_send(self, request: bytes) -> None:
        idle = self._idle
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: _UpstreamConnection(idle), *self._upstream
        )
        connection.exchange(request, self)

    def answer(self, data: bytes) -> None:
        self.transport.write(data)
        if not self._keep_alive:
            self.transport.close()


def serve_raw_forwarder(upstream: str, sock: Any) -> None:
    """Serve the raw forwarder on ``sock`` (bound and listening) until SIGTERM or SIGINT."""
    import signal
    from urllib.parse import urlsplit

    import uvloop

    where = urlsplit(upstream)
    target = (where.hostname or "127.0.0.1", where.port or 80)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _resolve, [stop])
        idle: list[_UpstreamConnection] = []
        server = await loop.create_server(lambda: _ClientConnection(target, idle), sock=sock)
        await stop
        server.close()

    uvloop.run(main())
