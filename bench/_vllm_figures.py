"""``bench_vllm``'s figures from its groups: the paired ratios with their bootstrap intervals, the split by
thread, the instrumentation's presence.

    python -m bench._vllm_figures RUN.json

prints a run's tables again from the JSON ``bench_vllm`` writes to stderr at the end (its ``groups`` and
``idle``), so a kept run can be re-read without starting vLLM; the intervals are seeded, so the figures
come out the same.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench import _harness as H

SHAPES = {"chat16": (16, False), "stream8": (8, True), "stream72": (72, True)}
PER_TOKEN = 64  # stream72 - stream8
RESAMPLES = 4000
GOAL = 1.05  # captured at most +5 % of vLLM's own API-server CPU, per call and per streamed token
SPANS_GOAL = 1.08  # the same with OTLP spans too (bench_vllm --spans; issue 34)


@dataclass(frozen=True)
class Group:
    """What one group of calls cost the API server: CPU ms in all (process, event loop, writer thread)."""

    start: str
    concurrency: int
    round: int
    mode: str
    shape: str
    calls: int
    cpu_ms: float
    main_ms: float
    writer_ms: float
    wall_s: float  # the calls' wall time, without the settling pause
    probe: dict[str, float] | None = None  # with --probe: the probe's counters over the group (flattened)
    floor_writer_ms: float | None = None  # --floor's writer thread; None: a run before it was counted apart
    quad: int = 0  # the chat call's quad within its round (--chat-quads); 0 for the streams and older runs

    @property
    def per_call(self) -> float:
        return self.cpu_ms / self.calls


Unit = tuple[float, float]  # a paired sample: (captured, passed)


def _pick(groups: list[Group], **match: Any) -> list[Group]:
    return [g for g in groups if all(getattr(g, k) == v for k, v in match.items())]


def _mean(groups: list[Group], attr: str = "cpu_ms") -> float:
    return statistics.mean(getattr(g, attr) / g.calls for g in groups)


def _paired_calls(groups: list[Group], concurrency: int, shape: str, mode: str = "captured") -> list[Unit]:
    """Per ABBA quad (one per round and shape; the chat call's ``--chat-quads`` per round): the ``mode``
    (captured, or --floor's floor) and the passed groups' mean CPU ms per call."""
    units = []
    paired = _pick(groups, start="zero-code", concurrency=concurrency, shape=shape)
    for round_, number in sorted({(g.round, g.quad) for g in paired}):
        quad = _pick(paired, round=round_, quad=number)
        if _pick(quad, mode=mode):
            units.append((_mean(_pick(quad, mode=mode)), _mean(_pick(quad, mode="passed"))))
    return units


def _paired_tokens(groups: list[Group], concurrency: int, mode: str = "captured") -> list[Unit]:
    """Per round: the ``mode`` and the passed CPU µs per streamed token (72- minus 8-token stream)."""
    long, short = (
        _paired_calls(groups, concurrency, "stream72", mode),
        _paired_calls(groups, concurrency, "stream8", mode),
    )
    return [
        ((lc - sc) * 1000 / PER_TOKEN, (lp - sp) * 1000 / PER_TOKEN)
        for (lc, lp), (sc, sp) in zip(long, short, strict=True)
    ]


def _ratio(units: Sequence[Unit]) -> float:
    passed = statistics.mean(p for _, p in units)
    return statistics.mean(c for c, _ in units) / passed if passed else math.nan


def _interval(units: Sequence[Unit], stat: Callable[[Sequence[Unit]], float]) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of ``stat`` (the units resampled with replacement; seeded, so
    a run's figures can be recomputed from its JSON)."""
    rng = random.Random(34)
    values = sorted(stat(rng.choices(units, k=len(units))) for _ in range(RESAMPLES))
    return values[int(0.025 * RESAMPLES)], values[int(0.975 * RESAMPLES) - 1]


def _diff(units: Sequence[Unit]) -> float:
    return statistics.mean(c for c, _ in units) - statistics.mean(p for _, p in units)


def _verdict(low: float, high: float, goal: float) -> str:
    if high <= goal:
        return "met"
    return "missed" if low > goal else "not decided"


def _interval_apart(a: list[float], b: list[float]) -> tuple[float, float]:
    """A 95 % bootstrap interval of mean(a) / mean(b) for samples of two starts, each resampled alone."""
    rng = random.Random(34)
    values = sorted(
        statistics.mean(rng.choices(a, k=len(a))) / statistics.mean(rng.choices(b, k=len(b)))
        for _ in range(RESAMPLES)
    )
    return values[int(0.025 * RESAMPLES)], values[int(0.975 * RESAMPLES) - 1]


def _per_token(groups: list[Group]) -> float | None:
    long, short = _pick(groups, shape="stream72"), _pick(groups, shape="stream8")
    return (_mean(long) - _mean(short)) * 1000 / PER_TOKEN if long and short else None


def attributed(groups: list[Group]) -> tuple[list[Group], float]:
    """The groups with the capture's writer CPU that landed in a later group moved back to the captured
    group it follows (chronologically, the order ``bench_vllm`` records them): the writer's idle close,
    ``IDLE_CLOSE`` after its last batch, falls in whichever group runs then, a passed or a floor one, and
    is the captured calls' work. And the ms moved. A floor group of a run that summed both writers
    (``floor_writer_ms`` None) is left as it is: its share cannot be told apart."""
    moved = 0.0
    found: list[Group] = []
    last: int | None = None  # index in ``found`` of the latest captured group
    for group in groups:
        if group.mode == "captured":
            last = len(found)
            found.append(group)
            continue
        spill = group.writer_ms
        if last is None or not spill or (group.mode == "floor" and group.floor_writer_ms is None):
            found.append(group)
            continue
        owner = found[last]
        found[last] = replace(owner, cpu_ms=owner.cpu_ms + spill, writer_ms=owner.writer_ms + spill)
        found.append(replace(group, cpu_ms=group.cpu_ms - spill, writer_ms=0.0))
        moved += spill
    return found, moved


def _report_absolute(groups: list[Group], idle: dict[str, float]) -> None:
    rows = []
    for start, concurrency, mode in sorted({(g.start, g.concurrency, g.mode) for g in groups}):
        found = _pick(groups, start=start, concurrency=concurrency, mode=mode)
        by_shape = [_mean(_pick(found, shape=s)) for s in SHAPES]
        wall = sum(g.wall_s for g in found)
        long = _pick(found, shape="stream72")
        rows.append(
            [start, mode, concurrency, len(long), *by_shape, _per_token(found),
             sum(g.calls for g in found) / wall, statistics.mean(g.wall_s for g in long)]
        )  # fmt: skip
    H.print_table(
        "API-server CPU per call, ms, means over groups (a group: `concurrency` calls of one shape at once; "
        "EngineCore not counted)",
        ["start", "mode", "conc", "groups/shape", "chat 16 tok", "stream 8", "stream 72", "per token us",
         "calls/s", "72-tok group s"],
        rows,
        ["idle CPU, ms per s: " + ", ".join(f"{k} {v:.2f}" for k, v in idle.items())],
    )  # fmt: skip


def _report_paired(groups: list[Group], concurrencies: list[int], goal: float) -> list[str]:
    rows, verdicts = [], []
    modes = [m for m in ("captured", "floor") if _pick(groups, start="zero-code", mode=m)]
    for concurrency in concurrencies:
        for mode in modes:
            for label, unit, units in (
                ("chat call", "ms", _paired_calls(groups, concurrency, "chat16", mode)),
                ("stream of 8 tokens", "ms", _paired_calls(groups, concurrency, "stream8", mode)),
                ("stream of 72 tokens", "ms", _paired_calls(groups, concurrency, "stream72", mode)),
                ("streamed token", "us", _paired_tokens(groups, concurrency, mode)),
            ):
                if not units:
                    continue
                ratio, (low, high) = _ratio(units), _interval(units, _ratio)
                passed, (below, above) = statistics.mean(p for _, p in units), _interval(units, _diff)
                rows.append(
                    [concurrency, mode, label, len(units), f"{passed:.3f} {unit}", f"{_diff(units):+.3f} {unit}",
                     f"[{below:+.3f}, {above:+.3f}]", f"{ratio:.4f}x", f"{low:.4f}-{high:.4f}",
                     f"±{(high - low) / 2 * 100:.1f} %"]
                )  # fmt: skip
                if label in ("chat call", "streamed token"):
                    verdicts.append(
                        f"c={concurrency} {mode} {label} {_verdict(low, high, goal)} ({(ratio - 1) * 100:+.1f} %)"
                    )
    H.print_table(
        "the capture's cost, paired: captured (and --floor's floor) against passed groups (ABBA) in the "
        "zero-code start",
        [
            "conc",
            "mode",
            "",
            "quads",
            "passed",
            "mode - passed",
            "95 % interval",
            "mode/passed",
            "95 % interval",
            "±",
        ],
        rows,
        [
            "quads: paired samples (2 groups of the mode and 2 passed groups of one shape, ABBA/BAAB: per round one of",
            "each stream and --chat-quads of the chat call;",
            "with --floor ABCCBA, the passed groups shared); floor: the barest durable capture (bench/_floors.py)",
            "ratio: mean of the mode / mean passed over the quads; interval: percentile bootstrap, quads resampled",
            f"({RESAMPLES} times; per token: rounds resampled, 72- minus 8-token stream over {PER_TOKEN} tokens);"
            " ±: half its width; with fewer than about 10 quads the interval is only a rough one",
            f"goal mode/passed <= {goal:.2f} (met: the interval's top under it): " + ", ".join(verdicts),
        ],
    )
    return verdicts


def _report_threads(groups: list[Group], concurrencies: list[int]) -> None:
    rows = []
    for concurrency in concurrencies:
        found = _pick(groups, start="zero-code", concurrency=concurrency)
        passed = _pick(found, mode="passed")
        for mode in ("captured", "floor"):
            for shape in SHAPES:
                c, p = _pick(found, mode=mode, shape=shape), _pick(passed, shape=shape)
                if c and p:
                    writer = _mean(c, "writer_ms")
                    if mode == "floor" and all(g.floor_writer_ms is not None for g in c):
                        writer = _mean(c, "floor_writer_ms")
                    rows.append(
                        [concurrency, mode, shape, _mean(c), _mean(c, "main_ms") - _mean(p, "main_ms"),
                         writer, _mean(c) - _mean(p)]
                    )  # fmt: skip
    H.print_table(
        "where the capture's CPU goes, zero-code, ms per call (the mode minus passed, means over groups)",
        ["conc", "mode", "shape", "mode, process", "event-loop thread +", "writer thread", "process +"],
        rows,
        ["writer thread: otel-capture-wr for captured (the durable write: marker, line, fsync, and its idle close,",
         "moved here from the group it fell in), floor-writer for floor (in runs that counted it apart)"],
    )  # fmt: skip


def _report_presence(groups: list[Group], concurrency: int) -> None:
    rows = []
    for shape in SHAPES:
        alone = [g.per_call for g in _pick(groups, start="alone-1", shape=shape, concurrency=concurrency)]
        passed = [
            g.per_call
            for g in _pick(groups, start="zero-code", mode="passed", shape=shape, concurrency=concurrency)
        ]
        captured = _pick(groups, start="zero-code", mode="captured", shape=shape, concurrency=concurrency)
        if not alone or not passed:
            continue
        low, high = _interval_apart(passed, alone)
        a = statistics.mean(alone)
        rows.append(
            [shape, a, statistics.mean(passed), f"{statistics.mean(passed) / a:.3f}x", f"{low:.3f}-{high:.3f}",
             f"{_mean(captured) / a:.3f}x"]
        )  # fmt: skip
    drift = [
        _mean(_pick(groups, start=s, shape="chat16"))
        for s in ("alone-1", "alone-2")
        if _pick(groups, start=s)
    ]
    H.print_table(
        f"the instrumentation's presence, concurrency {concurrency}: zero-code passed against vLLM alone "
        "(two starts), ms per call",
        ["shape", "alone", "passed", "passed/alone", "95 % interval", "captured/alone"],
        rows,
        ["interval: bootstrap of each start's groups; it does not hold the drift between two starts",
         "alone starts' chat means (drift between starts): " + ", ".join(f"{d:.2f} ms" for d in drift)],
    )  # fmt: skip


PROBE_ROWS = (
    ("gc/loop/0/ms", "loop: gen-0 collections, ms"),
    ("gc/loop/1/ms", "loop: gen-1 collections, ms"),
    ("gc/loop/2/ms", "loop: gen-2 collections, ms"),
    ("gc/loop/0/n", "loop: gen-0 collections"),
    ("gc/loop/1/n", "loop: gen-1 collections"),
    ("gc/loop/2/n", "loop: gen-2 collections"),
    ("gc/writer/*/ms", "writer: collections, ms"),
    ("gc/writer/*/n", "writer: collections"),
    ("threads/loop/cpu_ms", "loop thread CPU, ms"),
    ("threads/loop/runs", "loop thread: times run"),
    ("threads/loop/voluntary", "loop thread: voluntary switches"),
    ("threads/loop/involuntary", "loop thread: involuntary switches"),
    ("threads/writer/cpu_ms", "writer thread CPU, ms"),
    ("threads/writer/runs", "writer thread: times run"),
    ("threads/writer/voluntary", "writer: voluntary switches"),
    ("threads/writer/involuntary", "writer: involuntary switches"),
    ("threads/writer/utime_ticks", "writer: user ticks (10 ms)"),
    ("threads/writer/stime_ticks", "writer: system ticks (10 ms)"),
    ("counts/loopcode/total_ms", "loop: capture's sync code, ms"),
    ("counts/loopcode/on_body_ms", "loop: InFlightCall.on_body, ms"),
    ("counts/loopcode/_finish_ms", "loop: middleware _finish, ms"),
    ("counts/loopcode/_start_span_ms", "loop: middleware _start_span, ms"),
    ("counts/loopcode/correlate_ms", "loop: correlate, ms"),
    ("counts/loopcode/wake_ms", "loop: waiters' wake-up, ms"),
    ("counts/writer_busy_ms", "writer: CPU between waits, ms"),
    ("counts/writer_batch_ms", "writer: CPU in _write_batch, ms"),
    ("counts/writer_wakeups/*", "writer: wake-ups (_next returns)"),
    ("counts/writer_wakeups/item", "writer: woken by a line"),
    ("counts/writer_wakeups/tick", "writer: woken by a tick/timeout"),
    ("counts/writer_batches", "writer: batches"),
    ("counts/writer_batch_markers", "writer: begins in batches"),
    ("counts/loop_wakeups_sent", "writer -> loop wake-ups"),
    ("counts/marker_timers", "loop: begins timing a marker"),
    ("counts/marker_timers_fired", "loop: marker timers fired"),
)


def _probe_value(group: Group, key: str) -> float:
    """A probe counter over a group, per call; ``*`` sums the keys it stands for."""
    probe = group.probe or {}
    if "*" not in key:
        return probe.get(key, 0.0) / group.calls
    head, _, tail = key.partition("*")
    return sum(v for k, v in probe.items() if k.startswith(head) and k.endswith(tail)) / group.calls


def _report_probe(groups: list[Group], concurrencies: list[int]) -> None:
    probed = [g for g in groups if g.probe is not None]
    if not probed:
        return
    for concurrency in concurrencies:
        found = _pick(probed, start="zero-code", concurrency=concurrency)
        rows = []
        for key, label in PROBE_ROWS:
            row: list[Any] = [label]
            for shape in SHAPES:
                for mode in ("captured", "passed"):
                    picked = _pick(found, shape=shape, mode=mode)
                    row.append(statistics.mean(_probe_value(g, key) for g in picked) if picked else None)
            rows.append(row)
        H.print_table(
            f"inside the server (--probe), concurrency {concurrency}: per call, means over groups",
            ["", *(f"{s} {m[:4]}" for s in SHAPES for m in ("captured", "passed"))],
            rows,
            [
                "gc: collections timed by gc.callbacks on the thread that ran them; threads: /proc schedstat and status"
            ],
        )


def report(groups: list[Group], idle: dict[str, float], concurrency: int, goal: float = GOAL) -> None:
    """Every table, in the order ``bench_vllm`` prints them; ``goal``: the paired ratio's (``SPANS_GOAL`` for
    a ``--spans`` run)."""
    concurrencies = sorted({g.concurrency for g in groups if g.start == "zero-code"}, reverse=True)
    captured_calls = sum(g.calls for g in groups if g.mode == "captured")
    groups, moved = attributed(groups)
    if captured_calls:
        print(
            f"the capture's writer CPU that fell in later groups (its idle close, {moved:.1f} ms in all, "
            f"{moved / captured_calls:.3f} ms per captured call) is counted in the captured group before it"
        )
    _report_absolute(groups, idle)
    _report_paired(groups, concurrencies, goal)
    _report_threads(groups, concurrencies)
    _report_presence(groups, concurrency)
    _report_probe(groups, concurrencies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a file holding the JSON bench_vllm printed (its stderr)")
    args = parser.parse_args(argv)
    with args.run.open("rb") as run:
        found = next((orjson.loads(line) for line in run if line.startswith(b'{"groups"')), None)
    if found is None:
        parser.error(f'{args.run} holds no line of bench_vllm\'s JSON (one starting with {{"groups")')
    groups = [Group(**g) for g in found["groups"]]
    zero_code = [g.concurrency for g in groups if g.start == "zero-code"]
    report(groups, found["idle"], max(zero_code, default=0), found.get("goal", GOAL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
