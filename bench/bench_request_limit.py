"""The proxy's memory under oversized request bodies (issue 15, item 7).

    python -m bench.bench_request_limit [--mb 200] [--clients 4]

An ``otel-capture proxy`` process in front of an upstream that answers at once (``_servers.py``'s
``bare``) receives ``--clients`` concurrent bodies of ``--mb`` MB each, sent with a ``Content-Length`` and
then chunked, once with the default limit (64 MiB: refused ``413``) and once with the limit raised past the bodies (accepted
and forwarded: the memory the limit saves). Printed per run: the answers, and the proxy's peak-RSS growth
(``VmHWM`` after ``/proc/<pid>/clear_refs`` reset it, minus the RSS before). Linux only.
"""

from __future__ import annotations

import argparse
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator

import httpx

from bench import _harness as H


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
    args = [H.PYTHON, "-m", "otel_capture", "proxy", "--upstream", upstream]
    if limit is not None:
        args += ["--max-request-bytes", str(limit)]
    proxy = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=H.REPO)
    assert proxy.stdout is not None
    url = (
        proxy.stdout.readline().strip().removeprefix("listening on ")
        + "/ng-rollout/bench/v1/chat/completions"
    )
    try:
        httpx.post(url, json={"model": "warm-up"}, timeout=60)
        before = H.status_kib("VmRSS", proxy.pid)
        H.reset_peak_rss(proxy.pid)
        answers: list[str] = []
        threads = [threading.Thread(target=_send, args=(url, size, chunked, answers)) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        peak = H.status_kib("VmHWM", proxy.pid)
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
    with H.ServerProcess(H.server_argv("bare"), name="upstream") as upstream:
        print(f"{args.clients} concurrent bodies of {args.mb} MB each; the proxy's peak RSS growth:")
        for label, limit in (("limit 64 MiB (default)", None), (f"limit raised past {args.mb} MB", size * 2)):
            for chunked in (False, True):
                answers, growth = _run(upstream.url, limit, size, args.clients, chunked)
                how = "chunked       " if chunked else "Content-Length"
                print(f"  {label:28} {how}  answers {dict(answers)}  peak RSS +{growth:8.1f} MiB")


if __name__ == "__main__":
    main()
