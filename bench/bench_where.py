"""Where a captured call's time goes over HTTP, by whose code: a goal's servers under load, py-spy on each.

    python -m bench.bench_where [--goal 1|2|3] [--seconds N] [--top N]

A goal's servers (as ``bench_goals`` starts them), each in its own process under ``wrk`` at 64 connections,
one after the other. Goal 2 (the default): the raw ASGI app alone, the capture middleware with no exporter
(every call passes: correlation and its span context, no record), the library capture (durable records) and
the barest durable capture (``bench/_floors.py``). Goal 1: the Starlette app alone, under
``opentelemetry-instrument`` with no exporter, with the ``model_call_jsonl`` exporter, and inside the durable
floor. Goal 3: the raw ASGI app alone, then in front of it (in its own process, not sampled) the proxy
without a capture directory, the proxy with one, and the barest forwarding ASGI app on the proxy's stack.

While each serves, ``py-spy`` (needs ``pip install py-spy``) samples whichever thread holds the GIL 1,000
times a second; a sample is one millisecond of that thread's Python (or the C it called, the kernel's
included) and goes to the innermost frame outside the standard library: each module of ``otel_capture`` by
name, uvicorn, OpenTelemetry, the bench's app and floor, or the event loop itself (a sample wholly in the
standard library: asyncio, uvloop's callbacks). The writer threads' samples are counted apart. py-spy takes
the GIL's last holder for its holder, so the event loop waiting to take the GIL back from the writer is
counted on the line where it waits (a call, where the interpreter lets the GIL go): read modules, not single
lines, and a column's sum as an upper bound of the GIL's held time.

Printed per call (the samples' milliseconds over the calls served while sampling), in microseconds, side by
side, with each server's CPU per call (user + system, all threads) in the same window: what the capture's
own code costs on the event loop and in its writer, module by module, against what the servers beside it
cost. The sum of a column is the GIL's held time per call, below its CPU per call by the time the threads
spent in system calls without the GIL (the writer's ``fsync``, the loop's ``epoll_wait``).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench import _harness as H
from bench import _pyspy
from bench import _rounds as R
from bench._servers import REQUEST_BODY

CONCURRENCY = 64
UPSTREAM = "{upstream}"  # _rounds.Servers puts the upstream's URL there (goal 3)


def _starlette(*extra: str) -> list[str]:
    return H.server_argv("bare", "--app", "starlette", *extra)


def _durable(name: str, argv: list[str], work: Path, upstream: str | None = None) -> R.Spec:
    """A server writing records into its own directory under ``work``."""
    directory = work / name
    return R.Spec(name, [*argv, "--capture-dir", str(directory)], capture_dir=directory, upstream=upstream)


Server = tuple[str, Callable[[Path], R.Spec]]  # the column's label, its Spec in a work directory

# per goal: its servers; the column of the capture (the rows are ordered by it) is the third
GOALS: dict[str, list[Server]] = {
    "1": [
        ("app alone", lambda w: R.Spec("app", _starlette(), prefixed=False)),
        (
            "zero-code, no exporter",
            lambda w: R.Spec("passing", [R.INSTRUMENT, *_starlette()], env=R.zero_code_env(None)),
        ),
        (
            "zero-code capture",
            lambda w: R.Spec(
                "capture",
                [R.INSTRUMENT, *_starlette()],
                env=R.zero_code_env(w / "capture"),
                capture_dir=w / "capture",
            ),
        ),
        ("durable floor", lambda w: _durable("floor", H.server_argv("floor", "--app", "starlette"), w)),
    ],
    "2": [
        ("app alone", lambda w: R.Spec("app", H.server_argv("bare"))),
        ("middleware, no record", lambda w: R.Spec("passing", H.server_argv("spans"))),
        ("library capture", lambda w: _durable("capture", H.server_argv("capture"), w)),
        ("durable floor", lambda w: _durable("floor", H.server_argv("floor"), w)),
    ],
    "3": [
        ("upstream alone", lambda w: R.Spec("app", H.server_argv("bare"))),
        (
            "proxy, no capture dir",
            lambda w: R.Spec("passing", H.server_argv("proxy", "--upstream", UPSTREAM), upstream="app"),
        ),
        (
            "proxy with capture",
            lambda w: _durable("capture", H.server_argv("proxy", "--upstream", UPSTREAM), w, upstream="app"),
        ),
        (
            "ASGI forwarding floor",
            lambda w: R.Spec("floor", H.server_argv("floor-forward", "--upstream", UPSTREAM), upstream="app"),
        ),
    ],
}

WRITER_THREADS = ("otel-capture-writer", "floor-writer")
LOOP = "event loop (stdlib, uvloop)"
_FRAME_PATH = re.compile(r"\((.*):\d+\)$")


def owner(frame: str) -> str | None:
    """Whose code a py-spy frame (``function (path:line)``) is in: an ``otel_capture`` module by its path
    from the package (the exporter too), the bench's own files as one, else :func:`bench._pyspy.owner_of`'s
    name; ``None`` for the standard library and a frame without a path."""
    match = _FRAME_PATH.search(frame)
    if match is None:
        return None
    path = match.group(1)
    for package in ("otel_capture/", "exporters/"):
        at = path.rfind("/" + package)
        if at >= 0 or path.startswith(package):
            return path[at + 1 :] if at >= 0 else path
    if "/bench/" in path or path.startswith("bench/"):
        return "bench (the app, the floor)"
    return _pyspy.owner_of(frame)


def by_owner(raw: str) -> collections.Counter[str]:
    """Samples per owner in py-spy's ``--format raw --threads`` text: each to its innermost frame's
    :func:`owner`, the event loop's when every frame is the standard library's; a writer thread's apart."""
    return _pyspy.by_owner(raw, owner, LOOP, WRITER_THREADS)


def measure(
    server: H.ServerProcess, prefixed: bool, seconds: int, raw: Path
) -> tuple[dict[str, float], float, int]:
    """One server under load with py-spy attached: microseconds per call by owner, CPU per call, calls."""
    rollouts = R.ROLLOUTS if prefixed else 0
    H.run_load(server.url, body=REQUEST_BODY, concurrency=CONCURRENCY, seconds=1, rollouts=rollouts)
    with _pyspy.sampling(server.pid, raw, threads=True):
        cpu = H.cpu_seconds(server.pid)
        load = H.run_load(
            server.url, body=REQUEST_BODY, concurrency=CONCURRENCY, seconds=seconds, rollouts=rollouts
        )
        cpu = H.cpu_seconds(server.pid) - cpu
    if load.errors:
        raise SystemExit(f"{server.name}: {load.errors} calls failed")
    samples = by_owner(raw.read_text(errors="replace")) if raw.exists() else None
    if not samples:  # py-spy could not attach (ptrace refused) or wrote nothing: no figure, not zeros
        raise SystemExit(
            f"{server.name}: py-spy recorded no sample of pid {server.pid} (can it ptrace here?)"
        )
    calls = load.requests
    return {o: n * 1000 / calls for o, n in samples.items()}, cpu / calls * 1e6, calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--goal", choices=sorted(GOALS), default="2", help="whose servers (default 2)")
    parser.add_argument("--seconds", type=int, default=8, help="seconds of load per server (default 8)")
    parser.add_argument("--top", type=int, default=30, help="rows: the owners costing the capture most")
    args = parser.parse_args(argv)
    servers = GOALS[args.goal]
    work = Path(tempfile.mkdtemp(prefix="otel-capture-bench-where-"))
    print(f"== bench_where: a call's GIL time by whose code, goal {args.goal}'s servers under wrk, py-spy ==")
    print(H.machine_line(work))
    print(
        f"{H.loadgen_name()}, {CONCURRENCY} connections, {args.seconds} s per server, py-spy --gil 1,000 Hz"
    )
    specs = [make(work) for _, make in servers]
    results = []
    try:
        # all started first (an upstream before the proxies that name it; goal 3's is its first column too),
        # then measured one at a time: a server nobody calls costs the others nothing
        with R.Servers() as running:
            for spec in specs:
                running.start(spec)
            for spec in specs:
                raw = work / f"{spec.name}.raw"
                results.append(measure(running.running[spec.name], spec.prefixed, args.seconds, raw))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    labels = [label for label, _ in servers]
    capture = results[2][0]
    owners = sorted({o for us, _, _ in results for o in us}, key=lambda o: -capture.get(o, 0))
    rows = [[o, *(us.get(o, 0.0) for us, _, _ in results)] for o in owners[: args.top]]
    rows.append(["GIL held, all owners", *(sum(us.values()) for us, _, _ in results)])
    rows.append(["CPU per call (process)", *(cpu for _, cpu, _ in results)])
    ours = [o for o in owners if o.removeprefix("writer: ").startswith(("otel_capture/", "exporters/"))]
    rows.append(
        ["otel_capture's own code, all modules", *(sum(us.get(o, 0) for o in ours) for us, _, _ in results)]
    )
    H.print_table(
        "us per call of GIL held, by the innermost code outside the standard library",
        ["code", *labels],
        rows,
        [
            f"calls sampled: {', '.join(f'{label} {calls:,}' for label, (_, _, calls) in zip(labels, results, strict=True))}",
            "a server's CPU per call is above its GIL time by its threads' system calls without the GIL",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
