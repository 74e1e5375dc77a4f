"""What the writer thread spends per call, by how long the call lasts: under the in-flight marker delay
(20 ms: the line alone) and over it (the ``+`` marker written, then the line, the marker read and removed).

    python -m bench.bench_marker [--calls N] [--rounds N] [--long MS,...] [--gap MS]

One ``JsonlWriter`` on a temporary directory, calls made one at a time as a model server makes them
(``begin``, the call's duration on the event loop, ``submit``, wait until durable), the writer thread's
CPU read from its ``schedstat`` (it is named ``otel-capture-wr`` in the kernel), user and system apart
from its ``stat``, and its wake-ups: its voluntary context switches (each a time it blocked, on its queue,
the GIL, a lock or a sync, and was woken again), from its ``status``. On a shared or virtual machine a
wake-up of a thread whose caches went cold costs far more than the system calls around it, so the
wake-ups say where the CPU goes when the CPU figures move with the machine's load. Side by side in
rotating rounds: calls of 0 ms, of 30 ms, and of 30 ms with the event loop busy meanwhile (a task that
runs Python for 2 ms at a time, as a model server's loop serves other requests), and calls of 30 ms made
8 at once, each its own new rollout (as single-turn RL inside vLLM makes them: every call creates its
rollout's files). A model server's calls
(vLLM's: 0.1 s and up on CPU) all take the 30 ms path: this is the writer's share of ``bench_vllm``'s
per-call cost, without vLLM. The busy row shows what a busy loop adds: each system call of the writer
lets the GIL go, and the loop, which wants it, takes it; the writer then waits for it again (more
wake-ups, and the switch interval's delay each time). Each row also gives the median wait from a line's
hand-off until it is durable; no call is begun in a round after ``ROUND_BUDGET_S``, since with the loop
busy a call can wait seconds (the writer, back from each system call, loses the GIL to a loop that gives
it up and takes it back at every iteration).

``--gap MS`` adds two rows of 8 rollouts that call again every MS ms (a multi-turn rollout's tool step), the
writer's idle close (``IDLE_CLOSE``) at 1 s, as before ``fca04d7``, and at its value now, in the same rotated
rounds: whether a rollout's next call after a pause finds its files open or opens, checks and creates them
again (and the idle close removes its marker and closes them in between).

A last table separates the machine from the writer: the same fixed work, in a plain thread, done back to
back and after sleeping as long as each row's call lasts: the writer's system calls (open for append,
five 1 KiB writes and ``fstat`` calls, ``fsync``, close) and, as a control, a pure-Python loop. Where the
system calls cost more after a sleep and the Python loop does not, the writer's CPU per call grows with the
call's length because of what a wake-up costs the kernel's I/O path on this machine, not because of the
writer's work (on the 2-core VM of docs/performance.md: 137 us back to back, 330-380 us after 20 ms to
0.8 s asleep; the Python loop unchanged).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from bench import _harness as H
from otel_capture._capture import LoopWaiter
from otel_capture._store import JsonlWriter
from otel_capture._store import writer as writer_module
from otel_capture._store.writer import IDLE_CLOSE, MARKER_DELAY, WRITER_THREAD_KERNEL_NAME

LINE = b'{"model_call_id":"x","dialect":"chat","request":{"model":"m"},"response":{}}' + b" " * 1000 + b"\n"


def _writer_cpu() -> tuple[float, float, float]:
    """(on CPU, user, system) of this process's writer thread, in ms."""
    (writer,) = [t for t in H.thread_cpu().values() if t.name == WRITER_THREAD_KERNEL_NAME]
    return writer.on_cpu * 1000, writer.user * 1000, writer.system * 1000


def _writer_wakeups() -> int:
    """The writer thread's voluntary context switches so far (``voluntary_ctxt_switches``)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() != WRITER_THREAD_KERNEL_NAME:
                    continue
            with open(f"/proc/self/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        return int(line.split()[1])
        except OSError:
            continue
    raise LookupError("no writer thread")


BUSY_SLICE = 0.002
"""Seconds of Python the busy loop's task runs between two yields to the event loop."""


async def _busy(stop: asyncio.Event) -> None:
    """Keep the event loop busy (and the GIL wanted) until ``stop``: Python for :data:`BUSY_SLICE`, a
    yield, again."""
    while not stop.is_set():
        until = time.perf_counter() + BUSY_SLICE
        while time.perf_counter() < until:
            pass
        await asyncio.sleep(0)


async def _round(
    writer: JsonlWriter,
    duration_s: float,
    calls: int,
    n: int,
    busy: bool = False,
    at_once: int = 1,
    again: tuple[float, float] | None = None,
    budget_s: float = float("inf"),
) -> Figures:
    """One row's round: at most ``calls`` calls, no new ones after ``budget_s`` seconds (a busy loop can
    starve the writer of the GIL for seconds per call). ``again``: ``(gap_s, idle_close_s)``: the same
    ``at_once`` rollouts call again every ``gap_s`` seconds, the writer's idle close at ``idle_close_s``;
    the gaps are in the window."""
    loop = asyncio.get_running_loop()
    kept_idle = writer_module.IDLE_CLOSE
    if again is not None:
        writer_module.IDLE_CLOSE = again[1]
    stop = asyncio.Event()
    busy_task = asyncio.create_task(_busy(stop)) if busy else None
    before, woken = _writer_cpu(), _writer_wakeups()
    until = time.monotonic() + budget_s
    waits: list[float] = []

    async def call(i: int) -> None:
        model_call_id = f"{n:08x}{i:024x}"
        rollout_id = f"r{n}-{i}" if at_once > 1 else "bench"  # vLLM's way: every call its own rollout
        if again is not None:  # a multi-turn rollout's next call, after a tool step
            rollout_id = f"g{n}-{i % at_once}"
        writer.begin(rollout_id, model_call_id)
        if duration_s:
            await asyncio.sleep(duration_s)
        future = loop.create_future()
        submitted = time.perf_counter()
        writer.submit(rollout_id, LINE, model_call_id, None, LoopWaiter(loop, future))
        await future
        waits.append((time.perf_counter() - submitted) * 1000)

    made = 0
    for first in range(0, calls, at_once):
        if time.monotonic() > until:
            break
        group = range(first, min(calls, first + at_once))
        await asyncio.gather(*(call(i) for i in group))
        made += len(group)
        if again is not None:
            await asyncio.sleep(again[0])
    after, woke = _writer_cpu(), _writer_wakeups()
    writer_module.IDLE_CLOSE = kept_idle
    stop.set()
    if busy_task is not None:
        await busy_task
    on_cpu, user, system = ((a - b) * 1000 / made for a, b in zip(after, before, strict=True))
    return Figures(on_cpu, user, system, (woke - woken) / made, statistics.median(waits), made)


Row = tuple[float, bool, int, tuple[float, float] | None]


class Figures(NamedTuple):
    """A round's writer CPU per call (on CPU, user, system, in us), wake-ups per call, the median wait from a
    line's hand-off until it was durable (ms), and the calls made."""

    on_cpu: float
    user: float
    system: float
    wakeups: float
    waited_ms: float
    made: int


ROUND_BUDGET_S = 20.0
"""No new call in a round after this long: with the loop busy, a call can wait seconds for the writer."""
ROWS: dict[str, Row] = {
    "0 ms": (0.0, False, 1, None),
    "30 ms": (0.03, False, 1, None),
    "30 ms, loop busy": (0.03, True, 1, None),
    "30 ms, 8 at once, new rollouts": (0.03, False, 8, None),
}
"""Each row's call duration, whether the event loop is busy meanwhile, how many calls run at once (more
than one: each call its own new rollout, as in single-turn RL inside vLLM: every call creates its files),
and, for ``--gap`` rows, the gap after which the same rollouts call again and the idle close used."""


async def _main(calls: int, rounds: int, rows: dict[str, Row]) -> tuple[dict[str, list[Figures]], bool]:
    """The rounds' figures, and whether the lines on disk are exactly the calls made."""
    found: dict[str, list[Figures]] = {label: [] for label in rows}
    with tempfile.TemporaryDirectory(prefix="bench-marker-") as tmp:
        writer = JsonlWriter(Path(tmp) / "calls")
        writer.flush(10)  # its thread has started (and named itself)
        try:
            await _round(writer, 0.0, 10, 999)  # the state directory and the file made before counting
            labels = list(rows)
            for n in range(rounds):
                for label in labels[n % len(labels) :] + labels[: n % len(labels)]:  # rotated each round
                    duration_s, busy, at_once, again = rows[label]
                    figures = await _round(writer, duration_s, calls, n, busy, at_once, again, ROUND_BUDGET_S)
                    found[label].append(figures)
        finally:
            writer.close()
        lines = H.count_lines(Path(tmp) / "calls")
    return found, lines == 10 + sum(figures.made for row in found.values() for figures in row)


MACHINE_REPEATS = 12
"""Times each fixed piece of work is done per sleep, in the machine table."""


def _syscalls(path: Path) -> None:
    """The writer's system calls for one call's line, without the writer: open, write, fstat, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for _ in range(5):
            os.write(fd, LINE)
            os.fstat(fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def _python() -> None:
    """A fixed piece of pure Python, no system call: the control."""
    total = 0
    for i in range(20_000):
        total += i


def _machine(sleeps_s: list[float]) -> list[list[object]]:
    """Median CPU (us, this thread's clock) of each fixed piece of work after each sleep."""
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="bench-marker-machine-") as tmp:
        path = Path(tmp) / "work.jsonl"
        for label, work in (("syscalls + fsync", lambda: _syscalls(path)), ("pure Python", _python)):
            row: list[object] = [label]
            for sleep_s in sleeps_s:
                cpu = []
                for _ in range(MACHINE_REPEATS):
                    time.sleep(sleep_s)
                    before = time.thread_time_ns()
                    work()
                    cpu.append((time.thread_time_ns() - before) / 1000)
                row.append(statistics.median(cpu))
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per round (default 100)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per row (default 6)")
    parser.add_argument(
        "--long",
        default="",
        help="extra rows: calls lasting these many ms each, comma-separated (e.g. 800,1200: as long as a "
        "tiny model's calls take on a CPU vLLM, where the writer sleeps between the marker and the line)",
    )
    parser.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="extra rows: 8 rollouts calling again every GAP ms (a multi-turn rollout's tool step), with the "
        f"writer's idle close at 1 s (before fca04d7) and at {IDLE_CLOSE:g} s (now), side by side",
    )
    args = parser.parse_args()
    found_rows = dict(ROWS)
    for ms in filter(None, args.long.split(",")):
        found_rows[f"{float(ms):g} ms"] = (float(ms) / 1000, False, 1, None)
    if args.gap:
        for idle_s in (1.0, IDLE_CLOSE):
            label = f"30 ms, 8 at once, again after {args.gap:g} ms, idle close {idle_s:g} s"
            found_rows[label] = (0.03, False, 8, (args.gap / 1000, idle_s))
    print(H.machine_line(), flush=True)
    found, complete = asyncio.run(_main(args.calls, args.rounds, found_rows))
    rows = []
    for label, rounds in found.items():
        fields = ("on_cpu", "user", "system", "wakeups", "waited_ms")
        medians = [statistics.median(getattr(r, field) for r in rounds) for field in fields]
        rows.append([label, *medians, sum(r.made for r in rounds)])
    H.print_table(
        f"writer thread CPU per call, us, its wake-ups per call and the wait from a line's hand-off until "
        f"durable, ms (medians of {args.rounds} rounds of up to {args.calls} calls, none begun after "
        f"{ROUND_BUDGET_S:g} s; the marker delay is {MARKER_DELAY * 1000:.0f} ms)",
        ["call lasts", "on CPU", "user", "system", "wake-ups", "durable after", "calls"],
        rows,
        [
            f"ratio 30 ms / 0 ms: {H.ratio(rows[1][1], rows[0][1])}; loop busy / idle: "
            f"{H.ratio(rows[2][1], rows[1][1])}",
            f"lines on disk equal the calls: {complete}",
        ],
    )
    sleeps_s = [0.0, *sorted({row[0] for row in found_rows.values() if row[0]})]
    H.print_table(
        f"the machine: CPU of fixed work back to back and after a sleep, us (medians of {MACHINE_REPEATS})",
        ["work", *(f"after {s * 1000:g} ms" for s in sleeps_s)],
        _machine(sleeps_s),
        ["the writer's CPU per call grows with the call's length where the system calls' row grows too"],
    )
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
