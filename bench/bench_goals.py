"""The goals of issue #12, each measured against its baseline side by side in one run, at 64 concurrent.

    python -m bench.bench_goals [--quick] [--seconds N] [--rounds N] [--goals 1,2,3,4] [--no-diagnostics]
                                  [--dir DIR] [--python-loadgen]

Every server is its own process, uvicorn with its defaults (``http`` and ``loop`` on ``auto``: httptools and
uvloop when installed; the machine line says which), one worker unless the row says otherwise. The load is
wrk (one thread, 64 keep-alive connections, each request to one of 32 rollouts' ``/ng-rollout/<id>/``
paths; the uninstrumented baselines get the plain ``/v1/chat/completions`` path, since nothing strips a
prefix for them). Within a goal the servers are measured back to back in rounds whose order rotates; each
keeps its best round (highest req/s).

1. **Zero-code**: a Starlette model app (one route, ``await request.body()``, a fixed 659-byte chat
   completion) under ``opentelemetry-instrument`` with the distro, ``OTEL_TRACES_EXPORTER=model_call_jsonl``,
   ``OTEL_EXPORTER_MODEL_CALL_JSONL_DIR``, ``OTEL_METRICS_EXPORTER=none``, ``OTEL_LOGS_EXPORTER=none``; against
   the same app uninstrumented (goal >= 0.4x) and against the same app with the per-call-fsync baseline of
   NeMo Gym 0.7.0's design as its first user middleware (``_gym_baseline.py``; goal >= 2x); and (1c, issue
   34) the README's Jaeger set-up, ``OTEL_TRACES_EXPORTER=otlp,model_call_jsonl`` over OTLP/HTTP to a
   receiver in its own process (``_harness.OtlpReceiver``, which counts the spans it decodes), against the
   app uninstrumented (goal >= 0.3x).
2. **Library mode**: a raw ASGI model app inside ``ModelCallCaptureMiddleware`` with an SDK tracer provider
   and the ``model_call_jsonl`` exporter wired in code (no HTTP server span), against the app alone (>= 0.5x).
3. **Proxy**: the app ``otel-capture proxy --capture-dir`` serves (``build_proxy_app``) in front of a raw
   ASGI upstream (its own process), against calling that upstream directly (>= 0.5x, issue 34; about <= 300 us of
   proxy CPU per call); the command itself with ``--workers 2`` beside it.
4. **Streaming**: 512-event Chat Completions streams (one SSE event per ASGI message), capture on against
   off, library mode and zero-code: added server CPU per event (<= 3 us), and the median time to first event
   from a client calling one at a time, servers rotated call by call (within 0.3 ms of capture off).
5. **fsyncs per record** (<= 0.25), from the writers' own counters over the measured windows of 1-3.

Every row prints the absolute figures next to the ratio: req/s, and microseconds of server CPU per call
(user + system of the server process and its children, all threads, from ``/proc/<pid>/stat``, divided by
the calls served). CPU per call is the steadier figure on this shared machine: other tenants take cores
away (lower req/s) but do not add CPU to our process. ``other cores`` is how busy the rest of the machine
was during that window (``/proc/stat`` busy time minus the server, upstream, wrk and this driver).

Diagnostic rows (not goals; ``--no-diagnostics`` and ``--quick`` skip them) build each goal up layer by layer,
so the CPU each layer adds per call is a difference of figures measured side by side: the HTTP server span
alone around the Starlette app (zero-code's lean one, and contrib's ``OpenTelemetryMiddleware`` it replaced),
zero-code with no exporter (no record; no span built either: with no processor on the provider, only each
span's context is made, ``otel_capture._telemetry.spans``), library mode without records (``spans``: no span built),
without fsync (``capture-nosync``), and durable with spans built (``capture-traced``: one more processor that
sees the spans, as an OTLP exporter would; the exporter's own work is not in it), the proxy without
``--capture-dir``; and the bare app on uvicorn's pure-Python stack (h11 and asyncio), to show what the server
stack itself is worth per call. The measurement (servers, rounds, tables) is ``_rounds.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import _goal_floors as F
from bench import _goal_streaming as S
from bench import _harness as H
from bench import _rounds as R
from bench._servers import REQUEST_BODY


def _proxy_workers_argv(upstream_url: str, capture_dir: Path, workers: int) -> list[str]:
    return [
        H.PYTHON,
        "-m",
        "otel_capture",
        "proxy",
        "--upstream",
        upstream_url,
        "--port",
        "0",
        "--workers",
        str(workers),
        "--capture-dir",
        str(capture_dir),
    ]


# --- the goals --------------------------------------------------------------------------------------


def goal_zero_code(
    data: Path, rounds: int, seconds: int, fp: bool, diagnostics: bool, floors: bool
) -> tuple[list[R.Goal], dict[str, R.Run]]:
    with H.OtlpReceiver() as receiver:  # where the traced server's spans go, as to Jaeger
        return _goal_zero_code(data, rounds, seconds, fp, diagnostics, floors, receiver)


def _goal_zero_code(
    data: Path,
    rounds: int,
    seconds: int,
    fp: bool,
    diagnostics: bool,
    floors: bool,
    receiver: H.OtlpReceiver,
) -> tuple[list[R.Goal], dict[str, R.Run]]:
    specs = [
        R.Spec("starlette", H.server_argv("bare", "--app", "starlette"), prefixed=False),
        R.Spec(
            "zero-code",
            [R.INSTRUMENT, *H.server_argv("bare", "--app", "starlette")],
            env=R.zero_code_env(data / "zero-code"),
            capture_dir=data / "zero-code",
        ),
        R.Spec(
            "gym-fsync",
            H.server_argv("gym", "--app", "starlette", "--capture-dir", str(data / "gym")),
            capture_dir=data / "gym",
        ),
        R.Spec(
            "zero-code-otlp",
            [R.INSTRUMENT, *H.server_argv("bare", "--app", "starlette")],
            env=R.zero_code_otlp_env(data / "zero-code-otlp", receiver),
            capture_dir=data / "zero-code-otlp",
        ),
    ]
    if diagnostics:
        specs += [
            R.Spec(
                "server-span",
                [R.INSTRUMENT, *H.server_argv("server-span", "--app", "starlette")],
                env=R.server_span_only_env(),
                prefixed=False,
            ),
            R.Spec(
                "lean-server-span",
                [R.INSTRUMENT, *H.server_argv("lean-server-span", "--app", "starlette")],
                env=R.server_span_only_env(),
                prefixed=False,
            ),
            R.Spec(
                "zero-code-spans",
                [R.INSTRUMENT, *H.server_argv("bare", "--app", "starlette")],
                env=R.zero_code_env(None),
            ),
        ]
    if floors:
        specs += F.capture_floor_specs(data, "zc", "--app", "starlette")
    with R.Servers() as servers:
        for spec in specs:
            servers.start(spec)
        runs = R.rounds_of(servers, [s.name for s in specs], rounds, seconds, fp)
        disk = R.disk_check(
            servers, ["zero-code", "gym-fsync", "zero-code-otlp", *(F.FLOORS["1a"].names if floors else ())]
        )
        disk.append(R.spans_check(servers, "zero-code-otlp", receiver))
        if floors:
            disk.append(F.sync_note(servers, F.FLOORS["1a"].names[0]))
    base, zc, gym = runs["starlette"], runs["zero-code"], runs["gym-fsync"]
    traced = runs["zero-code-otlp"]
    rows = [
        ("starlette app, uninstrumented", base, None),
        ("zero-code durable capture", zc, base),
        ("gym-fsync (NeMo Gym 0.7.0 design)", gym, base),
        ("zero-code, OTLP spans and records", traced, base),
    ]
    if floors:
        rows += F.floor_rows("1a", runs, base)
    if diagnostics:
        rows += [
            ("diag: contrib HTTP server span alone (no capture)", runs["server-span"], base),
            ("diag: lean server span alone, no exporter (steps aside)", runs["lean-server-span"], base),
            ("diag: zero-code, no exporter (no span built, no record)", runs["zero-code-spans"], base),
        ]
    if diagnostics:
        disk.append(
            R.ladder(
                [
                    ("the app", base),
                    ("+ lean server span (steps aside)", runs["lean-server-span"]),
                    ("+ capture middleware (zero-code, no exporter)", runs["zero-code-spans"]),
                    ("+ record and writer (durable)", zc),
                ]
            )
        )
    R.run_table(
        "goal 1: zero-code (opentelemetry-instrument + distro) around a Starlette model app", rows, disk
    )
    goals = [
        R.Goal(
            "1a",
            "zero-code capture / uninstrumented",
            zc.rps / base.rps,
            F.FLOORS["1a"].target,
            True,
            "x",
            zc,
            base,
            "uninstrumented",
            F.floor_notes("1a", runs, zc, base) if floors else [],
        ),
        R.Goal(
            "1b",
            "zero-code capture / per-call-fsync (Gym)",
            zc.rps / gym.rps,
            2.0,
            True,
            "x",
            zc,
            gym,
            "gym-fsync",
        ),
        R.Goal(
            "1c",
            "zero-code, OTLP spans + records / uninstrumented",
            traced.rps / base.rps,
            0.3,
            True,
            "x",
            traced,
            base,
            "uninstrumented",
        ),
    ]
    return goals, runs


def goal_library(
    data: Path, rounds: int, seconds: int, fp: bool, diagnostics: bool, floors: bool
) -> tuple[list[R.Goal], dict[str, R.Run]]:
    specs = [
        R.Spec("bare", H.server_argv("bare")),
        R.Spec(
            "library",
            H.server_argv("capture", "--capture-dir", str(data / "library")),
            capture_dir=data / "library",
        ),
    ]
    if diagnostics:
        specs += [
            R.Spec("library-spans", H.server_argv("spans")),
            R.Spec(
                "library-nosync",
                H.server_argv("capture-nosync", "--capture-dir", str(data / "nosync")),
                capture_dir=data / "nosync",
            ),
            R.Spec(
                "library-traced",
                H.server_argv("capture-traced", "--capture-dir", str(data / "traced")),
                capture_dir=data / "traced",
            ),
            R.Spec(
                "bare-h11",
                H.server_argv("bare"),
                env={"BENCH_UVICORN_HTTP": "h11", "BENCH_UVICORN_LOOP": "asyncio"},
            ),
        ]
    if floors:
        specs += F.capture_floor_specs(data, "lib")
    with R.Servers() as servers:
        for spec in specs:
            servers.start(spec)
        runs = R.rounds_of(servers, [s.name for s in specs], rounds, seconds, fp)
        disk = R.disk_check(servers, ["library", *(F.FLOORS["2"].names if floors else ())])
        if floors:
            disk.append(F.sync_note(servers, F.FLOORS["2"].names[0]))
    base, lib = runs["bare"], runs["library"]
    rows = [("raw ASGI app alone", base, None), ("library mode, durable capture", lib, base)]
    if floors:
        rows += F.floor_rows("2", runs, base)
    if diagnostics:
        rows += [
            ("diag: library mode, no exporter (no span built, no record)", runs["library-spans"], base),
            ("diag: library mode, fsync off", runs["library-nosync"], base),
            (
                "diag: library mode, durable, spans built (a processor sees them)",
                runs["library-traced"],
                base,
            ),
            ("diag: raw ASGI app alone on h11 + asyncio", runs["bare-h11"], base),
        ]
    if diagnostics:
        disk.append(
            R.ladder(
                [
                    ("the app", base),
                    ("+ middleware, no span built", runs["library-spans"]),
                    ("+ record and writer, fsync off", runs["library-nosync"]),
                    ("+ fsync (durable)", lib),
                ]
            )
        )
    R.run_table("goal 2: library mode (middleware + exporter in code, no HTTP server span)", rows, disk)
    notes = F.floor_notes("2", runs, lib, base) if floors else []
    return [
        R.Goal(
            "2",
            "library capture / bare",
            lib.rps / base.rps,
            F.FLOORS["2"].target,
            True,
            "x",
            lib,
            base,
            "bare",
            notes,
        )
    ], runs


def goal_proxy(
    data: Path, rounds: int, seconds: int, fp: bool, diagnostics: bool, floors: bool
) -> tuple[list[R.Goal], dict[str, R.Run]]:
    specs = [
        R.Spec("upstream", H.server_argv("bare")),
        R.Spec(
            "proxy",
            H.server_argv("proxy", "--upstream", "{upstream}", "--capture-dir", str(data / "proxy")),
            capture_dir=data / "proxy",
            upstream="upstream",
        ),
        R.Spec(
            "proxy-w2",
            _proxy_workers_argv("{upstream}", data / "proxy-w2", 2),
            capture_dir=data / "proxy-w2",
            stats=False,
            upstream="upstream",
        ),
    ]
    if diagnostics:
        specs.append(
            R.Spec("proxy-off", H.server_argv("proxy", "--upstream", "{upstream}"), upstream="upstream")
        )
    if floors:
        specs += [
            R.Spec(name, H.server_argv(name, "--upstream", "{upstream}"), upstream="upstream")
            for name in F.FLOORS["3a"].names
        ]
    names = [s.name for s in specs]
    with R.Servers() as servers:
        for spec in specs:
            servers.start(spec)
        runs = R.rounds_of(
            servers, names, rounds, seconds, fp, upstreams={n: "upstream" for n in names if n != "upstream"}
        )
        disk = R.disk_check(servers, ["proxy"])
        lines_w2 = H.count_lines(data / "proxy-w2")
    base, proxy, w2 = runs["upstream"], runs["proxy"], runs["proxy-w2"]
    rows = [
        ("upstream called directly", base, None),
        ("proxy with capture, 1 worker", proxy, base),
        ("proxy with capture, --workers 2", w2, base),
    ]
    if diagnostics:
        rows.append(("diag: proxy without --capture-dir (no span built)", runs["proxy-off"], base))
    if floors:
        rows += F.floor_rows("3a", runs, base)
    R.run_table(
        "goal 3: otel-capture proxy in front of an upstream that answers at once",
        rows,
        [
            *disk,
            f"proxy-w2: {lines_w2:,} lines on disk (its workers' counters are not reachable)",
            "CPU us/call of a proxy row: the proxy's processes only; the upstream's is in its own column",
        ],
    )
    goals = [
        R.Goal(
            "3a",
            "proxy capture / upstream direct",
            proxy.rps / base.rps,
            F.FLOORS["3a"].target,  # issue 34's goal (0.3x before)
            True,
            "x",
            proxy,
            base,
            "upstream direct",
            F.floor_notes("3a", runs, proxy, base) if floors else [],
        ),
        R.Goal(
            "3b",
            "proxy CPU per call, 1 worker",
            proxy.cpu_us,
            300.0,
            False,
            "us",
            proxy,
            base,
            "upstream direct",
            [
                f"3b: the proxy's CPU per call is {(proxy.cpu_us or 0) / (base.cpu_us or 1):.1f}x the upstream's "
                f"({base.cpu_us or 0:.0f} us in this run); keeping 0.3x of the upstream's throughput on other cores needs "
                "about 3.3x at most, which is what 300 us was on the machine the goal was set on"
            ],
        ),
        R.Goal(
            "3c",
            "(shown) proxy --workers 2 / direct",
            w2.rps / base.rps,
            0.5,
            True,
            "x",
            w2,
            base,
            "upstream direct",
        ),
    ]
    return goals, runs


def fsync_goal(runs: dict[str, R.Run]) -> R.Goal:
    parts = [(name, r) for name, r in runs.items() if r.records and name in ("zero-code", "library", "proxy")]
    if not parts:
        return R.Goal("5", "fsyncs per record", None, 0.25, False, "")
    worst_name, worst = max(parts, key=lambda p: p[1].fsyncs / p[1].records)
    note = "5: fsyncs per record: " + ", ".join(
        f"{n} {r.fsyncs / r.records:.3f} ({r.records:,} records)" for n, r in parts
    )
    return R.Goal(
        "5",
        f"fsyncs per record (worst: {worst_name})",
        worst.fsyncs / worst.records,
        0.25,
        False,
        "",
        worst,
        None,
        "-",
        [note],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="one round of 2 s, no diagnostic rows, fewer TTFT calls"
    )
    parser.add_argument("--seconds", type=int, help="seconds per measured run (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, help="rotated rounds per server (default 2; quick 1)")
    parser.add_argument(
        "--goals", default="1,2,3,4", help="which goals to measure (default 1,2,3,4; 5 comes with 1-3)"
    )
    parser.add_argument("--no-diagnostics", action="store_true", help="only the goals' own servers")
    parser.add_argument(
        "--no-floors", action="store_true", help="without the floor rows of goals 1-3 (bench/_floors.py)"
    )
    parser.add_argument(
        "--ttft-calls", type=int, help="streamed calls per server for time to first event (default 200)"
    )
    parser.add_argument("--dir", help="where capture files go (default: a new temporary directory)")
    parser.add_argument(
        "--python-loadgen", action="store_true", help="the Python fallback even if wrk is installed"
    )
    args = parser.parse_args(argv)
    seconds = args.seconds or (2 if args.quick else 3)
    rounds = args.rounds or (1 if args.quick else 2)
    diagnostics = not (args.quick or args.no_diagnostics)
    floors = not args.no_floors
    ttft_calls = args.ttft_calls or (40 if args.quick else 200)
    wanted = {g.strip() for g in args.goals.split(",")}
    fp = args.python_loadgen
    data = Path(tempfile.mkdtemp(prefix="otel-capture-goals-", dir=args.dir))
    print(
        f"== bench_goals: issue #12's goals, {R.CONCURRENCY} concurrent, each against its baseline side by side =="
    )
    print(H.machine_line(data))
    print(H.package_line())
    gauge_start = H.speed_gauge()
    print(
        f"speed gauge: sum(range(1000)) takes {gauge_start:.1f} us on one core now (roughly 10 us on an idle "
        "recent core): CPU-per-call figures of this run are inflated by that factor alike"
    )
    impl = H.uvicorn_impl()
    if "httptools" not in impl or "uvloop" not in impl:
        print(
            f"NOTE: {impl}: install httptools and uvloop (uvicorn[standard]) to measure the stack that serves "
            "the most calls per core"
        )
    print(f"load generator: {H.loadgen_name(fp)}, {R.CONCURRENCY} connections")
    print(
        f"{rounds} round(s) x {seconds} s per server, rotated, best round kept; 1 s warm-up; "
        f"request {len(REQUEST_BODY)} B (streamed: {len(S.STREAM_REQUEST_BODY)} B), {R.ROLLOUTS} rollouts"
    )
    t0 = time.monotonic()
    goals: list[R.Goal] = []
    all_runs: dict[str, R.Run] = {}
    steps: list[tuple[str, Callable[[], tuple[list[R.Goal], dict[str, R.Run]]]]] = [
        ("1", lambda: goal_zero_code(data, rounds, seconds, fp, diagnostics, floors)),
        ("2", lambda: goal_library(data, rounds, seconds, fp, diagnostics, floors)),
        ("3", lambda: goal_proxy(data, rounds, seconds, fp, diagnostics, floors)),
        ("4", lambda: S.goal_streaming(data, rounds, seconds, fp, ttft_calls)),
    ]
    try:
        for number, step in steps:
            if number in wanted:
                g, r = step()
                goals += g
                all_runs.update(r)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    if any(n in wanted for n in "123"):
        goals.append(fsync_goal(all_runs))
    R.goals_table(goals)
    F.floors_table(all_runs)
    others = [r.others_cores for r in all_runs.values()]
    try:
        load_end = f"load avg {os.getloadavg()[0]:.2f} at the end; "
    except OSError:
        load_end = ""
    print(f"speed gauge at the end: {H.speed_gauge():.1f} us (at the start: {gauge_start:.1f} us)")
    print(
        f"machine: {load_end}other tenants used {statistics.median(others):.2f} cores at the median over the "
        f"{len(others)} measured windows (max {max(others):.2f}) of {os.cpu_count()}; "
        f"errors over all runs: {sum(r.errors for r in all_runs.values())}; took {time.monotonic() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
