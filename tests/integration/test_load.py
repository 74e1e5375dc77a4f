"""A load test: the capture proxy under sustained load from several client processes (loopback only,
bounded in count), then checked for what a long-running deployment would suffer from: memory growth,
file-descriptor or thread leaks, and lost records.

``OTEL_CAPTURE_LOAD_CALLS`` sets the calls per client process (CI runs the short form; the long form is
``OTEL_CAPTURE_LOAD_CALLS=20000``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import RECORDED, ReplayModelServer, serve, sse_chunks

from otel_capture import CaptureStore, read_available_model_call_records
from otel_capture._store.writer import IDLE_CLOSE

CALLS_PER_CLIENT = int(os.environ.get("OTEL_CAPTURE_LOAD_CALLS", "400"))
CLIENT_PROCESSES = 3

CLIENT = r"""
import sys, httpx
url, rollout, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
ok = 0
with httpx.Client(timeout=60) as client:
    for i in range(calls):
        if i % 2:
            with client.stream("POST", f"{url}/ng-rollout/{rollout}/v1/chat/completions",
                               json={"model": "m", "stream": True, "user": f"{rollout}-{i}"}) as r:
                body = b"".join(r.iter_raw())
            ok += r.status_code == 200 and body.rstrip().endswith(b"[DONE]")
        else:
            r = client.post(f"{url}/ng-rollout/{rollout}/v1/responses", json={"model": "m", "user": f"{rollout}-{i}"})
            ok += r.status_code == 200
print(ok)
"""


def _usage(pid: int) -> tuple[int, int, int]:
    """Resident memory (kB), open file descriptors, threads of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmRSS"].split()[0]), len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])


def _idle_usage(pid: int, fds_at_most: int | None = None) -> tuple[int, int, int]:
    """``_usage`` once the writer has been idle long enough to close the files it keeps open between batches
    (data files and stripe lock files, ``IDLE_CLOSE`` after its last batch); with ``fds_at_most``, polled
    until the count is down to it, for at most 30 s (a loaded machine may run the writer thread late)."""
    time.sleep(2 * IDLE_CLOSE)
    deadline = time.monotonic() + 30
    usage = _usage(pid)
    while fds_at_most is not None and usage[1] > fds_at_most and time.monotonic() < deadline:
        time.sleep(0.2)
        usage = _usage(pid)
    return usage


def _load(url: str, rollouts: list[str], calls: int) -> int:
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, url, rollout, str(calls)], stdout=subprocess.PIPE, text=True
        )
        for rollout in rollouts
    ]
    return sum(int(client.communicate(timeout=600)[0]) for client in clients)


def test_sustained_load_keeps_memory_fds_and_threads_flat_and_loses_no_call(tmp_path: Path) -> None:
    server = ReplayModelServer()
    server.replies["chat"].content_type = "text/event-stream"
    server.replies["chat"].chunks = sse_chunks(
        (RECORDED / "openai-python/chat_completions_sse/parse_strict_tools.a247c49c5fcd.sse").read_bytes()
    )
    capture_dir = tmp_path / "calls"
    with serve(server) as upstream:
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "otel_capture._cli.main",
                "proxy",
                "--upstream",
                upstream,
                "--capture-dir",
                str(capture_dir),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proxy.stdout is not None
        url = proxy.stdout.readline().strip().removeprefix("listening on ")
        try:
            # warm-up: imports, connection pools, allocator arenas
            warm = _load(url, [f"warm-{i}" for i in range(CLIENT_PROCESSES)], CALLS_PER_CLIENT // 4)
            before = _idle_usage(proxy.pid)
            acked = _load(url, [f"load-{i}" for i in range(CLIENT_PROCESSES)], CALLS_PER_CLIENT)
            after = _idle_usage(proxy.pid, fds_at_most=before[1] + 2)
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.communicate(timeout=60)
    assert proxy.returncode == 0
    assert warm == CLIENT_PROCESSES * (CALLS_PER_CLIENT // 4)
    assert acked == CLIENT_PROCESSES * CALLS_PER_CLIENT
    rss_growth_kb = after[0] - before[0]
    print(
        f"rss {before[0]} -> {after[0]} kB, fds {before[1]} -> {after[1]}, threads {before[2]} -> {after[2]}"
    )
    # a few hundred kB of allocator noise; a leak of even 2.5 kB per call would show as 3 MB here
    assert rss_growth_kb < 3_000, f"resident memory grew by {rss_growth_kb} kB over {acked} calls"
    assert after[1] <= before[1] + 2, f"file descriptors {before[1]} -> {after[1]}"
    assert after[2] <= before[2] + 1, f"threads {before[2]} -> {after[2]}"
    store = CaptureStore(capture_dir)
    for i in range(CLIENT_PROCESSES):
        available = read_available_model_call_records(store, f"load-{i}")
        assert available.invalid == [] and not available.incomplete
        assert sorted(r.request["user"] for r in available.records if r.request) == sorted(
            f"load-{i}-{n}" for n in range(CALLS_PER_CLIENT)
        )
