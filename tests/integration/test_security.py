"""Secrets and access: what a capture layer in front of a model server must never leak or open up."""

from __future__ import annotations

import logging
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from otel_capture import CaptureSettings, start_proxy

from support import ReplayModelServer, Telemetry, serve

SECRETS = {
    "authorization": "Bearer sk-leak-check-1",
    "x-api-key": "sk-leak-check-2",
    "api-key": "sk-leak-check-3",
    "cookie": "session=sk-leak-check-4",
    "proxy-authorization": "Basic sk-leak-check-5",
}


def test_capture_directory_is_0700_and_files_0600(telemetry: Telemetry, replay_server: ReplayModelServer) -> None:
    with serve(replay_server) as upstream, start_proxy(
        upstream, settings=CaptureSettings(), tracer_provider=telemetry.provider
    ) as proxy:
        httpx.post(f"{proxy.url}/ng-rollout/modes/v1/responses", json={"model": "m"})
    assert stat.S_IMODE(telemetry.store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(telemetry.store.data_path("modes").stat().st_mode) == 0o600


def test_secrets_never_reach_records_spans_or_logs_even_when_calls_fail(
    telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    with serve(ReplayModelServer()) as dead:
        pass  # its port now refuses connections: the proxy logs and answers 502
    blocked = telemetry.store.root
    with caplog.at_level(logging.DEBUG), start_proxy(
        dead, settings=CaptureSettings(), tracer_provider=telemetry.provider
    ) as proxy:
        for dialect in ("responses", "chat/completions", "messages"):
            response = httpx.post(f"{proxy.url}/ng-rollout/leak/v1/{dialect}", json={"model": "m"}, headers=SECRETS)
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
        [sys.executable, "-m", "otel_capture._cli.main", "proxy", "--upstream", "http://127.0.0.1:9", "--host", "0.0.0.0"],
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
