"""The proxy's upstream client, measured: minimal forwarders, one client library each, side by side.

    python bench/bench_forwarders.py [--quick] [--seconds N] [--rounds N] [--python-loadgen]

An upstream that answers at once (the raw ASGI app, its own process) is called directly, and through pure
ASGI forwarders under the same uvicorn (one worker, httptools and uvloop when installed) that do nothing
but forward the request and stream the answer back, with:

* ``aiohttp``: one ``aiohttp.ClientSession`` (``TCPConnector(limit=0)``);
* ``aiohttp-conn``: aiohttp's ``TCPConnector`` and response protocol without ``ClientSession``: the request
  head and body written in one write, the answer read by aiohttp's parser (what ``otel-capture proxy``'s
  ``_Pool`` does);
* ``httpcore``: one ``httpcore.AsyncConnectionPool`` (httpx's transport, without httpx);
* ``httpx``: one ``httpx.AsyncClient``;
* ``httpx x16``: 16 ``httpx.AsyncClient``s round-robin, the pool sharding ``otel-capture proxy`` used
  before it moved to one ``aiohttp.ClientSession``;
* ``raw``: no client library: an asyncio protocol with httptools' response parser (the parser uvicorn
  serves with) and a stack of idle kept-alive connections, written for this benchmark only: the floor a
  forwarding client can reach on this stack;

and, for reference, ``otel-capture proxy`` itself without ``--capture-dir`` (its HTTP server span, its
capture middleware passing spans only, its aiohttp session and disconnect watcher). 64 concurrent, wrk.
Columns as in ``bench_goals.py``: req/s, the forwarder's CPU per call (its process), the upstream's, and
how busy the rest of the machine was.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H
from bench_goals import CONCURRENCY, Servers, Spec, rounds_of, run_table

FORWARDERS = [
    ("fwd-aiohttp", "forwarder: one aiohttp.ClientSession"),
    ("fwd-aiohttp-conn", "forwarder: the proxy's own client (_Pool)"),
    ("fwd-httpcore", "forwarder: one httpcore.AsyncConnectionPool"),
    ("fwd-httpx", "forwarder: one httpx.AsyncClient"),
    ("fwd-httpx16", "forwarder: 16 httpx.AsyncClients (the proxy's former shards)"),
    ("fwd-raw", "forwarder: asyncio protocol + httptools parser (bench-only floor)"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of 2 s")
    parser.add_argument("--seconds", type=int, help="seconds per measured run (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, help="rotated rounds per server (default 2; quick 1)")
    parser.add_argument("--python-loadgen", action="store_true")
    args = parser.parse_args(argv)
    seconds = args.seconds or (2 if args.quick else 3)
    rounds = args.rounds or (1 if args.quick else 2)
    fp = args.python_loadgen
    print(f"== bench_forwarders: the upstream client library on the proxy's hop, {CONCURRENCY} concurrent ==")
    print(H.machine_line())
    print(H.package_line())
    print(
        f"load generator: {H.loadgen_name(fp)}; {rounds} round(s) x {seconds} s per server, rotated, best kept"
    )
    t0 = time.monotonic()
    data = Path(tempfile.mkdtemp(prefix="otel-capture-fwd-"))
    specs = [Spec("upstream", H.server_argv("bare"))]
    specs += [
        Spec(name, H.server_argv(name, "--upstream", "{upstream}"), upstream="upstream")
        for name, _ in FORWARDERS
    ]
    specs.append(Spec("proxy-off", H.server_argv("proxy", "--upstream", "{upstream}"), upstream="upstream"))
    names = [s.name for s in specs]
    try:
        with Servers() as servers:
            for spec in specs:
                servers.start(spec)
            runs = rounds_of(
                servers, names, rounds, seconds, fp, upstreams={n: "upstream" for n in names[1:]}
            )
    finally:
        shutil.rmtree(data, ignore_errors=True)
    base = runs["upstream"]
    labels = dict(FORWARDERS)
    rows = [("upstream called directly", base, None)]
    rows += [(labels[name], runs[name], base) for name, _ in FORWARDERS]
    rows.append(("otel-capture proxy, no --capture-dir", runs["proxy-off"], base))
    run_table(
        "one HTTP hop in front of an upstream that answers at once",
        rows,
        [
            "CPU us/call: the forwarder's process; the upstream's is in its own column. No capture, no span in the "
            "forwarders; the proxy row has its server span and model-call span (spans only)",
            f"took {time.monotonic() - t0:.0f} s",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
