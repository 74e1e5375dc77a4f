"""Test support: a real uvicorn server on 127.0.0.1 (port 0) in a thread, a replaying model server
built from real recorded API bodies and streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson
import uvicorn
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_capture import CaptureStore, ModelCallRecord, read_model_call_records
from otel_capture._capture import LoopWaiter
from otel_capture._dialects.table import Dialect
from otel_capture._proxy import bind_socket, socket_url
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

REPO = Path(__file__).resolve().parents[1]
FIXTURES_ROOT = Path(__file__).resolve().parent / "fixtures"  # every test fixture; sources in its README.md
RECORDED = FIXTURES_ROOT / "recorded_streams"
FIXTURES = FIXTURES_ROOT / "nemo_gym"


_waiter_loop: asyncio.AbstractEventLoop | None = None
_waiter_loop_lock = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    global _waiter_loop
    with _waiter_loop_lock:
        if _waiter_loop is None:
            _waiter_loop = asyncio.new_event_loop()
            threading.Thread(target=_waiter_loop.run_forever, name="test-waiters", daemon=True).start()
        return _waiter_loop


def submit(
    writer: Any,
    rollout_id: str,
    line: bytes,
    model_call_id: str,
    tokens_line: bytes | None = None,
    *,
    weight: tuple[str | None, float | None, float | None] | None = None,
) -> concurrent.futures.Future[None]:
    """Hand one line to a ``JsonlWriter`` as the middleware does (its one completion route: a
    ``LoopWaiter``, here on a test-wide event loop in a thread), from a test's plain thread: the line is
    queued before this returns, and the returned future follows the waiter (``.result(timeout)``)."""
    loop = _loop()
    waiter = LoopWaiter(loop, loop.create_future())
    writer.submit(rollout_id, line, model_call_id, tokens_line, waiter, weight=weight)

    async def wait() -> None:
        await waiter.future

    return asyncio.run_coroutine_threadsafe(wait(), loop)


def _anthropic_cassette_body() -> bytes:
    path = (
        RECORDED
        / "anthropic-sdk-python/http_cassettes/test_messages__TestSyncParse__c11eefc7-fff0-4466-8453-42eef73b8876.json"
    )
    return json.dumps(json.loads(path.read_text())[0]["response"]["body"]).encode()


def recorded_json(dialect: str) -> bytes:
    """A real non-streaming response body of each dialect (compact, as servers send them); for
    ``completions``, vLLM's shape (``fixtures/vllm``: built from its definitions, not recorded)."""
    if dialect == "messages":
        return _anthropic_cassette_body()
    if dialect == "completions":
        return json.dumps(
            json.loads((FIXTURES_ROOT / "vllm/completions_return_token_ids.json").read_text())
        ).encode()
    name = {
        "responses": "openai-python/responses_json/output_text.json",
        "chat": "openai-python/chat_completions_json/parse_nothing.json",
    }[dialect]
    return json.dumps(json.loads((RECORDED / name).read_text())).encode()


class Gate:
    """Holds the replaying upstream at a point of its stream until the test opens it, from any thread.

    ``reached`` is set once the upstream is waiting at the gate (everything before it has been sent)."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._opened = False
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def is_open(self) -> bool:
        return self._opened

    def open(self) -> None:
        with self._lock:
            self._opened = True
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that server's loop is already closed
                loop.call_soon_threadsafe(event.set)

    async def wait(self) -> None:
        event = asyncio.Event()
        with self._lock:
            if self._opened:
                return
            self._waiters.append((asyncio.get_running_loop(), event))
        self.reached.set()
        await event.wait()


class UpstreamFailure(RuntimeError):
    """What the replaying upstream raises mid-stream when told to (uvicorn then aborts the connection)."""


@dataclass
class Reply:
    status: int = 200
    content_type: str = "application/json"
    chunks: list[bytes] = field(default_factory=list)
    hang_after: int | None = None  # stop sending (but keep the connection) after this many chunks
    raise_after: int | None = None  # raise UpstreamFailure after this many chunks: the connection is cut
    gate: Gate | None = None  # wait at this gate ...
    gate_after: int = 1  # ... after this many chunks


async def serve_lifespan(receive: Any, send: Any) -> None:
    """Answer an ASGI lifespan scope: startup complete, then shutdown complete."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        else:
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive: Any) -> bytes:
    """A request's whole body, read message by message (empty when the client left first)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


class ReplayModelServer:
    """An ASGI model server that answers the four dialects with recorded bodies or SSE chunks.

    Tests set ``replies[dialect]`` to change what a dialect answers; ``seen`` lists (method, path, body),
    ``headers_seen`` the headers of each.

    Like a real server (Starlette's ``StreamingResponse``), it listens for ``http.disconnect`` while it
    streams and stops streaming when the client has gone (uvicorn does not cancel the app; it only delivers
    the disconnect on ``receive()``). ``outcomes`` lists how each dialect call ended: ``"complete"``,
    ``"disconnected"`` or ``"raised"``; ``finished`` is set (and cleared by the test) after each one."""

    def __init__(self) -> None:
        self.replies: dict[str, Reply] = {
            d: Reply(chunks=[recorded_json(d)]) for d in ("responses", "chat", "messages", "completions")
        }
        self.seen: list[tuple[str, str, bytes]] = []
        self.headers_seen: list[dict[str, str]] = []  # each request's headers, by lower-case name
        self.chunk_delay = 0.0
        self.outcomes: list[str] = []
        self.finished = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        body = await read_body(receive)
        # the path it routes, as an ASGI app mounted at root_path does (the capture puts the prefix there)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        self.seen.append((scope["method"], path, body))
        self.headers_seen.append({k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
        dialect = {
            "/v1/responses": "responses",
            "/v1/chat/completions": "chat",
            "/v1/messages": "messages",
            "/v1/completions": "completions",
        }.get(_with_v1(path.rstrip("/")))
        if dialect is None or scope["method"] != "POST":
            payload = json.dumps({"path": path, "method": scope["method"]}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        outcome = "raised"
        try:
            outcome = await self._reply(self.replies[dialect], receive, send)
        finally:
            self.outcomes.append(outcome)
            self.finished.set()

    async def _reply(self, reply: Reply, receive: Any, send: Any) -> str:
        streaming = asyncio.ensure_future(self._stream(reply, send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watcher):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        if streaming in done:
            streaming.result()  # re-raises what the stream raised
            return "complete"
        return "disconnected"

    async def _stream(self, reply: Reply, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [(b"content-type", reply.content_type.encode())],
            }
        )
        for i, chunk in enumerate(reply.chunks):
            if reply.hang_after is not None and i >= reply.hang_after:
                await asyncio.Event().wait()  # hang until the client goes away
            if reply.raise_after is not None and i >= reply.raise_after:
                raise UpstreamFailure(f"the model server failed after {i} chunks")
            if reply.gate is not None and i == reply.gate_after:
                await reply.gate.wait()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
        if reply.raise_after is not None and reply.raise_after >= len(reply.chunks):
            raise UpstreamFailure("the model server failed before the end of its body")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _with_v1(path: str) -> str:
    """The dialect path of a route served without ``/v1`` too (as vLLM's and llama.cpp's are)."""
    return path if path.startswith("/v1/") else "/v1" + path


async def _wait_for_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.contextmanager
def serve(app: Any, **config: Any) -> Iterator[str]:
    """Serve ``app`` with a real uvicorn on 127.0.0.1, a free port; yields its base URL. ``config`` goes to
    ``uvicorn.Config`` (e.g. ``timeout_keep_alive``)."""
    sock = bind_socket("127.0.0.1", 0)
    options: dict[str, Any] = {"lifespan": "auto", "log_level": "warning", "access_log": False, **config}
    server = uvicorn.Server(uvicorn.Config(app, **options))
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


def metric_points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    """Every data point of the metric ``name`` the reader has collected so far."""
    data = reader.get_metrics_data()
    assert data is not None
    return [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server that must be told its port (Jaeger, Phoenix)."""
    sock = bind_socket("127.0.0.1", 0)
    port: int = sock.getsockname()[1]
    sock.close()
    return port


def rollout_client(url: str, rollout_id: str, *, timeout: float) -> openai.OpenAI:
    """The official openai SDK calling the server at ``url`` with the rollout id in the path
    (``/ng-rollout/<rollout_id>/v1``, as NeMo Gym calls it); no retries, so a failed call fails the test."""
    return openai.OpenAI(
        base_url=f"{url}/ng-rollout/{rollout_id}/v1", api_key="k", max_retries=0, timeout=timeout
    )


def call_and_tokens(store: CaptureStore, rollout_id: str) -> tuple[ModelCallRecord, dict[str, Any] | None]:
    """The rollout's one record and its tokens line (None where it has none), the line checked to name that
    record's call."""
    (record,) = read_model_call_records(store, rollout_id)
    raw = store.read_token_lines(rollout_id)
    if raw is None:
        return record, None
    (line,) = raw.lines
    tokens: dict[str, Any] = json.loads(line)
    assert tokens["model_call_id"] == record.model_call_id
    return record, tokens


def recorded_streams() -> list[tuple[str, Dialect, bytes]]:
    """Every recorded stream as (name, dialect, raw bytes): the SSE files and the SSE bodies inside the
    Anthropic HTTP cassettes."""
    found: list[tuple[str, Dialect, bytes]] = []
    for path in sorted((RECORDED / "openai-python" / "chat_completions_sse").glob("*.sse")):
        found.append((path.name, "chat", path.read_bytes()))
    for path in sorted((RECORDED / "third_party_swiftagent" / "responses_sse").glob("*.sse")):
        found.append((path.name, "responses", path.read_bytes()))
    for path in sorted((RECORDED / "anthropic-sdk-python").glob("messages_sse*/*.sse")):
        found.append((f"{path.parent.name}/{path.name}", "messages", path.read_bytes()))
    for path in sorted((RECORDED / "anthropic-sdk-python" / "http_cassettes").glob("*.json")):
        for number, exchange in enumerate(json.loads(path.read_text())):
            response = exchange["response"]
            if response["headers"].get("content-type", "").startswith("text/event-stream"):
                found.append((f"{path.stem}#{number}", "messages", response["body"].encode()))
    return found


def sse_chunks(raw: bytes) -> list[bytes]:
    """``raw`` cut after each blank line (one SSE event per chunk, as servers flush them); the chunks
    join back to exactly ``raw``."""
    chunks: list[bytes] = []
    start = 0
    while start < len(raw):
        end = raw.find(b"\n\n", start)
        end = len(raw) if end < 0 else end + 2
        chunks.append(raw[start:end])
        start = end
    return chunks


@dataclass
class Telemetry:
    provider: TracerProvider
    spans: InMemorySpanExporter
    jsonl: ModelCallJsonlExporter
    store: CaptureStore


def run_child(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS...`` with this checkout importable, waited for (60 s at most, so reaped): how a
    crash test runs a child that SIGKILLs itself at a chosen point; the caller checks its return code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def start_cli_proxy(
    upstream: str,
    *args: str,
    env: dict[str, str] | None = None,
    stderr: int | None = subprocess.DEVNULL,
    wrap: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[str], str]:
    """``otel-capture proxy --upstream UPSTREAM ARGS...`` in its own process, as a user runs it; returns the
    process and the URL from its first line of output. ``wrap`` runs it under a command (``strace ...``)."""
    process = subprocess.Popen(
        [*wrap, sys.executable, "-m", "otel_capture._cli.main", "proxy", "--upstream", upstream, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    first = process.stdout.readline().strip()
    assert first.startswith("listening on http://127.0.0.1:"), first
    return process, first.removeprefix("listening on ")


def gym_style_read(path: Path) -> int:
    """NeMo Gym 0.7.0's reader: shared flock on the data file, one JSON object per line; the number of
    lines (0 for a missing file). Raises on an interleaved or torn line."""
    if not path.exists():
        return 0
    count = 0
    with path.open("rb") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_SH)
        try:
            for line in handle:
                if line.strip():
                    assert isinstance(orjson.loads(line), dict)
                    count += 1
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return count


def exhaust_inodes(disk: Path) -> list[Path]:
    """Empty files made in ``disk/filler`` until the filesystem has no inode left (ENOSPC); the new ones."""
    folder = disk / "filler"
    folder.mkdir(exist_ok=True)
    made: list[Path] = []
    start = len(list(folder.iterdir()))
    while True:
        path = folder / str(start + len(made))
        try:
            path.touch()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            return made
        made.append(path)
