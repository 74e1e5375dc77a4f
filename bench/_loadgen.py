"""FALLBACK load generator, used only when ``wrk`` is not installed (``apt-get install wrk``).

A closed loop of ``--concurrency`` keep-alive HTTP/1.1 connections on raw asyncio streams (no HTTP
library: it must cost far less per request than the servers it loads), each POSTing the body to
``<prefix><n % rollouts><suffix>`` for ``--seconds``. Prints one JSON line: requests, seconds, p50/p99 in
ms, errors. It runs in its own process; the benchmark reports its CPU so a reader can see whether it, and
not the server, was the limit (it is slower than wrk: compare its ceiling against the bare upstream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from urllib.parse import urlsplit


async def _connection(
    host: str,
    port: int,
    requests: list[bytes],
    start: int,
    deadline: float,
    latencies: list[float],
    errors: list[int],
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    n = start
    try:
        while time.perf_counter() < deadline:
            request = requests[n % len(requests)]
            n += 1
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            chunked = False
            status_ok = head[9:10] == b"2"
            for line in head.split(b"\r\n"):
                lower = line.lower()
                if lower[:15] == b"content-length:":
                    length = int(line[15:])
                elif lower.startswith(b"transfer-encoding:") and b"chunked" in lower:
                    chunked = True
            if chunked:  # a streamed answer: chunks until the empty one
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            elif length:
                await reader.readexactly(length)
            latencies.append(time.perf_counter() - t0)
            if not status_ok:
                errors.append(1)
    except (OSError, asyncio.IncompleteReadError):
        errors.append(1)
    finally:
        writer.close()


async def _main(args: argparse.Namespace) -> None:
    url = urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    with open(args.body_file, "rb") as handle:
        body = handle.read()
    paths = (
        [f"{args.prefix}{i}{args.suffix}" for i in range(args.rollouts)] if args.rollouts else [args.suffix]
    )
    requests = [
        (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
        for path in paths
    ]
    latencies: list[float] = []
    errors: list[int] = []
    start = time.perf_counter()
    deadline = start + args.seconds
    await asyncio.gather(
        *(_connection(host, port, requests, i, deadline, latencies, errors) for i in range(args.concurrency))
    )
    elapsed = time.perf_counter() - start
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000 if latencies else 0.0

    print(
        json.dumps(
            {
                "requests": len(latencies),
                "seconds": elapsed,
                "p50_ms": pct(0.50),
                "p99_ms": pct(0.99),
                "errors": len(errors),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--prefix", default="/ng-rollout/bench-")
    parser.add_argument("--suffix", default="/v1/chat/completions")
    parser.add_argument("--body-file", required=True)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
