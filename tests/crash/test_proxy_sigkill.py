"""Crash tests: the capture proxy, a real process, SIGKILLed while many streamed and non-streamed calls of
several rollouts are in flight, at a random moment, again and again.

After each kill: every call whose client received its terminal chunk is on disk; no damaged line is read
as a record; and a new proxy on the same directory appends cleanly after whatever the dead one left.

``OTEL_CAPTURE_CRASH_ITERATIONS`` sets how many kills (CI runs the short form).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support import RECORDED, ReplayModelServer, serve, sse_chunks, start_cli_proxy

from otel_capture import CaptureStore, read_available_model_call_records

ITERATIONS = int(os.environ.get("OTEL_CAPTURE_CRASH_ITERATIONS", "3"))
ROLLOUTS = [f"crash-{i}" for i in range(4)]
CLIENTS = 12
CHAT_SSE = RECORDED / "openai-python/chat_completions_sse/parse_pydantic_model.7e5ea4d12e7c.sse"


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ReplayModelServer()
    server.replies["chat"].content_type = "text/event-stream"
    server.replies["chat"].chunks = sse_chunks(CHAT_SSE.read_bytes())
    server.chunk_delay = 0.001  # calls overlap, so a kill lands mid-stream for some of them
    with serve(server) as url:
        yield url


def _stop(process: subprocess.Popen[str], sig: int) -> None:
    process.send_signal(sig)
    process.wait(30)
    assert process.stdout is not None
    process.stdout.close()


class _Traffic:
    """Clients that call until told to stop; ``acked`` holds the tags of calls that got their terminal chunk."""

    def __init__(self, url: str, kill_after: int) -> None:
        self.url = url
        self.acked: set[str] = set()
        self.lock = threading.Lock()
        self.enough = threading.Event()
        self.stop = threading.Event()
        self.kill_after = kill_after

    def _one_call(self, client: httpx.Client, rng: random.Random) -> None:
        tag = uuid.uuid4().hex
        rollout = rng.choice(ROLLOUTS)
        if rng.random() < 0.5:
            body = {"model": "m", "stream": True, "user": tag, "messages": [{"role": "user", "content": "x"}]}
            with client.stream(
                "POST", f"{self.url}/ng-rollout/{rollout}/v1/chat/completions", json=body
            ) as response:
                received = b"".join(response.iter_raw())
            acked = response.status_code == 200 and received.rstrip().endswith(b"data: [DONE]")
        else:
            body = {"model": "m", "input": "x", "user": tag}
            response = client.post(f"{self.url}/ng-rollout/{rollout}/v1/responses", json=body)
            acked = response.status_code == 200 and response.json()["object"] == "response"
        if acked:
            with self.lock:
                self.acked.add(tag)
                if len(self.acked) >= self.kill_after:
                    self.enough.set()

    def run_client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                try:
                    self._one_call(client, rng)
                except httpx.HTTPError:
                    if self.stop.is_set():
                        return


def _tags(capture_dir: Path) -> tuple[set[str], list[str]]:
    """The tags of every valid record, and a description of every damaged line that is not a torn tail."""
    store = CaptureStore(capture_dir)
    tags: set[str] = set()
    damaged: list[str] = []
    for rollout_id in store.rollout_ids():
        available = read_available_model_call_records(store, rollout_id)
        tags |= {r.request["user"] for r in available.records if r.request}
        damaged += [f"{rollout_id}:{bad.line_number}: {bad.reason}" for bad in available.invalid]
    return tags, damaged


@pytest.mark.parametrize("iteration", range(ITERATIONS))
def test_sigkill_mid_traffic_loses_no_acknowledged_call(
    upstream: str, tmp_path: Path, iteration: int
) -> None:
    capture_dir = tmp_path / "calls"
    proxy, url = start_cli_proxy(upstream, "--capture-dir", str(capture_dir))
    traffic = _Traffic(url, kill_after=random.Random(iteration).randint(5, 60))
    with ThreadPoolExecutor(CLIENTS) as pool:
        clients = [pool.submit(traffic.run_client, iteration * 100 + i) for i in range(CLIENTS)]
        assert traffic.enough.wait(120), "the proxy never served enough calls"
        _stop(proxy, signal.SIGKILL)
        with traffic.lock:
            acked_before_kill = set(traffic.acked)
        traffic.stop.set()
        for client in clients:
            client.result(60)
    assert proxy.returncode == -signal.SIGKILL

    tags, damaged = _tags(capture_dir)
    assert acked_before_kill <= tags, (
        f"{len(acked_before_kill - tags)} acknowledged call(s) missing from disk"
    )
    assert damaged == []

    # a new proxy on the same directory appends cleanly after whatever the dead one left
    proxy, url = start_cli_proxy(upstream, "--capture-dir", str(capture_dir))
    after = {rollout: uuid.uuid4().hex for rollout in ROLLOUTS}
    try:
        for rollout, tag in after.items():
            response = httpx.post(
                f"{url}/ng-rollout/{rollout}/v1/responses", json={"model": "m", "user": tag}
            )
            assert response.status_code == 200
    finally:
        _stop(proxy, signal.SIGTERM)
    tags_after, _ = _tags(capture_dir)
    assert set(after.values()) <= tags_after
    assert acked_before_kill <= tags_after


def test_a_writer_appends_cleanly_after_a_torn_tail(upstream: str, tmp_path: Path) -> None:
    """A previous writer died inside its write: the file ends in half a line. The next call's record must
    be intact, and the torn line must stay visible as damage, never merged into a record."""
    capture_dir = tmp_path / "calls"
    capture_dir.mkdir()
    torn = b'{"model_call_id": "dead", "dialect": "chat", "request": {"mod'
    (capture_dir / "torn-1.capture.jsonl").write_bytes(torn)
    proxy, url = start_cli_proxy(upstream, "--capture-dir", str(capture_dir))
    try:
        response = httpx.post(
            f"{url}/ng-rollout/torn-1/v1/responses", json={"model": "m", "user": "after-tear"}
        )
        assert response.status_code == 200
    finally:
        _stop(proxy, signal.SIGTERM)
    available = read_available_model_call_records(CaptureStore(capture_dir), "torn-1")
    assert [r.request["user"] for r in available.records if r.request] == ["after-tear"]
    assert [bad.line_number for bad in available.invalid] == [1]
    assert not available.torn_tail
