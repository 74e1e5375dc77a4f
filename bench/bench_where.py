"""Where a captured call's time goes over HTTP, by whose code: goal 2's servers under load, py-spy on each.

    python -m bench.bench_where [--seconds N] [--top N]

Goal 2's servers (``bench_goals``), each in its own process under ``wrk`` at 64 connections: the raw ASGI
app alone, the capture middleware with no exporter (every call passes: correlation and its span context,
no record), the library capture (durable records) and the barest durable capture (``bench/_floors.py``).
While each serves, ``py-spy`` (needs ``pip install py-spy``) samples whichever thread holds the GIL 1,000
times a second; a sample is one millisecond of that thread's Python (or the C it called, the kernel's
included) and goes to the innermost frame outside the standard library: each module of ``otel_capture``
by name, uvicorn, OpenTelemetry, the bench's app and floor, or the event loop itself (a sample wholly in
the standard library: asyncio, uvloop's callbacks). The writer threads' samples are counted apart.

Printed per call (the samples' milliseconds over the calls served while sampling), in microseconds, side
by side, with each server's CPU per call (user + system, all threads) in the same window: what the
capture's own code costs on the event loop and in its writer, module by module, against what the middleware
alone and the floor cost. The sum of a column is the GIL's held time per call, below its CPU per call by
the time the threads spent in system calls without the GIL (the writer's ``fsync``, the loop's
``epoll_wait``).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import tempfile
from pathlib import Path

from bench import _harness as H
from bench import _pyspy
from bench._servers import REQUEST_BODY

CONCURRENCY = 64

# (key, label, bench._servers variant, whether it writes records)
SERVERS = (
    ("bare", "app alone", "bare", False),
    ("passing", "middleware, no record", "spans", False),
    ("capture", "library capture", "capture", True),
    ("floor", "durable floor", "floor", True),
)

WRITER_THREADS = ("otel-capture-writer", "floor-writer")
LOOP = "event loop (stdlib, uvloop)"
_FRAME_PATH = re.compile(r"\((.*):\d+\)$")


def owner(path: str) -> str | None:
    """Whose code a frame's file is: an ``otel_capture`` module by its path from the package (exporters
    too), the bench's own files as one, else :func:`bench._pyspy.owner_of`'s name; ``None`` for the
    standard library."""
    for package in ("otel_capture/", "exporters/"):
        at = path.rfind("/" + package)
        if at >= 0 or path.startswith(package):
            return path[at + 1 :] if at >= 0 else path
    if "/bench/" in path or path.startswith("bench/"):
        return "bench (the app, the floor)"
    return _pyspy.owner_of(f"x ({path}:1)")


def by_owner(raw: str) -> collections.Counter[str]:
    """Samples per owner in py-spy's ``--format raw --threads`` text (``thread (TID): NAME;frame;...
    count``): each to its innermost frame's owner, the event loop's when every frame is the standard
    library's; a writer thread's prefixed ``writer:``."""
    found: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        writer = any(thread.endswith(": " + name) for name in WRITER_THREADS)
        name = LOOP
        for frame in reversed(frames):
            match = _FRAME_PATH.search(frame)
            found_owner = owner(match.group(1)) if match else None
            if found_owner is not None:
                name = found_owner
                break
        found[("writer: " + name) if writer else name] += int(count)
    return found


def measure(variant: str, records: bool, seconds: int, work: Path) -> tuple[dict[str, float], float, int]:
    """One server under load with py-spy attached: microseconds per call by owner, CPU per call, calls."""
    extra = ("--capture-dir", str(work / variant)) if records else ()
    raw = work / f"{variant}.raw"
    with H.ServerProcess(H.server_argv(variant, *extra)) as server:
        H.run_load(server.url, body=REQUEST_BODY, concurrency=CONCURRENCY, seconds=1)  # warm up
        with _pyspy.sampling(server.pid, raw, threads=True):
            cpu = H.cpu_seconds(server.pid)
            load = H.run_load(server.url, body=REQUEST_BODY, concurrency=CONCURRENCY, seconds=seconds)
            cpu = H.cpu_seconds(server.pid) - cpu
        if load.errors:
            raise SystemExit(f"{variant}: {load.errors} calls failed")
    calls = load.requests
    samples = by_owner(raw.read_text(errors="replace")) if raw.exists() else None
    if not samples:  # py-spy could not attach (ptrace refused) or wrote nothing: no figure, not zeros
        raise SystemExit(f"{variant}: py-spy recorded no sample of pid {server.pid} (can it ptrace here?)")
    return {o: n * 1000 / calls for o, n in samples.items()}, cpu / calls * 1e6, calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=8, help="seconds of load per server (default 8)")
    parser.add_argument("--top", type=int, default=30, help="rows: the owners costing the capture most")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="otel-capture-bench-where-"))
    print("== bench_where: a call's GIL time by whose code, goal 2's servers under wrk, py-spy ==")
    print(H.machine_line(work))
    print(
        f"{H.loadgen_name()}, {CONCURRENCY} connections, {args.seconds} s per server, py-spy --gil 1,000 Hz"
    )
    try:
        results = {key: measure(variant, records, args.seconds, work) for key, _, variant, records in SERVERS}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = [key for key, *_ in SERVERS]
    owners = sorted(
        {o for us, _, _ in results.values() for o in us}, key=lambda o: -results["capture"][0].get(o, 0)
    )
    rows = [[o, *(results[k][0].get(o, 0.0) for k in keys)] for o in owners[: args.top]]
    rows.append(["GIL held, all owners", *(sum(results[k][0].values()) for k in keys)])
    rows.append(["CPU per call (process)", *(results[k][1] for k in keys)])
    ours = [o for o in owners if o.removeprefix("writer: ").startswith(("otel_capture/", "exporters/"))]
    rows.append(
        ["otel_capture's own code, all modules", *(sum(results[k][0].get(o, 0) for o in ours) for k in keys)]
    )
    H.print_table(
        "us per call of GIL held, by the innermost code outside the standard library",
        ["code", *(label for _, label, _, _ in SERVERS)],
        rows,
        [
            f"calls sampled: {', '.join(f'{label} {results[k][2]:,}' for k, label, _, _ in SERVERS)}",
            "a server's CPU per call is above its GIL time by its threads' system calls without the GIL",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
