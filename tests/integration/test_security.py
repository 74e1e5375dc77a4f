"""Secrets and access: what a capture layer in front of a model server must never leak or open up."""

from __future__ import annotations

import logging
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import ReplayModelServer, Telemetry, recorded_json, serve, start_cli_proxy

from otel_capture import CaptureSettings, CaptureStore, read_model_call_records, start_proxy

SECRETS = {
    "authorization": "Bearer sk-leak-check-1",
    "x-api-key": "sk-leak-check-2",
    "api-key": "sk-leak-check-3",
    "cookie": "session=sk-leak-check-4",
    "proxy-authorization": "Basic sk-leak-check-5",
}


def test_capture_directory_is_0700_and_files_0600(
    telemetry: Telemetry, replay_server: ReplayModelServer
) -> None:
    with (
        serve(replay_server) as upstream,
        start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
    ):
        httpx.post(f"{proxy.url}/ng-rollout/modes/v1/responses", json={"model": "m"})
    assert stat.S_IMODE(telemetry.store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(telemetry.store.data_path("modes").stat().st_mode) == 0o600


def test_secrets_never_reach_records_spans_or_logs_even_when_calls_fail(
    telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    with serve(ReplayModelServer()) as dead:
        pass  # its port now refuses connections: the proxy logs and answers 502
    blocked = telemetry.store.root
    with (
        caplog.at_level(logging.DEBUG),
        start_proxy(dead, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
    ):
        for dialect in ("responses", "chat/completions", "messages"):
            response = httpx.post(
                f"{proxy.url}/ng-rollout/leak/v1/{dialect}", json={"model": "m"}, headers=SECRETS
            )
            assert response.status_code == 502
            assert not any(secret in response.text for secret in SECRETS.values())
    written = b"".join(p.read_bytes() for p in blocked.rglob("*") if p.is_file())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    attributes = [str(v) for s in telemetry.spans.get_finished_spans() for v in s.attributes.values()]
    for secret in SECRETS.values():
        assert secret.encode() not in written
        assert secret not in logged
        assert not any(secret in value for value in attributes)


def test_the_proxy_says_so_when_it_binds_beyond_loopback(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "otel_capture._cli.main",
            "proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--host",
            "0.0.0.0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline().startswith("listening on http://0.0.0.0:")
        warning = process.stderr.readline()
        assert "reachable from other machines" in warning
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_the_proxy_binds_loopback_by_default() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "otel_capture._cli.main", "proxy", "--upstream", "http://127.0.0.1:9"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("listening on http://127.0.0.1:")
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "reachable from other machines" not in err


class _Echo:
    """A model server that notes each request's query string and headers, and answers with a cookie."""

    def __init__(self) -> None:
        self.queries: list[bytes] = []
        self.headers: list[dict[bytes, bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        self.queries.append(scope["query_string"])
        self.headers.append(dict(scope["headers"]))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"set-cookie", b"session=sk-leak-check-cookie-out"),
                    (b"x-request-id", b"req-visible"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": recorded_json("chat")})


def _span_values(telemetry: Telemetry) -> list[str]:
    return [str(v) for s in telemetry.spans.get_finished_spans() for v in (s.attributes or {}).values()]


def test_a_key_in_the_query_string_reaches_the_upstream_and_no_span(telemetry: Telemetry) -> None:
    echo = _Echo()
    query = "api_key=sk-leak-check-query&api-version=2024-10-21"
    with (
        serve(echo) as upstream,
        start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
    ):
        response = httpx.post(
            f"{proxy.url}/ng-rollout/query/v1/chat/completions?{query}", json={"model": "m"}
        )
    assert response.status_code == 200
    assert echo.queries == [query.encode()]  # forwarded as sent
    values = _span_values(telemetry)
    assert not any("sk-leak-check-query" in value or "2024-10-21" in value for value in values)
    assert any(
        "api_key=REDACTED&api-version=REDACTED" in value for value in values
    )  # which parameters, not what


def test_the_capture_headers_variables_never_put_credentials_on_spans(
    telemetry: Telemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST", ".*")
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_RESPONSE", ".*")
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS", "x-internal-token")
    sent = {
        **SECRETS,
        "x-goog-api-key": "sk-leak-check-6",
        "x-internal-token": "sk-leak-check-7",
        "x-note": "visible",
    }
    echo = _Echo()
    with (
        serve(echo) as upstream,
        start_proxy(upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider) as proxy,
    ):
        response = httpx.post(
            f"{proxy.url}/ng-rollout/headers/v1/chat/completions", json={"model": "m"}, headers=sent
        )
    assert (
        response.status_code == 200 and response.headers["set-cookie"] == "session=sk-leak-check-cookie-out"
    )
    assert echo.headers[0][b"authorization"] == SECRETS["authorization"].encode()  # forwarded as sent
    values = _span_values(telemetry)
    assert not any("sk-leak-check" in value for value in values)
    # the variables are honoured for everything else
    assert any("visible" in value for value in values) and any("req-visible" in value for value in values)
    assert any("[REDACTED]" in value for value in values)


def test_a_password_in_the_upstream_url_is_never_printed_answered_or_recorded(tmp_path: Path) -> None:
    with serve(ReplayModelServer()) as dead:
        pass  # its port now refuses connections: every call is a 502, and the log names the upstream
    upstream = dead.replace("http://", "http://user:sk-leak-check-password@")
    capture_dir = tmp_path / "calls"
    process, url = start_cli_proxy(upstream, "--capture-dir", str(capture_dir), stderr=subprocess.PIPE)
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        response = httpx.post(f"{url}/ng-rollout/pw/v1/chat/completions", json={"model": "m"})
    finally:
        process.terminate()
        out, err = process.communicate(timeout=30)
    assert response.status_code == 502
    assert "REDACTED" in banner and "REDACTED" in err  # the upstream is still named, where the operator looks
    assert "127.0.0.1" not in response.text  # the client is told what failed, not where the upstream is
    written = b"".join(p.read_bytes() for p in capture_dir.rglob("*") if p.is_file())
    assert len(read_model_call_records(CaptureStore(capture_dir), "pw")) == 1
    for where in (banner, out, err, response.text, written.decode("utf-8", "replace")):
        assert "sk-leak-check-password" not in where


# -- the request-size limit: a body never sits in memory past it ----------------------------------------


def test_a_request_over_the_size_limit_is_refused_413_naming_the_limit(
    replay_server: ReplayModelServer,
) -> None:
    with serve(replay_server) as upstream:
        process, url = start_cli_proxy(upstream, "--max-request-bytes", "1000000")
        try:
            target = f"{url}/ng-rollout/big/v1/chat/completions"
            headers = {"content-type": "application/json"}
            declared = httpx.post(target, content=b"x" * 5_000_000, headers=headers, timeout=60)
            chunked = httpx.post(target, content=iter([b"x" * 100_000] * 50), headers=headers, timeout=60)
            head, tail = b'{"model": "m", "pad": "', b'"}'
            fits = httpx.post(
                target, content=head + b"x" * (1_000_000 - len(head) - len(tail)) + tail, timeout=60
            )
        finally:
            process.terminate()
            process.communicate(timeout=30)
    for refused in (declared, chunked):
        assert refused.status_code == 413
        error = refused.json()["error"]
        assert error["type"] == "request_too_large" and error["limit_bytes"] == 1_000_000
        assert "1000000 bytes" in error["message"]
    assert fits.status_code == 200
    assert [len(body) for _, _, body in replay_server.seen] == [1_000_000]  # only the body that fits went on


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response with a Content-Length, head and body, off a raw socket."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536) or b"\r\n\r\n"
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length and (more := sock.recv(65536)):
        body += more
    return head + b"\r\n\r\n" + body


def test_the_default_limit_refuses_a_declared_oversized_body_before_reading_it(
    replay_server: ReplayModelServer,
) -> None:
    """Decided from Content-Length alone: the 64 MiB + 1 bytes are never sent, and never awaited."""
    with serve(replay_server) as upstream:
        process, url = start_cli_proxy(upstream)
        try:
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(
                    b"POST /ng-rollout/huge/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    b"content-type: application/json\r\ncontent-length: 67108865\r\n\r\n"
                )
                answer = _read_response(sock)
        finally:
            process.terminate()
            process.communicate(timeout=30)
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"67108864 bytes" in answer
    assert replay_server.seen == []


def test_the_size_limit_comes_from_its_variable(replay_server: ReplayModelServer) -> None:
    with serve(replay_server) as upstream:
        process, url = start_cli_proxy(upstream, env={"OTEL_CAPTURE_MAX_REQUEST_BYTES": "1000"})
        try:
            response = httpx.post(f"{url}/v1/chat/completions", content=iter([b"x" * 600] * 2), timeout=60)
        finally:
            process.terminate()
            process.communicate(timeout=30)
    assert response.status_code == 413 and response.json()["error"]["limit_bytes"] == 1000
