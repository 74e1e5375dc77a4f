"""The durable writer's own CPU per record, without HTTP, the event loop or a disk flush: the package at
two revisions side by side.

    python bench/bench_writer_batch.py [--before REV] [--after REV] [--rounds N] [--batches N] [--strace]

``JsonlWriter._write_batch`` is called directly (the writer thread sits idle), ``--batches`` times per
round (default 2,000), each batch 16 records of about 2 KB, one per rollout, over 32 rollouts in turn
(what 64 concurrent calls over 32 rollouts give the thread), ``fsync`` and ``syncfs`` no-ops. Each
revision is a ``git archive`` of the package on ``PYTHONPATH`` in its own process; rounds alternate
(before, after, before, ...) and the best round of each is kept: CPU microseconds per record
(``time.thread_time`` of the calling thread). ``--strace`` adds the system calls per record of one more
round each (``strace -c -f``). ``--before`` defaults to ``main``, ``--after`` to ``HEAD``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H

CHILD = r"""
import asyncio, os, sys, tempfile, time
from otel_capture._sink import LoopWaiter
from otel_capture._store.writer import JsonlWriter, _Item  # _Item lives in writer_items.py now; writer.py has it at every revision
loop = asyncio.new_event_loop()  # never run: the waiters' wake-ups are queued on it, as a busy loop's are
batches, records = int(sys.argv[1]), 16
root = tempfile.mkdtemp(prefix="bench-writer-batch-")
writer = JsonlWriter(os.path.join(root, "calls"), fsync=lambda fd: None, syncfs=None)
line = b'{"model_call_id":"%d","pad":"' + b"x" * 2000 + b'"}\n'
rollouts = [f"rollout-{i}" for i in range(32)]
def batch(n):
    return [_Item(rollouts[(n * records + j) % 32], line % (n * records + j), str(n * records + j),
                  tokens_line=None, waiter=LoopWaiter(loop, loop.create_future()))
            for j in range(records)]
for n in range(50):  # warm: files and lock files exist
    writer._write_batch(batch(n), [])
start = time.thread_time()
for n in range(batches):
    writer._write_batch(batch(n), [])
cpu = time.thread_time() - start
writer.close()
print(f"{cpu / (batches * records) * 1e6:.2f}")
"""


def _snapshot(rev: str, into: Path) -> Path:
    into.mkdir(parents=True)
    for paths in (["otel_capture"], ["exporters"]):
        archive = subprocess.run(["git", "archive", rev, *paths], cwd=H.REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    shutil.move(str(into / "exporters"), str(into / "otel_capture" / "exporters"))
    return into


def _round(source: Path, batches: int) -> float:
    # run from the snapshot's parent: `python -c` puts the working directory first on sys.path
    argv = [sys.executable, "-c", CHILD, str(batches)]
    env = {**H._clean_environ(), "PYTHONPATH": str(source)}
    out = subprocess.run(argv, env=env, cwd=source, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def _syscalls(source: Path, batches: int) -> dict[str, float]:
    """System calls per record: a run of ``batches`` less a run of none (start-up and warm-up)."""
    counts: list[dict[str, int]] = []
    for n in (batches, 0):
        argv = [
            "strace",
            "-c",
            "-f",
            sys.executable,
            "-c",
            CHILD.replace("/ (batches * records)", "/ max(1, batches * records)"),
            str(n),
        ]
        env = {**H._clean_environ(), "PYTHONPATH": str(source)}
        out = subprocess.run(argv, env=env, cwd=source, capture_output=True, text=True, check=True)
        found: dict[str, int] = {}
        for row in out.stderr.splitlines():
            cols = row.split()
            if len(cols) >= 5 and re.fullmatch(r"[\d.]+", cols[0]) and cols[-1] != "total":
                found[cols[-1]] = int(cols[3])
        counts.append(found)
    return {k: (v - counts[1].get(k, 0)) / (batches * 16) for k, v in counts[0].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="main")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--strace", action="store_true")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-writer-batch-"))
    try:
        sources = {
            rev: _snapshot(rev, work / name) for name, rev in (("before", args.before), ("after", args.after))
        }
        print(f"speed gauge {H.speed_gauge():.1f}")
        best: dict[str, list[float]] = {rev: [] for rev in sources}
        for _ in range(args.rounds):
            for rev, source in sources.items():
                best[rev].append(_round(source, args.batches))
        for rev, figures in best.items():
            shown = ", ".join(f"{f:.1f}" for f in figures)
            print(f"{rev:>12}: best {min(figures):.1f} µs CPU per record (rounds: {shown})")
        if args.strace:
            for rev, source in sources.items():
                calls = _syscalls(source, args.batches)
                top = sorted(calls.items(), key=lambda kv: -kv[1])[:10]
                total = sum(calls.values())
                print(
                    f"{rev:>12}: {total:.2f} system calls per record: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in top)
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
