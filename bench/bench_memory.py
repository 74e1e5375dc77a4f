"""Memory of the lifecycle at scale: bounded by the work in hand, not by history (issue 15, item 10).

    python -m bench.bench_memory [--quick] [--rollouts N] [--lines N] [--dir DIR]
                                 [--only GROUP,...]   (batch, freeze, read, show, journal, markers)

Each figure is measured in a fresh child process (peak RSS from ``VmHWM``, reset through
``/proc/self/clear_refs`` just before the operation, minus the RSS at that moment):

* **retire / delete batch**: one ``retire_now`` (then one ``delete_now``) of ``--rollouts`` live rollouts
  (default 20,000; quick 5,000), each with a record line and a token line: peak RSS per rollout;
* **freeze**: ``freeze_now`` of one rollout of ``--lines`` records (default 100,000; quick 20,000) cycled
  from NeMo Gym 0.7.0's own capture file: peak RSS per line and against the file's size (the snapshot's
  parsed records are most of it), wall time, and the share of it spent in the cyclic garbage collector
  (``gc.callbacks``);
* **read**: ``read_model_call_records`` of the same file, in another process (the readers: not the
  lifecycle's code; shown for scale);
* **show**: ``otel-capture show DIR big`` of the same file (its table to ``/dev/null``): peak RSS per line
  and against the file's size;
* **journal**: the fence journal's lines and bytes after ``--rollouts`` retires (batches of 100), after as
  many freeze + drop pairs, and after as many retire + delete pairs; and what a fresh process holds once it
  has loaded the first of those journals (peak RSS per fence);
* **in-flight markers**: marker files left in ``.otel-capture/inflight`` after ``--rollouts`` calls, each
  begun and then recorded by the writer.

Journal and marker workloads run with ``fsync`` switched off (the figures are sizes and counts). Linux
only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import _harness as H

FIXTURE = H.REPO / "tests" / "fixtures" / "nemo_gym" / "gym_server_0-0.capture.jsonl"

# --- the child: one measurement, printed as JSON ---------------------------------------------------------


def _measure(operation: Any) -> tuple[int, float, Any]:
    """Peak RSS growth in bytes and wall time of ``operation()``, and its result."""
    import gc

    gc.collect()
    H.reset_peak_rss()
    base = H.status_kib("VmRSS")
    start = time.perf_counter()
    result = operation()
    elapsed = time.perf_counter() - start
    return (H.status_kib("VmHWM") - base) * 1024, elapsed, result


def _populate(root: Path, ids: list[str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for rid in ids:
        (root / f"{rid}.capture.jsonl").write_bytes(b'{"model_call_id":"c1","dialect":"chat"}\n')
        (root / f"{rid}.tokens.jsonl").write_bytes(b'{"model_call_id":"c1","prompt_token_ids":[1,2,3]}\n')


def child_batch(root: Path, rollouts: int) -> dict[str, Any]:
    from otel_capture import CaptureStore

    ids = [f"r{i}" for i in range(rollouts)]
    _populate(root, ids)
    store = CaptureStore(root)
    store.rollout_state("warm-up")  # the journal view and the imports, before the measured batch
    retire_peak, retire_s, _ = _measure(lambda: store.retire_now(ids))
    delete_peak, delete_s, _ = _measure(lambda: store.delete_now(ids))
    return {
        "retire_peak": retire_peak,
        "retire_s": retire_s,
        "delete_peak": delete_peak,
        "delete_s": delete_s,
    }


def child_bigfile(root: Path, lines: int) -> dict[str, Any]:
    import orjson

    source = [orjson.loads(line) for line in FIXTURE.read_bytes().splitlines() if line.strip()]
    root.mkdir(parents=True, exist_ok=True)
    with (root / "big.capture.jsonl").open("wb") as handle:
        for i in range(lines):
            handle.write(orjson.dumps({**source[i % len(source)], "model_call_id": f"c{i}"}) + b"\n")
    return {"size": (root / "big.capture.jsonl").stat().st_size}


def child_read(root: Path) -> dict[str, Any]:
    from otel_capture import CaptureStore, read_model_call_records

    store = CaptureStore(root)
    peak, seconds, records = _measure(lambda: len(read_model_call_records(store, "big")))
    return {"read_peak": peak, "read_s": seconds, "read_records": records}


def child_show(root: Path) -> dict[str, Any]:
    import contextlib
    from importlib.metadata import entry_points

    cli = next(iter(entry_points(group="console_scripts", name="otel-capture"))).load()  # the command

    def show() -> int:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            return cli(["show", str(root), "big"])

    cli(["show", str(root), "absent"])  # the imports, before the measured run
    peak, seconds, code = _measure(show)
    assert code == 0, code
    return {"show_peak": peak, "show_s": seconds}


def child_freeze(root: Path) -> dict[str, Any]:
    import gc

    from otel_capture import CaptureStore

    store = CaptureStore(root)
    collecting = [0.0, 0.0]

    def timer(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting[1] = time.perf_counter()
        else:
            collecting[0] += time.perf_counter() - collecting[1]

    gc.callbacks.append(timer)
    peak, seconds, snap = _measure(lambda: store.freeze_now("big"))
    gc.callbacks.remove(timer)
    return {
        "freeze_peak": peak,
        "freeze_s": seconds,
        "freeze_gc_s": collecting[0],
        "frozen": len(snap.records),
    }


def child_journal(root: Path, rollouts: int, workload: str) -> dict[str, Any]:
    from otel_capture import CaptureStore

    store = CaptureStore(root, fsync=lambda fd: None)
    ids = [f"r{i}" for i in range(rollouts)]
    if workload == "retire":
        for start in range(0, rollouts, 100):
            store.retire_now(ids[start : start + 100])
    for rid in ids if workload != "retire" else ():
        if workload == "drop":
            snap = store.freeze_now(rid)
            store.drop_now(rid, snapshot_id=snap.snapshot_id, version=snap.version)
        else:
            store.retire_now([rid])
            store.delete_now([rid])
    journal = root / ".otel-capture" / "fences.journal"
    return {"lines": len(journal.read_bytes().splitlines()), "bytes": journal.stat().st_size}


def child_load(root: Path) -> dict[str, Any]:
    from otel_capture import CaptureStore

    store = CaptureStore(root)
    peak, seconds, listed = _measure(lambda: len(store.list_rollouts("retired")))
    return {"load_peak": peak, "load_s": seconds, "fences": listed}


def child_markers(root: Path, rollouts: int) -> dict[str, Any]:
    from otel_capture._capture import LoopWaiter
    from otel_capture._store import JsonlWriter

    writer = JsonlWriter(root, fsync=lambda fd: None, syncfs=None)
    for i in range(rollouts):
        writer.begin(f"r{i}", "c1")
    writer.flush(600)
    loop = asyncio.new_event_loop()  # never run: flush is what is waited for
    for i in range(rollouts):
        writer.submit(
            f"r{i}", b'{"model_call_id":"c1"}\n', "c1", None, LoopWaiter(loop, loop.create_future())
        )
    writer.flush(600)
    writer.close(600)
    loop.close()
    inflight = root / ".otel-capture" / "inflight"
    return {"marker_files": len(os.listdir(inflight)) if inflight.is_dir() else 0}


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "batch": child_batch,
    "bigfile": child_bigfile,
    "read": child_read,
    "freeze": child_freeze,
    "show": child_show,
    "journal": child_journal,
    "load": child_load,
    "markers": child_markers,
}

# --- the parent ---------------------------------------------------------------------------------------------


def _run(name: str, *args: Any) -> dict[str, Any]:
    out = subprocess.run(
        [H.PYTHON, "-m", "bench.bench_memory", "--child", name, *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        cwd=H.REPO,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {name} failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


GROUPS = ("batch", "freeze", "read", "show", "journal", "markers")


def measure(work: Path, rollouts: int, lines: int, groups: tuple[str, ...] = GROUPS) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    if "batch" in groups:
        figures.update(_run("batch", work / "batch", rollouts))
    if {"freeze", "read", "show"} & set(groups):
        figures.update(_run("bigfile", work / "freeze", lines))
    # each in its own process: no reuse of freed memory
    if "read" in groups:
        figures.update(_run("read", work / "freeze"))
        assert figures["read_records"] == lines
    if "show" in groups:
        figures.update(_run("show", work / "freeze"))
    if "freeze" in groups:
        figures.update(_run("freeze", work / "freeze"))
        assert figures["frozen"] == lines
    if "journal" in groups:
        for workload in ("retire", "drop", "delete"):
            journal = _run("journal", work / f"journal-{workload}", rollouts, workload)
            figures[f"journal_{workload}_lines"] = journal["lines"]
            figures[f"journal_{workload}_bytes"] = journal["bytes"]
        figures.update(_run("load", work / "journal-retire"))
    if "markers" in groups:
        figures.update(_run("markers", work / "markers", rollouts))
    return figures


def _rows(f: dict[str, Any], rollouts: int, lines: int) -> list[tuple[str, float, str]]:
    mib = 1024 * 1024
    rows: list[tuple[str, float, str]] = []
    if "retire_peak" in f:
        rows += [
            ("retire batch: peak RSS per rollout", f["retire_peak"] / rollouts, "B"),
            ("delete batch: peak RSS per rollout", f["delete_peak"] / rollouts, "B"),
        ]
    if "size" in f:
        rows.append(("the rollout's file: MiB", f["size"] / mib, "MiB"))
    if "freeze_peak" in f:
        rows += [
            ("freeze: peak RSS, MiB", f["freeze_peak"] / mib, "MiB"),
            ("freeze: peak RSS per line", f["freeze_peak"] / lines, "B"),
            ("freeze: peak RSS / file size", f["freeze_peak"] / f["size"], "x"),
            ("freeze: wall time", f["freeze_s"], "s"),
            ("freeze: share in the garbage collector", 100 * f["freeze_gc_s"] / f["freeze_s"], "%"),
        ]
    if "read_peak" in f:
        rows.append(("read_model_call_records: peak RSS per line", f["read_peak"] / lines, "B"))
    if "show_peak" in f:
        rows += [
            ("otel-capture show DIR ID: peak RSS, MiB", f["show_peak"] / mib, "MiB"),
            ("otel-capture show DIR ID: peak RSS per line", f["show_peak"] / lines, "B"),
            ("otel-capture show DIR ID: peak RSS / file size", f["show_peak"] / f["size"], "x"),
            ("otel-capture show DIR ID: wall time", f["show_s"], "s"),
        ]
    if "journal_retire_lines" in f:
        rows += [
            ("journal after retires: lines per rollout", f["journal_retire_lines"] / rollouts, ""),
            ("journal after freeze+drop: lines per rollout", f["journal_drop_lines"] / rollouts, ""),
            ("journal after retire+delete: lines per rollout", f["journal_delete_lines"] / rollouts, ""),
            ("journal after retires: MiB", f["journal_retire_bytes"] / mib, "MiB"),
            ("loading that journal: peak RSS per fence", f["load_peak"] / max(f["fences"], 1), "B"),
        ]
    if "marker_files" in f:
        rows.append(("in-flight marker files left per rollout", f["marker_files"] / rollouts, ""))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rollouts", type=int)
    parser.add_argument("--lines", type=int)
    parser.add_argument("--dir", help="where the temporary files go (default: the system's temp dir)")
    parser.add_argument(
        "--only", help=f"comma-separated groups to measure (default: all of {','.join(GROUPS)})"
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, *rest = args.child
        params: list[Any] = [Path(rest[0]), *(int(x) if x.isdigit() else x for x in rest[1:])]
        print(json.dumps(CHILDREN[name](*params)))
        return 0
    rollouts = args.rollouts or (5_000 if args.quick else 20_000)
    lines = args.lines or (20_000 if args.quick else 100_000)
    groups = tuple(args.only.split(",")) if args.only else GROUPS
    unknown = set(groups) - set(GROUPS)
    if unknown:
        parser.error(f"unknown groups {sorted(unknown)}; choose from {','.join(GROUPS)}")
    print(f"{rollouts} rollouts per batch and workload, a {lines}-line rollout frozen\n")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        figures = measure(Path(tmp), rollouts, lines, groups)
    rows = [(label, f"{value:.3g}", unit) for label, value, unit in _rows(figures, rollouts, lines)]
    H.print_table("memory of the lifecycle at scale", ["figure", "measured", "unit"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
