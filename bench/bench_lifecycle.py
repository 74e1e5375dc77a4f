"""Retire 1,000 live rollouts in one batch: our fence journal against one fence file per rollout.

    python -m bench.bench_lifecycle [--quick] [--rollouts N] [--rounds R] [--dir DIR]

Both sides do the same two synced phases on the same kind of rollouts (a record line and a token line
each), in the same run, on the same filesystem:

* **ours** (``CaptureStore.retire_now``): all the batch's fences as lines of the fence journal, one file
  fsync; remove the records; one directory fsync.
* **baseline** (NeMo Gym's post-change token store, the seed's final design): per rollout, a fence file
  written to a temporary name, fsynced and renamed into place; one directory fsync; remove the records;
  one directory fsync.

fsyncs are counted through the store's ``fsync`` seam (file vs directory). Ours moves removed records
into ``.otel-capture/trash/`` and frees their blocks in the background; the second "ours" row runs until
that trash is empty, so it is the whole cost, space freed, and no purge runs while the baseline is
measured. Absolute times depend on the disk; the
ratio measured side by side is the number to read. The seed quotes about 330 µs per rollout for its
(single-phase) design on a local disk.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import _harness as H
from otel_capture import CaptureStore


class Counter:
    def __init__(self) -> None:
        self.file = 0
        self.dir = 0

    def fsync(self, fd: int) -> None:
        os.fsync(fd)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            self.dir += 1
        else:
            self.file += 1


def _populate(root: Path, ids: list[str]) -> None:
    """Live rollouts: one record line and one token line each, made durable before timing starts."""
    root.mkdir(parents=True, exist_ok=True)
    for rid in ids:
        (root / f"{rid}.capture.jsonl").write_bytes(b'{"model_call_id":"c1","dialect":"chat"}\n')
        (root / f"{rid}.tokens.jsonl").write_bytes(b'{"model_call_id":"c1","prompt_token_ids":[1,2,3]}\n')
    os.sync()


def _fsync_dir(path: Path, fsync: Callable[[int], None]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def baseline_retire(root: Path, ids: list[str], fsync: Callable[[int], None]) -> None:
    """One fence file per rollout (temp + fsync + rename), a directory sync, removals, a directory sync."""
    fences = root / "fences"
    fences.mkdir(exist_ok=True)
    for rid in ids:
        tmp = fences / f".{rid}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b'{"retired":true,"frozen":false,"version":0}\n')
            fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, fences / f"{rid}.state.json")
    _fsync_dir(fences, fsync)
    for rid in ids:
        for suffix in (".capture.jsonl", ".tokens.jsonl", ".capture.incomplete"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(root / f"{rid}{suffix}")
    _fsync_dir(root, fsync)


def ours_retire(root: Path, ids: list[str], fsync: Callable[[int], None]) -> None:
    result = CaptureStore(root, fsync=fsync).retire_now(ids)
    assert len(result["removed"]) == len(ids) and not result["failed"], result


def _measure(kind: str, base: Path, n: int, round_no: int) -> tuple[float, float, Counter]:
    root = base / f"{kind}-{round_no}"
    ids = [f"{round_no}-{i}" for i in range(n)]
    _populate(root, ids)
    if kind == "ours":
        CaptureStore(root).retire_now(["warm-up"])  # the journal exists, as in any directory in use
    counter = Counter()
    retire = ours_retire if kind == "ours" else baseline_retire
    t0 = time.perf_counter()
    retire(root, ids, counter.fsync)
    returned = time.perf_counter() - t0
    trash = root / ".otel-capture" / "trash"  # docs/lifecycle.md, "On disk"
    while kind == "ours" and trash.is_dir() and any(os.scandir(trash)):
        time.sleep(0.001)  # the background purge frees the space
    return returned, time.perf_counter() - t0, counter


def _filesystem(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=None, help="rounds per side (default 5, quick 2)")
    parser.add_argument("--dir", default=None, help="where to create the capture directories (a local disk)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="bench-lifecycle-", dir=args.dir or str(H.BENCH)) as tmp:
        base = Path(tmp)
        print(
            f"retire {args.rollouts} live rollouts in one batch; {rounds} rounds each, alternating; "
            f"filesystem {_filesystem(base)} at {base}"
        )
        times: dict[str, list[float]] = {"ours": [], "ours_freed": [], "baseline": []}
        counts: dict[str, Counter] = {}
        for round_no in range(rounds):
            for kind in ("baseline", "ours") if round_no % 2 else ("ours", "baseline"):
                returned, freed, counter = _measure(kind, base, args.rollouts, round_no)
                times[kind].append(returned)
                if kind == "ours":
                    times["ours_freed"].append(freed)
                counts[kind] = counter
        counts["ours_freed"] = counts["ours"]
    n = args.rollouts
    print(f"{'':28}{'time/rollout':>14}{'fsyncs/rollout':>16}{'file+dir fsyncs per batch':>28}")
    rows = {}
    for kind, label in (
        ("baseline", "baseline (fence file each)"),
        ("ours", "ours (fence journal)"),
        ("ours_freed", "ours + freeing the space"),
    ):
        per = statistics.median(times[kind]) / n * 1e6
        c = counts[kind]
        rows[kind] = (per, (c.file + c.dir) / n)
        print(f"{label:28}{per:>11.1f} µs{(c.file + c.dir) / n:>16.4f}{f'{c.file} + {c.dir}':>28}")
    speed = rows["baseline"][0] / rows["ours"][0]
    fewer = rows["baseline"][1] / rows["ours"][1]
    whole = rows["baseline"][0] / rows["ours_freed"][0]
    print(
        f"ours: {speed:.1f}x faster per rollout until retire returns, {whole:.1f}x counting the space freed; "
        f"{fewer:.0f}x fewer fsyncs (medians of {rounds} rounds)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
