"""The proxy's memory under oversized request bodies (issue 15, item 7).

    python bench/bench_request_limit.py [--mb 200] [--clients 4]

An ``otel-capture proxy`` process in front of a tiny upstream (its own uvicorn process) receives
``--clients`` concurrent bodies of ``--mb`` MB each, sent with a ``Content-Length`` and then chunked, once
with the default limit (64 MiB: refused ``413``) and once with the limit raised past the bodies (accepted
and forwarded: the memory the limit saves). Printed per run: the answers, and the proxy's peak-RSS growth
(``VmHWM`` after ``/proc/<pid>/clear_refs`` reset it, minus the RSS before). Linux only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx

UPSTREAM = r"""
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok": true}'})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def _status(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _chunks(size: int, piece: int = 1 << 20) -> Iterator[bytes]:
    block = b"x" * piece
    for _ in range(size // piece):
        yield block


def _send(url: str, size: int, chunked: bool, answers: list[str]) -> None:
    try:
        content = _chunks(size) if chunked else b"x" * size
        response = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=600)
        answers.append(str(response.status_code))
    except httpx.HTTPError as exc:
        answers.append(type(exc).__name__)


def _run(
    upstream: str, limit: int | None, size: int, clients: int, chunked: bool
) -> tuple[Counter[str], float]:
    args = [sys.executable, "-m", "otel_capture._cli.main", "proxy", "--upstream", upstream]
    if limit is not None:
        args += ["--max-request-bytes", str(limit)]
    proxy = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert proxy.stdout is not None
    url = (
        proxy.stdout.readline().strip().removeprefix("listening on ")
        + "/ng-rollout/bench/v1/chat/completions"
    )
    try:
        httpx.post(url, json={"model": "warm-up"}, timeout=60)
        before = _status(proxy.pid)["VmRSS"]
        Path(f"/proc/{proxy.pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        answers: list[str] = []
        threads = [threading.Thread(target=_send, args=(url, size, chunked, answers)) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        peak = _status(proxy.pid)["VmHWM"]
    finally:
        proxy.terminate()
        proxy.communicate(timeout=60)
    return Counter(answers), (peak - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="size of each body, MB (default 200)")
    parser.add_argument("--clients", type=int, default=4, help="bodies sent at once (default 4)")
    args = parser.parse_args()
    size = args.mb * 1024 * 1024
    port = _free_port()
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port)])
    try:
        time.sleep(1.0)  # the upstream binds its port
        print(f"{args.clients} concurrent bodies of {args.mb} MB each; the proxy's peak RSS growth:")
        for label, limit in (("limit 64 MiB (default)", None), (f"limit raised past {args.mb} MB", size * 2)):
            for chunked in (False, True):
                answers, growth = _run(f"http://127.0.0.1:{port}", limit, size, args.clients, chunked)
                how = "chunked       " if chunked else "Content-Length"
                print(f"  {label:28} {how}  answers {dict(answers)}  peak RSS +{growth:8.1f} MiB")
    finally:
        upstream.terminate()
        upstream.communicate(timeout=60)


if __name__ == "__main__":
    main()
