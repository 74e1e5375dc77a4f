"""``bench_goals``' floors beside goals 1-3: which floor servers each goal runs (served by ``_floors.py``),
what each adds per call, and the table that sets each goal's server beside its floors and its baseline."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from bench import _harness as H
from bench import _rounds as R


class Floors(NamedTuple):
    """A goal's server, its baseline and target, and the servers of its floors (run names; a proxy floor's
    name is also its ``_servers`` variant)."""

    server: str
    baseline: str
    target: float
    names: tuple[str, str]


FLOORS = {
    "1a": Floors("zero-code", "starlette", 0.4, ("floor-zc", "floor-zc-onloop")),
    "2": Floors("library", "bare", 0.5, ("floor-lib", "floor-lib-onloop")),
    "3a": Floors("proxy", "upstream", 0.5, ("floor-forward", "floor-raw")),
}
FLOOR_LABELS = {
    "floor-zc": "FLOOR: the app in the barest durable capture (thread, group commit)",
    "floor-zc-onloop": "FLOOR: the same, line written on the loop (no thread, no fsync)",
    "floor-lib": "FLOOR: the app in the barest durable capture (thread, group commit)",
    "floor-lib-onloop": "FLOOR: the same, line written on the loop (no thread, no fsync)",
    "floor-forward": "FLOOR: barest forwarding ASGI app (proxy's stack and pool)",
    "floor-raw": "FLOOR: raw forwarder, uvloop + httptools (no ASGI, no uvicorn)",
}


def capture_floor_specs(data: Path, key: str, *extra: str) -> list[R.Spec]:
    """The model app in the barest durable capture, and with its line written on the loop."""
    return [
        R.Spec(
            f"floor-{key}{suffix}",
            H.server_argv(variant, *extra, "--capture-dir", str(data / f"floor-{key}{suffix}")),
            capture_dir=data / f"floor-{key}{suffix}",
        )
        for variant, suffix in (("floor", ""), ("floor-onloop", "-onloop"))
    ]


def floor_rows(goal: str, runs: dict[str, R.Run], base: R.Run) -> list[tuple[str, R.Run, R.Run | None]]:
    return [(FLOOR_LABELS[name], runs[name], base) for name in FLOORS[goal].names]


def added_cpu(goal: str, run: R.Run, base: R.Run) -> float:
    """CPU per call a server adds to the call's path: above the app's own (1a, 2); the proxy's or
    forwarder's own process, all of it (3a: the upstream's CPU is its own process's)."""
    return (run.cpu_us or 0) - (0 if goal == "3a" else base.cpu_us or 0)


def floor_notes(goal: str, runs: dict[str, R.Run], this: R.Run, base: R.Run) -> list[str]:
    """What the goal's server adds beside what each floor adds, and whether each floor reaches the target."""
    target = FLOORS[goal].target
    parts = []
    for name in FLOORS[goal].names:
        ratio = runs[name].rps / base.rps
        parts.append(
            f"{FLOOR_LABELS[name].removeprefix('FLOOR: ')} {ratio:.2f}x, {added_cpu(goal, runs[name], base):+.0f} "
            f"us/call ({'reaches' if ratio >= target else 'below'} {target}x)"
        )
    first = runs[FLOORS[goal].names[0]]
    return [
        f"{goal}: floors in the same run: {'; '.join(parts)}. The goal's server adds "
        f"{added_cpu(goal, this, base):+.0f} us/call, {(this.cpu_us or 0) - (first.cpu_us or 0):+.0f} us beside "
        "the first floor"
    ]


def sync_note(servers: R.Servers, name: str) -> str:
    """The durable floor's disk latency: its writer's mean syncfs/fsync wall time since it started, and the
    throughput no group commit passes at 64 calls in flight (each call waits for one sync at least)."""
    stats = servers.running[name].stats()
    if not stats.get("batches"):
        return f"{name}: no batch written"
    sync_ms = stats["sync_ns"] / stats["batches"] / 1e6
    return (
        f"{name}: its writer's sync (syncfs, or fsync for one file) took {sync_ms:.2f} ms of wall time on average "
        f"({stats['batches']:,} batches, {stats['records'] / stats['batches']:.1f} records each): with "
        f"{R.CONCURRENCY} calls in flight, each waiting for one sync at least, no durable capture passes "
        f"{R.CONCURRENCY / sync_ms * 1e3:,.0f} calls/s on this disk now, whatever its CPU"
    )


def floors_table(runs: dict[str, R.Run]) -> None:
    """Each goal's server beside its floors and its baseline, from the runs already measured."""
    rows = []
    for goal, (this, base_name, target, floors) in FLOORS.items():
        if base_name not in runs or any(name not in runs for name in (this, *floors)):
            continue
        base = runs[base_name]
        rows.append([goal, f"baseline: {base_name}", base.rps, None, None, base.cpu_us, None, base.user_us])
        for name in (this, *floors):
            run = runs[name]
            ratio = run.rps / base.rps
            label = FLOOR_LABELS.get(name, f"the goal's server: {name}")
            rows.append(
                [
                    goal,
                    label,
                    run.rps,
                    f"{ratio:.2f}x",
                    f"{target}x",
                    run.cpu_us,
                    added_cpu(goal, run, base),
                    run.user_us,
                ]
            )
    if not rows:
        return
    H.print_table(
        "FLOORS: each goal's server beside the least any implementation costs on this stack (same run, same load)",
        ["goal", "server", "req/s", "ratio", "target", "CPU us/call", "added us/call", "user us/call"],
        rows,
        [
            "added us/call: CPU per call above the app's own (1a, 2); for 3a the forwarding process's own CPU "
            "(the upstream's is in its own process)",
            "a floor's ratio is a ceiling on this stack: the durable floor's for any capture that holds the last "
            "chunk until its line is synced (1a, 2), the one on the loop for any capture at all; the ASGI "
            "forwarder's for any proxy served by uvicorn, the raw forwarder's for any Python proxy (3a)",
        ],
    )
