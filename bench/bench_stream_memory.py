"""The memory of one big streamed call, captured against not captured.

    python -m bench.bench_stream_memory [--quick] [--mb MB]

One ``--mb`` MB Chat Completions stream (default 50; quick 10; events batched 128 per ASGI message) goes
through ``direct`` (the streaming app alone) and through ``captured`` (the same app inside
``ModelCallCaptureMiddleware`` with the ``model_call_jsonl`` exporter, called under ``/ng-rollout/<id>/``:
reassembled and recorded durably). Each server is a fresh child process that reports the growth of its
peak RSS during the call (``VmHWM``, reset through ``/proc/self/clear_refs`` just before) and, separately,
the Python heap's peak seen by ``tracemalloc``. Linux only. (Time to first event and CPU per event, capture
on against off, are ``bench_goals.py``'s goal 4.)
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench import _harness as H
from bench._servers import bind_socket, capture_app, chat_event, closing_events, socket_url

ROLLOUT = "bench-stream"
CHAT_PATH = "/v1/chat/completions"
BATCH = 128  # events per ASGI body message: a big stream in a short run


def stream_bodies(total_bytes: int) -> Iterator[bytes]:
    """Content chunks until ``total_bytes`` are sent, ``BATCH`` events per body, then the closing events."""
    sent, i, pending = 0, 0, []
    while sent < total_bytes:
        event = chat_event(i)
        pending.append(event)
        sent, i = sent + len(event), i + 1
        if len(pending) >= BATCH:
            yield b"".join(pending)
            pending = []
    yield b"".join([*pending, *closing_events(i)])


def big_stream_app(total_bytes: int) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for body in stream_bodies(total_bytes):
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def serve_child(kind: str, megabytes: float, capture_dir: str) -> None:
    """In the child: serve, print the URL, then answer the parent's ``start``/``stop``/``quit`` on stdin."""
    import tracemalloc

    import uvicorn

    model = big_stream_app(int(megabytes * 1024 * 1024))
    app = model if kind == "direct" else capture_app(model, capture_dir)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    print(json.dumps({"url": socket_url(sock)}), flush=True)
    baseline = 0
    for line in sys.stdin:
        command = line.strip()
        if command == "start":  # the parent is about to make the measured call
            H.reset_peak_rss()
            baseline = H.status_kib("VmRSS")
            tracemalloc.start()
            print(json.dumps({"ok": True}), flush=True)
        elif command == "stop":
            _, heap_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            peak = H.status_kib("VmHWM")
            print(json.dumps({"rss_delta": (peak - baseline) * 1024, "heap_peak": heap_peak}), flush=True)
        elif command == "quit":
            break
    server.should_exit = True
    thread.join(30)


class Child:
    """One server process, driven line by line over its stdin and stdout."""

    def __init__(self, kind: str, megabytes: float, capture_dir: str) -> None:
        argv = [H.PYTHON, "-m", "bench.bench_stream_memory", "--child", kind, "--mb", str(megabytes)]
        argv += ["--capture-dir", capture_dir]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=H.REPO
        )
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


def timed_call(url: str) -> tuple[float, int]:
    """(seconds, bytes received) of one streamed call, client side (TCP_NODELAY: no Nagle wait)."""
    transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    body = {"model": "bench-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    size = 0
    with httpx.Client(timeout=300, transport=transport) as client:
        start = time.perf_counter()
        with client.stream("POST", url, json=body) as response:
            for chunk in response.iter_raw():
                size += len(chunk)
    return time.perf_counter() - start, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 10 MB stream")
    parser.add_argument("--mb", type=float, default=None, help="size of the stream (default 50)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--capture-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    megabytes = args.mb or (10.0 if args.quick else 50.0)
    if args.child:
        serve_child(args.child, megabytes, args.capture_dir)
        return 0
    print(f"== bench_stream_memory: one {megabytes:g} MB stream, {BATCH} events per ASGI message ==")
    print(H.machine_line())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        for kind in ("direct", "captured"):
            child = Child(kind, megabytes, str(Path(tmp) / "calls"))
            try:
                path = f"/ng-rollout/{ROLLOUT}{CHAT_PATH}" if kind == "captured" else CHAT_PATH
                child.command("start")
                seconds, size = timed_call(child.url + path)
                report = child.command("stop")
            finally:
                child.close()
            rss, heap = report["rss_delta"], report["heap_peak"]
            rows.append(
                [kind, rss / 2**20, f"{rss / size:.2f}x", heap / 2**20, f"{heap / size:.2f}x", seconds]
            )
        records = H.count_lines(Path(tmp) / "calls")
    H.print_table(
        "peak memory growth of the server process during the call",
        ["server", "peak RSS + MiB", "x the stream", "tracemalloc peak MiB", "x the stream", "call s"],
        rows,
        [
            f"stream: {size / 2**20:.1f} MiB; records written by the captured server: {records}; the capture "
            "keeps at most max_body_bytes of the raw body (32 MiB by default) and the reassembled response"
        ],
    )
    return 0 if records == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
