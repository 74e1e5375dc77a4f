"""``bench_goals``' goal 4: 512- and 32-event Chat Completions streams, capture on against off, in library
mode and zero-code: the added server CPU per event (the slope between the two lengths) and the median time
to first event one call at a time."""

from __future__ import annotations

import statistics
from pathlib import Path

import orjson

from bench import _harness as H
from bench import _rounds as R
from bench._servers import REQUEST_BODY, chat_events

STREAM_EVENTS = 512
STREAM_EVENTS_SHORT = 32  # the second length: per-event cost is the slope between the two
STREAM_REQUEST_BODY = orjson.dumps(
    {**orjson.loads(REQUEST_BODY), "stream": True, "stream_options": {"include_usage": True}}
)


def goal_streaming(
    data: Path, rounds: int, seconds: int, fp: bool, ttft_calls: int
) -> tuple[list[R.Goal], dict[str, R.Run]]:
    goals: list[R.Goal] = []
    runs_out: dict[str, R.Run] = {}
    pairs = [
        (
            "library",
            lambda n: R.Spec(f"off-{n}", H.server_argv("bare", "--events", str(n)), prefixed=False),
            lambda n: R.Spec(
                f"on-{n}",
                H.server_argv("capture", "--events", str(n), "--capture-dir", str(data / f"lib-{n}")),
                capture_dir=data / f"lib-{n}",
            ),
        ),
        (
            "zero-code",
            lambda n: R.Spec(
                f"off-{n}", H.server_argv("bare", "--app", "starlette", "--events", str(n)), prefixed=False
            ),
            lambda n: R.Spec(
                f"on-{n}",
                [R.INSTRUMENT, *H.server_argv("bare", "--app", "starlette", "--events", str(n))],
                env=R.zero_code_env(data / f"zc-{n}"),
                capture_dir=data / f"zc-{n}",
            ),
        ),
    ]
    expected = {n: sum(len(e) for e in chat_events(n)) for n in (STREAM_EVENTS, STREAM_EVENTS_SHORT)}
    for mode, off_spec, on_spec in pairs:
        with R.Servers() as servers:
            specs = [make(n) for n in (STREAM_EVENTS, STREAM_EVENTS_SHORT) for make in (off_spec, on_spec)]
            for spec in specs:
                servers.start(spec)
            runs = R.rounds_of(
                servers, [s.name for s in specs], rounds, seconds, fp, body=STREAM_REQUEST_BODY
            )
            ttft = R.ttft_rounds(
                {
                    name: (servers.running[name].url, servers.specs[name].prefixed)
                    for name in (f"off-{STREAM_EVENTS}", f"on-{STREAM_EVENTS}")
                },
                STREAM_REQUEST_BODY,
                ttft_calls,
                warmup=max(5, ttft_calls // 10),
            )
            disk = R.disk_check(servers, [f"on-{STREAM_EVENTS}", f"on-{STREAM_EVENTS_SHORT}"])
        off, on = runs[f"off-{STREAM_EVENTS}"], runs[f"on-{STREAM_EVENTS}"]
        off_s, on_s = runs[f"off-{STREAM_EVENTS_SHORT}"], runs[f"on-{STREAM_EVENTS_SHORT}"]
        added = (on.cpu_us or 0) - (off.cpu_us or 0)
        added_short = (on_s.cpu_us or 0) - (off_s.cpu_us or 0)
        per_event_marginal = (added - added_short) / (STREAM_EVENTS - STREAM_EVENTS_SHORT)
        per_event_average = added / STREAM_EVENTS
        added_user = ((on.user_us or 0) - (off.user_us or 0)) - ((on_s.user_us or 0) - (off_s.user_us or 0))
        per_event_user = added_user / (STREAM_EVENTS - STREAM_EVENTS_SHORT)
        t_off, t_on = statistics.median(ttft[off.name]), statistics.median(ttft[on.name])
        R.run_table(
            f"goal 4: streaming, {mode}: {STREAM_EVENTS}- and {STREAM_EVENTS_SHORT}-event streams "
            f"({expected[STREAM_EVENTS]:,} and {expected[STREAM_EVENTS_SHORT]:,} bytes), capture off vs on",
            [
                (f"capture off, {STREAM_EVENTS} events", off, None),
                (f"capture on, {STREAM_EVENTS} events", on, off),
                (f"capture off, {STREAM_EVENTS_SHORT} events", off_s, None),
                (f"capture on, {STREAM_EVENTS_SHORT} events", on_s, off_s),
            ],
            [
                *disk,
                f"added CPU per call: {added:.0f} us at {STREAM_EVENTS} events, {added_short:.0f} us at "
                f"{STREAM_EVENTS_SHORT}: per event {per_event_marginal:.2f} us at the margin (the slope), "
                f"{per_event_average:.2f} us on average (all added CPU / {STREAM_EVENTS}); of the slope, "
                f"{per_event_user:.2f} us is user CPU (Python) and {per_event_marginal - per_event_user:.2f} us "
                "system CPU (the kernel's side of the socket writes: a slower server wakes its client once per "
                "event where a fast one is read in bursts)",
                f"time to first event, one call at a time ({len(ttft[off.name])} calls each, servers rotated): "
                f"median off {t_off * 1e3:.3f} ms, on {t_on * 1e3:.3f} ms; p90 off "
                f"{H.percentile(ttft[off.name], 0.9) * 1e3:.3f} ms, on {H.percentile(ttft[on.name], 0.9) * 1e3:.3f} ms",
            ],
        )
        key = "4L" if mode == "library" else "4Z"
        goals.append(
            R.Goal(
                f"{key}a",
                f"streaming {mode}: added CPU per event (slope)",
                per_event_marginal,
                3.0,
                False,
                "us",
                on,
                off,
                "capture off",
                [
                    f"{key}a: the average over the stream (all added CPU / {STREAM_EVENTS}) is "
                    f"{per_event_average:.2f} us per event; the uncaptured server itself spends "
                    f"{(off.cpu_us or 0) / STREAM_EVENTS:.2f} us per event, so capture adds "
                    f"{per_event_marginal / max((off.cpu_us or 0) / STREAM_EVENTS, 1e-9):.1f}x the "
                    "server's own per-event cost"
                ],
            )
        )
        goals.append(
            R.Goal(
                f"{key}b",
                f"streaming {mode}: TTFT median on - off",
                (t_on - t_off) * 1e3,
                0.3,
                False,
                "ms",
                on,
                off,
                "capture off",
            )
        )
        runs_out.update({f"{mode}-{k}": v for k, v in runs.items()})
    return goals, runs_out
