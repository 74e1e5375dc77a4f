"""Streaming overhead of the capture: time to first chunk, total time, and memory for one big stream.

    python bench/bench_streaming.py [--quick] [--events N] [--calls N] [--mb MB]

Servers (each its own process, uvicorn on 127.0.0.1, a local upstream that streams N Chat Completions
chunks, one SSE event per ASGI message, then ``[DONE]``):

- ``direct``: the upstream app alone (uncaptured);
- ``middleware, uncaptured``: the same app inside ``ModelCallCaptureMiddleware``, called without a rollout
  id, so the middleware passes it through (what an uncaptured call costs once the middleware is installed);
- ``captured``: the same, called under ``/ng-rollout/<id>/``: every call is reassembled and its record
  written durably (flock + write + fsync, group commit) by the ``model_call_jsonl`` exporter to a temp dir.

The client (this process) makes the streamed calls one at a time, rotating over the servers call by call so
that all three are measured side by side under the same machine load; it reports the medians and p90 of
the client-side time to first chunk (first body bytes) and total time, and the captured/uncaptured ratios.

Memory: one ``--mb`` MB stream (default 50; events batched 128 per ASGI message to keep the run short)
through each of ``direct`` and ``captured``, each server in a fresh child process that reports the growth
of its peak RSS during the call (``/proc/self/clear_refs`` resets the peak first) and, separately, the
Python heap peak seen by ``tracemalloc``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # a fresh checkout without `pip install -e .` still finds the package
    sys.path.insert(0, str(REPO))

import httpx

SERVERS = ("direct", "middleware, uncaptured", "captured")
CHAT_PATH = "/v1/chat/completions"
ROLLOUT = "bench-stream"


# --- the upstream -----------------------------------------------------------------------------------


def chat_event(i: int) -> bytes:
    payload = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1727000000,
        "model": "gpt-4o-2024-08-06",
        "system_fingerprint": "fp_bench",
        "choices": [
            {"index": 0, "delta": {"content": f"tok{i % 1000} "}, "logprobs": None, "finish_reason": None}
        ],
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def closing_events(count: int) -> bytes:
    finish = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1727000000,
        "model": "gpt-4o-2024-08-06",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
    usage = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1727000000,
        "model": "gpt-4o-2024-08-06",
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": count, "total_tokens": 12 + count},
    }
    return (
        b"".join(b"data: " + json.dumps(p, separators=(",", ":")).encode() + b"\n\n" for p in (finish, usage))
        + b"data: [DONE]\n\n"
    )


def stream_bytes(events: int) -> int:
    return sum(len(chat_event(i)) for i in range(events)) + len(closing_events(events))


class StreamingUpstream:
    """A model server that streams ``events`` chat chunks (or ``total_bytes`` worth of them), ``batch``
    events per ASGI body message."""

    def __init__(self, events: int, *, total_bytes: int | None = None, batch: int = 1) -> None:
        self.events = events
        self.total_bytes = total_bytes
        self.batch = batch

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        for body in self._bodies():
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _bodies(self) -> Iterator[bytes]:
        sent, i, pending = 0, 0, []
        while (self.total_bytes is None and i < self.events) or (
            self.total_bytes is not None and sent < self.total_bytes
        ):
            event = chat_event(i)
            pending.append(event)
            sent += len(event)
            i += 1
            if len(pending) >= self.batch:
                yield b"".join(pending)
                pending = []
        pending.append(closing_events(i))
        yield b"".join(pending)


# --- server processes -------------------------------------------------------------------------------


def build_app(kind: str, upstream: StreamingUpstream, capture_dir: str) -> Any:
    if kind == "direct":
        return upstream
    from otel_capture import CaptureSettings, ModelCallCaptureMiddleware, WriterSettings
    from otel_capture._telemetry import build_tracer_provider

    settings = CaptureSettings()
    provider = build_tracer_provider(settings, WriterSettings(directory=Path(capture_dir)))
    return ModelCallCaptureMiddleware(upstream, tracer_provider=provider, settings=settings)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def serve_child(kind: str, events: int, capture_dir: str, memory_mb: float | None) -> None:
    """Runs in the child: serve, print the URL, then answer the parent's commands on stdin."""
    import tracemalloc

    import uvicorn

    from otel_capture._proxy import bind_socket, socket_url

    if memory_mb is None:
        upstream = StreamingUpstream(events)
    else:
        upstream = StreamingUpstream(0, total_bytes=int(memory_mb * 1024 * 1024), batch=128)
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(build_app(kind, upstream, capture_dir), log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    print(json.dumps({"url": socket_url(sock)}), flush=True)
    baseline = 0
    for line in sys.stdin:
        command = line.strip()
        if command == "start":  # the parent is about to make the measured call
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM)
            except OSError:
                pass
            baseline = _rss_kib("VmRSS")
            tracemalloc.start()
            print(json.dumps({"ok": True}), flush=True)
        elif command == "stop":
            _, heap_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            peak = _rss_kib("VmHWM")
            print(json.dumps({"rss_delta": (peak - baseline) * 1024, "heap_peak": heap_peak}), flush=True)
        elif command == "quit":
            break
    server.should_exit = True
    thread.join(30)


class Child:
    def __init__(self, kind: str, events: int, capture_dir: str, memory_mb: float | None = None) -> None:
        argv = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--events",
            str(events),
            "--capture-dir",
            capture_dir,
        ]
        if memory_mb is not None:
            argv += ["--mb", str(memory_mb)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.url = self._reply()["url"]

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a benchmark server failed to start")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def command(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


# --- the client -------------------------------------------------------------------------------------


def http_client(timeout: float) -> httpx.Client:
    # TCP_NODELAY: without it the request's header and body writes meet the server's delayed ACK and
    # some calls of every server wait 40 ms (Nagle), which says nothing about the capture.
    transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    return httpx.Client(timeout=timeout, transport=transport)


def call_url(kind: str, base: str) -> str:
    if kind == "captured":
        return f"{base}/ng-rollout/{ROLLOUT}{CHAT_PATH}"
    return f"{base}{CHAT_PATH}"


def timed_call(client: httpx.Client, url: str) -> tuple[float, float, int]:
    """(time to first chunk, total time, bytes received), client side."""
    body = {"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    size = 0
    start = time.perf_counter()
    first = None
    with client.stream("POST", url, json=body) as response:
        for chunk in response.iter_raw():
            if first is None and chunk:
                first = time.perf_counter()
            size += len(chunk)
    end = time.perf_counter()
    return (first or end) - start, end - start, size


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def ms(value: float) -> str:
    return f"{value * 1000:.2f}"


def latency(events: int, calls: int, warmup: int, capture_dir: str) -> None:
    expected = stream_bytes(events)
    children = {kind: Child(kind, events, capture_dir) for kind in SERVERS}
    results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in SERVERS}
    try:
        clients = {kind: http_client(60) for kind in SERVERS}
        order = list(SERVERS)
        for round_number in range(warmup + calls):
            order = order[1:] + order[:1]  # rotate, so no server always goes first
            for kind in order:
                ttft, total, size = timed_call(clients[kind], call_url(kind, children[kind].url))
                if size != expected:
                    raise RuntimeError(f"{kind}: got {size} bytes, expected {expected}")
                if round_number >= warmup:
                    results[kind].append((ttft, total))
        for client in clients.values():
            client.close()
    finally:
        for child in children.values():
            child.close()
    lines = sorted(Path(capture_dir).glob("*.capture.jsonl"))
    written = sum(1 for path in lines for line in path.read_bytes().splitlines() if line.strip())
    print(
        f"\nStreamed calls: {events} chat chunks per stream ({expected} bytes), {calls} measured calls per "
        f"server after {warmup} warm-up rounds, one at a time, servers rotated call by call."
    )
    header = ("server", "TTFT med ms", "TTFT p90 ms", "total med ms", "total p90 ms", "TTFT x", "total x")
    rows = []
    base_ttft = statistics.median(t for t, _ in results["direct"])
    base_total = statistics.median(t for _, t in results["direct"])
    for kind in SERVERS:
        ttfts = [t for t, _ in results[kind]]
        totals = [t for _, t in results[kind]]
        rows.append(
            (
                kind,
                ms(statistics.median(ttfts)),
                ms(percentile(ttfts, 0.9)),
                ms(statistics.median(totals)),
                ms(percentile(totals, 0.9)),
                f"{statistics.median(ttfts) / base_ttft:.2f}",
                f"{statistics.median(totals) / base_total:.2f}",
            )
        )
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print(
            "  "
            + "  ".join(
                str(cell).rjust(width) if i else str(cell).ljust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=False))
            )
        )
    print(f"  (x = median / median of direct; records written durably by the captured server: {written})")


def memory(megabytes: float, capture_dir: str) -> None:
    print(
        f"\nOne {megabytes:g} MB stream (events batched 128 per ASGI message), peak memory growth of the "
        "server process during the call:"
    )
    size = 0
    rows = []
    for kind in ("direct", "captured"):
        child = Child(kind, 0, capture_dir, memory_mb=megabytes)
        try:
            with http_client(300) as client:
                child.command("start")
                _, total, size = timed_call(client, call_url(kind, child.url))
            report = child.command("stop")
        finally:
            child.close()
        rows.append((kind, report["rss_delta"], report["heap_peak"], total))
    for kind, rss, heap, total in rows:
        print(
            f"  {kind:<9} peak RSS +{rss / 2**20:7.1f} MiB ({rss / size:5.2f}x the stream)   "
            f"tracemalloc peak {heap / 2**20:7.1f} MiB ({heap / size:5.2f}x)   call {total:6.2f} s"
        )
    print(
        f"  stream size: {size / 2**20:.1f} MiB; the capture keeps at most max_body_bytes of raw body "
        f"(default {32} MiB) and the reassembled response"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a few seconds: fewer calls, a 10 MB stream")
    parser.add_argument("--events", type=int, default=None, help="chat chunks per stream (default 200)")
    parser.add_argument("--calls", type=int, default=None, help="measured calls per server (default 150)")
    parser.add_argument("--mb", type=float, default=None, help="size of the memory stream (default 50)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--capture-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        serve_child(args.child, args.events, args.capture_dir, args.mb)
        return 0
    events = args.events or (100 if args.quick else 200)
    calls = args.calls or (20 if args.quick else 150)
    megabytes = args.mb or (10.0 if args.quick else 50.0)
    print(
        f"bench_streaming: python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    with tempfile.TemporaryDirectory(prefix="bench-stream-", dir=os.environ.get("BENCH_DIR")) as tmp:
        latency(events, calls, 3 if args.quick else 10, str(Path(tmp) / "latency"))
        memory(megabytes, str(Path(tmp) / "memory"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
