"""Faults on the capture side: a full disk, a vanished or blocked capture directory. The client's response
is exactly what the upstream sent, the failure is counted and logged with its reason, and capture resumes
by itself when the fault clears."""

from __future__ import annotations

import errno
import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import ReplayModelServer, Telemetry, recorded_json, serve

from otel_capture import CaptureSettings, CaptureStore, read_available_model_call_records, start_proxy


@pytest.fixture
def upstream(replay_server: ReplayModelServer) -> Iterator[str]:
    with serve(replay_server) as url:
        yield url


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 512 KiB tmpfs, so the disk really fills up (the tests run as root, as CI does)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(mount_point)], check=True
    )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(disk: Path, leave: int) -> Path:
    """Fill the disk until fewer than ``leave`` bytes are free."""
    filler = disk / "filler"
    with filler.open("wb") as handle:
        block = b"\0" * 4096
        try:
            while shutil.disk_usage(disk).free > leave:
                handle.write(block)
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_a_full_disk_keeps_responses_exact_and_capture_resumes_when_space_returns(
    upstream: str, small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    capture_dir = small_disk / "calls"
    with caplog.at_level(logging.ERROR), start_proxy(upstream, str(capture_dir)) as proxy:
        url = f"{proxy.url}/ng-rollout/full/v1/chat/completions"
        assert httpx.post(url, json={"model": "m", "user": "before"}).status_code == 200
        _wait_for_reserve(capture_dir)  # made right after the first batch is answered, while there is room
        filler = _fill(small_disk, leave=0)
        response = httpx.post(url, json={"model": "m", "user": "while-full", "pad": "x" * 8000})
        assert response.status_code == 200 and response.content == recorded_json("chat")
        filler.unlink()  # the fault clears
        assert httpx.post(url, json={"model": "m", "user": "after"}).status_code == 200
    failures = [
        r for r in caplog.records if "No space left on device" in r.getMessage() or "ENOSPC" in r.getMessage()
    ]
    assert failures, "the full disk was not logged with its reason"
    available = read_available_model_call_records(CaptureStore(capture_dir), "full")
    assert [r.request["user"] for r in available.records if r.request] == ["before", "after"]
    assert available.invalid == [] and not available.torn_tail  # the short write was cut back, not left torn


def _wait_for_reserve(capture_dir: Path) -> None:
    deadline = time.monotonic() + 10
    while not list((capture_dir / ".otel-capture" / "losses").glob("*.losses")):
        assert time.monotonic() < deadline, "the writer made no loss reserve after its first batch"
        time.sleep(0.02)


def _remove(root: Path) -> None:
    """``rm -rf`` of a capture directory in use, tried again as a user would when it races the writer,
    which makes its state directory (``.otel-capture/``) right after it answers its first batch."""
    deadline = time.monotonic() + 10
    while True:
        try:
            shutil.rmtree(root)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_vanished_capture_directory_is_recreated_and_capture_resumes(
    upstream: str, telemetry: Telemetry
) -> None:
    settings = CaptureSettings()
    with start_proxy(upstream, settings=settings, tracer_provider=telemetry.provider) as proxy:
        url = f"{proxy.url}/ng-rollout/gone/v1/responses"
        assert httpx.post(url, json={"model": "m", "user": "first"}).status_code == 200
        _remove(telemetry.store.root)
        response = httpx.post(url, json={"model": "m", "user": "second"})
        assert response.status_code == 200 and response.content == recorded_json("responses")
    records = read_available_model_call_records(telemetry.store, "gone").records
    assert [r.request["user"] for r in records if r.request] == ["second"]


def test_a_blocked_capture_directory_fails_capture_then_resumes(upstream: str, tmp_path: Path) -> None:
    capture_dir = tmp_path / "blocked"
    capture_dir.write_text("a file where the directory should be")
    with start_proxy(upstream, str(capture_dir)) as proxy:
        url = f"{proxy.url}/ng-rollout/blocked/v1/messages"
        response = httpx.post(url, json={"model": "m", "user": "blocked"})
        assert response.status_code == 200 and response.content == recorded_json("messages")
        capture_dir.unlink()  # the fault clears
        assert httpx.post(url, json={"model": "m", "user": "resumed"}).status_code == 200
    records = read_available_model_call_records(CaptureStore(capture_dir), "blocked").records
    assert [r.request["user"] for r in records if r.request] == ["resumed"]
