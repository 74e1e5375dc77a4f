"""Several processes appending to ONE rollout's capture file at once: throughput and proof of no
interleaving.

    python -m bench.bench_writers [--quick] [--processes 1,2,4] [--records N] [--inflight K] [--dir DIR]

Each writer process has its own ``JsonlWriter`` (the exporter's writer: group commit, ``flock(LOCK_EX)``
per append on the data file, ``fsync`` per file per batch) and appends ``--records`` lines (default 2,000;
quick 500) to the same ``<dir>/<rollout>.capture.jsonl``, keeping ``--inflight`` calls (default 16) in
flight, as a server does with concurrent calls. A reader process reads the file with
``read_available_model_call_records`` (shared lock) over and over while they write. Side by side, the
same processes append the same lines the per-call way of NeMo Gym 0.7.0 (open, ``flock``, write, flush,
``fsync``, unlock: one fsync per line, ``_gym_baseline.GymStore``).

Checked afterwards, for every run: every line parses as JSON and as a record; there are exactly
processes x records of them; every line is one whole record of one writer (its ``model_call_id`` names
the writer and the sequence number, the line equals what that writer submitted byte for byte); no line
is missing or duplicated; each writer's lines are in the order of its waves of calls; ``call_index`` is dense
0..n-1; and the concurrent reader never saw a damaged or torn line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench import _harness as H
from bench.bench_reader import source_lines

ROLLOUT = "bench-writers"


def _lines(writer: int, count: int) -> list[tuple[str, bytes]]:
    """``count`` record lines of writer ``writer`` (realistic ~2 KB Responses calls)."""
    sources, _ = source_lines()
    out = []
    for seq, source in zip(range(count), itertools.cycle(sources)):
        model_call_id = f"w{writer:02d}-{seq:07d}"
        out.append(
            (
                model_call_id,
                orjson.dumps(dict(source, model_call_id=model_call_id), option=orjson.OPT_APPEND_NEWLINE),
            )
        )
    return out


def _writer_process(mode: str, root: str, writer: int, count: int, inflight: int, go: Any, out: Any) -> None:
    lines = _lines(writer, count)
    if mode == "ours":
        from otel_capture._capture import LoopWaiter
        from otel_capture._store import JsonlWriter

        jsonl = JsonlWriter(root)
        go.wait()
        start = time.time()

        async def run() -> None:  # as the middleware waits: one LoopWaiter per call
            loop = asyncio.get_running_loop()
            for offset in range(0, count, inflight):
                waiters = [LoopWaiter(loop, loop.create_future()) for _ in lines[offset : offset + inflight]]
                for waiter, (mcid, line) in zip(waiters, lines[offset : offset + inflight], strict=True):
                    jsonl.submit(ROLLOUT, line, mcid, None, waiter)
                await asyncio.gather(*(waiter.future for waiter in waiters))

        asyncio.run(run())
        end = time.time()
        stats = jsonl.stats
        jsonl.close()
        out.put(
            {
                "writer": writer,
                "start": start,
                "end": end,
                "fsyncs": stats.fsyncs,
                "batches": stats.batches,
                "records": stats.records_written,
                "failures": stats.failures,
            }
        )
    else:
        from concurrent.futures import ThreadPoolExecutor

        from bench._gym_baseline import GymStore

        store = GymStore(Path(root))
        go.wait()
        start = time.time()
        # Gym runs each call's append in the default executor: `inflight` calls at once, one fsync each.
        with ThreadPoolExecutor(max_workers=inflight) as pool:
            for offset in range(0, count, inflight):
                list(pool.map(lambda item: store.append(ROLLOUT, item[1]), lines[offset : offset + inflight]))
        end = time.time()
        out.put(
            {
                "writer": writer,
                "start": start,
                "end": end,
                "fsyncs": count,
                "batches": count,
                "records": count,
                "failures": 0,
            }
        )


def _reader_process(root: str, stop: Any, out: Any) -> None:
    from otel_capture import CaptureStore, read_available_model_call_records

    store = CaptureStore(root)
    reads = damaged = torn = max_seen = 0
    while not stop.is_set():
        try:
            available = read_available_model_call_records(store, ROLLOUT)
        except FileNotFoundError:
            continue
        reads += 1
        damaged += len(available.invalid)
        torn += int(available.torn_tail)
        max_seen = max(max_seen, len(available.records))
        time.sleep(0.02)
    out.put({"reads": reads, "damaged": damaged, "torn": torn, "max_seen": max_seen})


def _run(mode: str, root: Path, processes: int, count: int, inflight: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    out, reader_out = ctx.Queue(), ctx.Queue()
    writers = [
        ctx.Process(target=_writer_process, args=(mode, str(root), w, count, inflight, go, out))
        for w in range(processes)
    ]
    reader = ctx.Process(target=_reader_process, args=(str(root), stop, reader_out))
    for p in writers:
        p.start()
    reader.start()
    time.sleep(1.0)  # let every child import and build its lines before the start signal
    go.set()
    results = [out.get(timeout=600) for _ in writers]
    stop.set()
    reader_result = reader_out.get(timeout=60)
    for p in [*writers, reader]:
        p.join(60)
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    return {
        "seconds": end - start,
        "records": sum(r["records"] for r in results),
        "fsyncs": sum(r["fsyncs"] for r in results),
        "batches": sum(r["batches"] for r in results),
        "failures": sum(r["failures"] for r in results),
        "reader": reader_result,
        "check": _check(root, processes, count, inflight),
    }


def _check(root: Path, processes: int, count: int, inflight: int) -> str:
    """Every line whole, parseable, from exactly one writer, in each writer's order; call_index dense.

    Order: calls in flight together have no order between them (they finish together), so a writer's
    lines must come in the order of its waves of ``inflight`` calls."""
    from otel_capture import CaptureStore, read_model_call_records

    expected = {mcid: line for w in range(processes) for mcid, line in _lines(w, count)}
    data = (root / f"{ROLLOUT}.capture.jsonl").read_bytes()
    problems = []
    if not data.endswith(b"\n"):
        problems.append("torn tail")
    seen: set[str] = set()
    last_wave = [-1] * processes
    for raw in data.splitlines(keepends=True):
        try:
            mcid = orjson.loads(raw)["model_call_id"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            problems.append(f"unparseable line: {raw[:80]!r}")
            continue
        if expected.get(mcid) != raw:
            problems.append(f"line {mcid} differs from what its writer submitted (interleaved?)")
        if mcid in seen:
            problems.append(f"duplicate {mcid}")
        seen.add(mcid)
        writer, seq = int(mcid[1:3]), int(mcid[4:])
        if seq // inflight < last_wave[writer]:
            problems.append(f"writer {writer} out of order at {seq}")
        last_wave[writer] = seq // inflight
    if len(seen) != processes * count:
        problems.append(f"{len(seen)} distinct lines, expected {processes * count}")
    records = read_model_call_records(CaptureStore(root), ROLLOUT)
    if [r.call_index for r in records] != list(range(len(records))):
        problems.append("call_index not dense")
    return "ok" if not problems else f"FAILED: {len(problems)} problem(s), first: {problems[0]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--processes", help="comma-separated writer process counts (default 1,2,4; quick 1,4)"
    )
    parser.add_argument("--records", type=int, help="records per writer process (default 2000; quick 500)")
    parser.add_argument("--inflight", type=int, default=16, help="calls in flight per writer (default 16)")
    parser.add_argument("--dir", help="where the files go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in (args.processes or ("1,4" if args.quick else "1,2,4")).split(",")]
    records = args.records or (500 if args.quick else 2000)
    base = Path(tempfile.mkdtemp(prefix="otel-capture-bench-writers-", dir=args.dir))
    print("== bench_writers: several processes appending to one rollout file ==")
    print(H.machine_line(base))
    print(
        f"{records:,} records (~2 KB lines) per writer process, {args.inflight} in flight per process; "
        "one reader process reading the file throughout"
    )
    rows = []
    all_ok = True
    try:
        for processes in counts:
            results = {}
            for mode in ("gym", "ours"):
                root = base / f"{mode}-{processes}"
                root.mkdir()
                results[mode] = _run(mode, root, processes, records, args.inflight)
                shutil.rmtree(root, ignore_errors=True)
            for mode, label in (
                ("gym", "baseline: per-call fsync (Gym 0.7.0)"),
                ("ours", "JsonlWriter (group commit)"),
            ):
                r = results[mode]
                rps = r["records"] / r["seconds"]
                reader = r["reader"]
                all_ok &= r["check"] == "ok" and reader["damaged"] == 0 and reader["torn"] == 0
                rows.append(
                    [
                        processes,
                        label,
                        rps,
                        f"{rps / (results['gym']['records'] / results['gym']['seconds']):.2f}x",
                        r["fsyncs"] / r["records"],
                        r["records"] / r["batches"],
                        r["failures"],
                        f"{reader['reads']} reads, {reader['damaged']} damaged, {reader['torn']} torn",
                        r["check"],
                    ]
                )
        H.print_table(
            "writers: N processes, one rollout file",
            [
                "procs",
                "writer",
                "records/s",
                "vs baseline",
                "fsyncs/rec",
                "recs/batch",
                "failures",
                "concurrent reader",
                "lines whole, complete, ordered, call_index dense",
            ],
            rows,
            [
                f"all checks passed: {all_ok}",
                (
                    "limit: the disk's fsync rate (each batch of a process is one fsync of the shared file; the "
                    "exclusive flock serialises the writes, not the fsyncs) and, for the baseline, one fsync per line"
                ),
            ],
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
