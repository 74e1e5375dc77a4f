"""Odd upstreams and clients that leave: the capture proxy in front of real servers that hang, hold a
stream open after its last event, compress whatever ``Accept-Encoding`` says, or close idle keep-alive
connections; and clients that go away before the upstream answers. Every call ends, reaches the client
as the upstream sent it, and is recorded as it was."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import signal
import socket
import socketserver
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import brotli
import httpx
import pytest
from support import (
    RECORDED,
    Gate,
    ReplayModelServer,
    Telemetry,
    read_body,
    recorded_json,
    serve,
    serve_lifespan,
    sse_chunks,
    start_cli_proxy,
)

from otel_capture import (
    CaptureSettings,
    CaptureStore,
    ModelCallRecord,
    ProxySettings,
    read_model_call_records,
    start_proxy,
)

PATHS = {"chat": "chat/completions", "responses": "responses", "messages": "messages"}
STREAMS = {
    "chat": RECORDED / "openai-python/chat_completions_sse/parse_nothing.e2aad469b71d.sse",
    "responses": RECORDED / "third_party_swiftagent/responses_sse/streamingtext__helloworldresponse.sse",
    "messages": RECORDED / "anthropic-sdk-python/messages_sse/basic_response.sse",
}
BOUND = 60  # seconds: only ever a bound on "does not hang", never a measured time


class SilentUpstream:
    """Reads the request, then never answers. ``reached`` is set once a request is in; ``gone`` once its
    client (the proxy) has closed the connection."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.gone = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        await read_body(receive)
        self.reached.set()
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone.set()


class _Compressor:
    """One streaming compressor, flushed after each piece so every SSE event leaves at once."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._gzip = zlib.compressobj(wbits=31) if encoding == "gzip" else None
        self._br = brotli.Compressor() if encoding == "br" else None

    def piece(self, data: bytes) -> bytes:
        if self._gzip is not None:
            return self._gzip.compress(data) + self._gzip.flush(zlib.Z_SYNC_FLUSH)
        assert self._br is not None
        return self._br.process(data) + self._br.flush()

    def finish(self) -> bytes:
        if self._gzip is not None:
            return self._gzip.flush(zlib.Z_FINISH)
        assert self._br is not None
        return self._br.finish()


class CompressingUpstream:
    """Answers with ``encoding`` whatever the request's Accept-Encoding says (which it notes), a JSON
    body or an SSE stream. ``sent`` holds the bytes it put on the wire."""

    def __init__(self, encoding: str, body: bytes, stream: bool) -> None:
        self.encoding, self.body, self.stream = encoding, body, stream
        self.accept_encoding: list[bytes] = []
        self.sent = bytearray()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        await read_body(receive)
        self.accept_encoding += [v for k, v in scope["headers"] if k == b"accept-encoding"]
        content_type = b"text/event-stream" if self.stream else b"application/json"
        headers = [(b"content-type", content_type)]
        if self.encoding != "identity":
            headers.append((b"content-encoding", self.encoding.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        compressor = _Compressor(self.encoding) if self.encoding != "identity" else None
        for piece in sse_chunks(self.body) if self.stream else [self.body]:
            data = compressor.piece(piece) if compressor else piece
            self.sent += data
            await send({"type": "http.response.body", "body": data, "more_body": True})
        tail = compressor.finish() if compressor else b""
        self.sent += tail
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def _decompress(encoding: str, data: bytes) -> bytes:
    return {"identity": lambda d: d, "gzip": gzip.decompress, "br": brotli.decompress}[encoding](data)


def _eventually(read: Callable[[], list[ModelCallRecord]]) -> list[ModelCallRecord]:
    """The records once there are some (a client that left did not wait for them), within BOUND."""
    deadline = time.monotonic() + BOUND
    while not (records := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return records


# -- 4. an upstream that hangs, a client that leaves, a shutdown with calls in flight --------------------


@pytest.mark.parametrize("configured_by", ["flag", "variable"])
def test_an_upstream_that_never_answers_gets_a_504_once_the_upstream_timeout_passes(
    tmp_path: Path, configured_by: str
) -> None:
    upstream_app = SilentUpstream()
    capture_dir = tmp_path / "calls"
    args = ("--upstream-timeout", "1") if configured_by == "flag" else ()
    env = {"OTEL_CAPTURE_UPSTREAM_TIMEOUT": "1"} if configured_by == "variable" else {}
    with serve(upstream_app) as upstream:
        process, url = start_cli_proxy(upstream, "--capture-dir", str(capture_dir), *args, env=env)
        try:
            response = httpx.post(
                f"{url}/ng-rollout/hung/v1/chat/completions", json={"model": "m"}, timeout=BOUND
            )
            assert upstream_app.gone.wait(BOUND)  # the proxy let go of the upstream's connection
        finally:
            process.terminate()
            process.communicate(timeout=BOUND)
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "upstream_timeout"
    (record,) = read_model_call_records(CaptureStore(capture_dir), "hung")
    assert record.status_code == 504 and record.error_category == "timeout"


def test_an_upstream_that_stops_mid_stream_is_cut_once_the_upstream_timeout_passes(
    telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    reply = replay_server.replies["chat"]
    reply.content_type, reply.chunks, reply.hang_after = (
        "text/event-stream",
        sse_chunks(STREAMS["chat"].read_bytes()),
        2,
    )
    with (
        serve(replay_server) as upstream,
        start_proxy(
            upstream,
            settings=CaptureSettings(),
            tracer_provider=telemetry.provider,
            proxy=ProxySettings(upstream_timeout=1),
        ) as proxy,
    ):
        received = bytearray()

        def read() -> None:
            with httpx.stream(
                "POST",
                f"{proxy.url}/ng-rollout/stalled/v1/chat/completions",
                json={"model": "m", "stream": True},
                timeout=BOUND,
            ) as response:
                for chunk in response.iter_raw():
                    received.extend(chunk)

        with pytest.raises(httpx.RemoteProtocolError):  # the client sees the stream cut
            read()
        (record,) = _eventually(lambda: read_model_call_records(telemetry.store, "stalled"))
    assert bytes(received) == b"".join(reply.chunks[:2])
    assert record.stream_truncated is True and record.error_category == "stream_truncated"
    assert record.failure is not None and record.failure["exception"] == "ReadTimeout"


def test_a_client_that_leaves_before_the_upstream_answers_ends_the_call(telemetry: Telemetry) -> None:
    upstream_app = SilentUpstream()
    with (
        serve(upstream_app) as upstream,
        start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
    ):

        async def leave() -> None:
            async with httpx.AsyncClient(timeout=BOUND) as client:
                call = asyncio.ensure_future(
                    client.post(f"{proxy.url}/ng-rollout/left/v1/responses", json={"model": "m"})
                )
                assert await asyncio.to_thread(upstream_app.reached.wait, BOUND)
                call.cancel()  # the agent gives up: httpx closes its connection
                with contextlib.suppress(asyncio.CancelledError):
                    await call

        asyncio.run(leave())
        assert upstream_app.gone.wait(BOUND), "the proxy kept waiting on the upstream for a client that left"
        (record,) = _eventually(lambda: read_model_call_records(telemetry.store, "left"))
    assert record.error_category == "cancelled"


def test_sigterm_ends_the_proxy_in_bounded_time_with_a_hung_call_recorded_cancelled(tmp_path: Path) -> None:
    upstream_app = SilentUpstream()
    capture_dir = tmp_path / "calls"
    outcome: list[object] = []

    def call(url: str) -> None:
        try:
            outcome.append(
                httpx.post(
                    f"{url}/ng-rollout/stuck/v1/messages", json={"model": "m"}, timeout=BOUND
                ).status_code
            )
        except httpx.HTTPError as exc:
            outcome.append(exc)

    with serve(upstream_app) as upstream:
        process, url = start_cli_proxy(
            upstream, "--capture-dir", str(capture_dir), "--shutdown-timeout", "1", stderr=subprocess.PIPE
        )
        client = threading.Thread(target=call, args=(url,))
        client.start()
        try:
            assert upstream_app.reached.wait(BOUND)
        finally:
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=BOUND)  # ends although the upstream never answers
            client.join(BOUND)
    assert process.returncode == 0, err
    assert "Traceback" not in err  # the documented cancellation is one line in the log, not a stack
    assert not client.is_alive() and outcome  # the client was answered or let go, not left hanging
    (record,) = read_model_call_records(CaptureStore(capture_dir), "stuck")
    assert record.error_category == "cancelled"


# -- 5. the end of a stream reaches the client when the upstream sends it -------------------------------


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_the_end_of_a_stream_reaches_the_client_while_the_upstream_holds_it_open(
    dialect: str, telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    raw = STREAMS[dialect].read_bytes()
    events = sse_chunks(
        raw if raw.endswith(b"\n\n") else raw + b"\n\n"
    )  # each event ends, as servers send it
    gate = Gate()  # the upstream waits here after its last event, with the response still open
    reply = replay_server.replies[dialect]
    reply.content_type, reply.chunks, reply.gate, reply.gate_after = (
        "text/event-stream",
        [*events, b""],
        gate,
        len(events),
    )
    received = bytearray()
    rollout = f"held-{dialect}"
    with (
        serve(replay_server) as upstream,
        start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
    ):

        def read() -> None:
            with httpx.stream(
                "POST",
                f"{proxy.url}/ng-rollout/{rollout}/v1/{PATHS[dialect]}",
                json={"model": "m", "stream": True},
                timeout=BOUND,
            ) as response:
                for chunk in response.iter_raw():
                    received.extend(chunk)

        client = threading.Thread(target=read)
        client.start()
        try:
            client.join(BOUND)
            ended_while_held = not client.is_alive()
            records = read_model_call_records(telemetry.store, rollout) if ended_while_held else []
        finally:
            gate.open()
            client.join(BOUND)
    assert ended_while_held, "the client's stream ended only when the upstream closed its response"
    assert bytes(received) == b"".join(events)
    (record,) = records  # durable by the time the client had its last event
    assert record.error_category is None and record.stream_truncated is False


def test_after_an_error_event_the_rest_of_the_stream_still_reaches_the_client(
    telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    """An error event is not the last word: servers (vLLM) follow it with ``data: [DONE]``."""
    events = [b'data: {"error": {"message": "overloaded", "type": "server_error"}}\n\n', b"data: [DONE]\n\n"]
    reply = replay_server.replies["chat"]
    reply.content_type, reply.chunks = "text/event-stream", events
    with (
        serve(replay_server) as upstream,
        start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
        httpx.stream(
            "POST",
            f"{proxy.url}/ng-rollout/err/v1/chat/completions",
            json={"model": "m", "stream": True},
            timeout=BOUND,
        ) as response,
    ):
        assert b"".join(response.iter_raw()) == b"".join(events)
    (record,) = read_model_call_records(telemetry.store, "err")
    assert record.error_category == "upstream_error"


# -- 8. compressed answers: the client's bytes untouched, the record decoded ----------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_compressed_answer_reaches_the_client_as_sent_and_is_recorded_decoded(
    telemetry: Telemetry, stream: bool
) -> None:
    original = STREAMS["chat"].read_bytes() if stream else recorded_json("chat")
    seen: dict[str, tuple[CompressingUpstream, bytes]] = {}
    for encoding in ("identity", "gzip", "br"):
        upstream_app = CompressingUpstream(encoding, original, stream)
        with (
            serve(upstream_app) as upstream,
            start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
            httpx.stream(
                "POST",
                f"{proxy.url}/ng-rollout/{encoding}/v1/chat/completions",
                json={"model": "m", "stream": stream},
                headers={"accept-encoding": "gzip, br"},
                timeout=BOUND,
            ) as response,
        ):
            assert response.headers.get("content-encoding", "identity") == encoding
            seen[encoding] = (upstream_app, b"".join(response.iter_raw()))
    records = {encoding: read_model_call_records(telemetry.store, encoding)[0] for encoding in seen}
    for encoding, (upstream_app, raw) in seen.items():
        assert raw == bytes(upstream_app.sent)  # the client got the upstream's bytes
        assert _decompress(encoding, raw) == original
        assert upstream_app.accept_encoding == [b"identity"]  # the proxy asks for an uncompressed answer
        record = records[encoding]
        assert record.error_category is None and record.response_raw is None and not record.truncated
        assert record.response == records["identity"].response
    if not stream:
        assert records["br"].response == json.loads(original)
    else:
        assert records["gzip"].stream_truncated is False and records["gzip"].response is not None


def test_a_damaged_compressed_answer_is_recorded_as_cut_and_reaches_the_client_as_sent(
    telemetry: Telemetry,
) -> None:
    class Damaged(CompressingUpstream):
        async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                await serve_lifespan(receive, send)
                return
            await read_body(receive)
            data = gzip.compress(self.body)
            self.sent += data[: len(data) // 2] + b"\x00not gzip\x00" * 8
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")],
                }
            )
            await send({"type": "http.response.body", "body": bytes(self.sent)})

    upstream_app = Damaged("gzip", recorded_json("chat") * 50, stream=False)
    with (
        serve(upstream_app) as upstream,
        start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
        httpx.stream(
            "POST", f"{proxy.url}/ng-rollout/bad-gzip/v1/chat/completions", json={"model": "m"}
        ) as r,
    ):
        assert b"".join(r.iter_raw()) == bytes(upstream_app.sent)
    (record,) = read_model_call_records(telemetry.store, "bad-gzip")
    # the record says its copy is not the answer: flagged, unparsed, kept as it came
    assert record.truncated is True and record.response is None
    assert record.error_category == "capture_parse_error" and record.response_raw


# -- 9. no 502 from a stale keep-alive connection -------------------------------------------------------


class StaleKeepAliveUpstream(socketserver.ThreadingTCPServer):
    """A real HTTP/1.1 server whose keep-alive connections are stale the moment they are reused: it answers
    the first request on a connection and, when the next one arrives there, closes the connection without
    a byte of answer, as a server does whose idle timeout fires just as a request goes out. ``how``:
    ``fin`` (after reading the request) or ``rst`` (an abortive close)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, how: str) -> None:
        self.how = how
        self.dropped = 0
        self.body = recorded_json("chat")
        super().__init__(("127.0.0.1", 0), _StaleHandler)


class _StaleHandler(socketserver.StreamRequestHandler):
    server: StaleKeepAliveUpstream

    def handle(self) -> None:
        answered = False
        while True:
            length = None
            while (line := self.rfile.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if not line:
                return  # the client closed the connection
            if answered:
                self.server.dropped += 1
                if self.server.how == "rst":
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                    )
                else:
                    self.rfile.read(length or 0)
                return  # closed by socketserver
            self.rfile.read(length or 0)
            head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(self.server.body)}\r\n\r\n"
            self.wfile.write(head.encode() + self.server.body)
            answered = True


@contextlib.contextmanager
def _serve_stale(how: str) -> Iterator[StaleKeepAliveUpstream]:
    server = StaleKeepAliveUpstream(how)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(BOUND)


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_a_request_on_a_connection_the_upstream_closed_while_idle_goes_again_on_a_fresh_one(
    how: str, telemetry: Telemetry
) -> None:
    calls = 40  # the proxy keeps 16 pools: from the 17th call on, calls reuse a connection
    with (
        _serve_stale(how) as upstream,
        start_proxy(
            f"http://127.0.0.1:{upstream.server_address[1]}",
            settings=CaptureSettings(),
            tracer_provider=telemetry.provider,
        ) as proxy,
        httpx.Client(timeout=BOUND) as client,
    ):
        statuses = [
            client.post(
                f"{proxy.url}/ng-rollout/stale-{how}/v1/chat/completions", json={"model": "m"}
            ).status_code
            for _ in range(calls)
        ]
    assert upstream.dropped > 0  # stale connections were met
    assert statuses == [200] * calls
    records = read_model_call_records(telemetry.store, f"stale-{how}")
    assert [r.error_category for r in records] == [None] * calls


def test_paced_calls_to_an_upstream_with_a_one_second_keep_alive_get_no_502(
    telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    """The race in its natural setting: rounds of 16 concurrent calls (one per pool) paced around the
    upstream's keep-alive timeout, so connections are reused just as the upstream closes them."""

    async def rounds(url: str) -> list[int]:
        statuses: list[int] = []
        async with httpx.AsyncClient(timeout=BOUND) as client:
            for pause in (0.97, 0.99, 1.0, 1.01, 1.03):
                answers = await asyncio.gather(
                    *[
                        client.post(f"{url}/ng-rollout/paced/v1/chat/completions", json={"model": "m"})
                        for _ in range(16)
                    ]
                )
                statuses += [a.status_code for a in answers]
                await asyncio.sleep(pause)
        return statuses

    with (
        serve(replay_server, timeout_keep_alive=1) as upstream,
        start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
    ):
        statuses = asyncio.run(rounds(proxy.url))
    assert statuses == [200] * len(statuses)
    assert len(read_model_call_records(telemetry.store, "paced")) == len(statuses)
