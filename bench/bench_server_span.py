"""Zero-code's HTTP server span before and after ``LeanServerSpanMiddleware``, side by side in one run.

    python bench/bench_server_span.py [--quick] [--before REV] [--after REV] [--seconds N] [--rounds N]
                                      [--no-http]

1. **In process, no HTTP** (steady, exact): one ``POST /ng-rollout/<id>/v1/chat/completions`` at a time
   through each server span alone around a trivial ASGI app, with an SDK tracer provider (one processor that
   does nothing but sees the spans, so both are built) and
   what the distro installs under ``OTEL_METRICS_EXPORTER=none`` (an SDK meter provider without a reader):
   microseconds of CPU per request (best of several repeats), and the SDK work per request counted by
   cProfile: attribute validations, ``set_attribute`` calls, histogram records, counter adds, context
   attaches. Contrib's ``OpenTelemetryMiddleware`` runs as zero-code ran it (``exclude_spans`` send and
   receive, our span names, ``OTEL_SEMCONV_STABILITY_OPT_IN`` unset).
2. **Over HTTP**, as ``bench_goals.py`` goal 1 (the Starlette model app under ``opentelemetry-instrument``
   with the distro, wrk at 64 concurrent, rotated rounds, best round kept): the app alone; each server
   span alone (contrib's, the lean one); zero-code with no exporter and zero-code durable capture, each
   with the package as it was at ``--before`` and as it is at ``--after``. Each revision is a ``git
   archive`` on ``PYTHONPATH`` (with this checkout's ``bench/``, so only the package differs); the run
   prints which package files differ between the two.

``--before`` defaults to the commit before ``otel_capture/_server_span.py`` was added, ``--after`` to
``HEAD``. Absolute figures (req/s, CPU per call) stand beside every ratio; see docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H
import bench_goals as G
from _servers import REQUEST_BODY, RESPONSE_BODY

# (label, function names, a part of the path of the file that defines them): the SDK work counted per request
COUNTED = (
    ("spans", ("start_span",), "opentelemetry/sdk/trace/__init__"),
    ("attribute validations", ("_clean_attribute_value",), "opentelemetry/attributes"),
    ("set_attribute(s) calls", ("set_attribute", "set_attributes"), "opentelemetry/sdk/trace/__init__"),
    ("histogram records", ("record",), "opentelemetry/sdk/metrics"),
    ("counter adds", ("add",), "opentelemetry/sdk/metrics"),
    ("context attaches", ("attach",), "opentelemetry/context/__init__"),
)


# --- 1. in process -------------------------------------------------------------------------------------


async def _model_app(scope: Any, receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(RESPONSE_BODY)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": RESPONSE_BODY})


def _scope(i: int) -> dict[str, Any]:
    path = f"/ng-rollout/r-{i % 32}/v1/chat/completions"
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"user-agent", b"wrk"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(REQUEST_BODY)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


def _variants() -> dict[str, Any]:
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    from otel_capture._routing import server_span_details
    from otel_capture._server_span import LeanServerSpanMiddleware

    tracer, meter = TracerProvider(), MeterProvider()  # no reader (OTEL_METRICS_EXPORTER=none)
    # one processor that does nothing but sees the spans (as an exporter's would), so both server spans are
    # built: with no processor at all the lean one would make only its context (otel_capture._spans)
    tracer.add_span_processor(SpanProcessor())
    return {
        "the app alone": _model_app,
        "contrib OpenTelemetryMiddleware": OpenTelemetryMiddleware(
            _model_app,
            tracer_provider=tracer,
            meter_provider=meter,
            exclude_spans=["receive", "send"],
            default_span_details=server_span_details,
        ),
        "LeanServerSpanMiddleware": LeanServerSpanMiddleware(
            _model_app, tracer_provider=tracer, meter_provider=meter, default_span_details=server_span_details
        ),
    }


def _drive(app: Any, n: int) -> Callable[[], None]:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": REQUEST_BODY, "more_body": False}

    async def send(message: Any) -> None:
        pass

    async def many() -> None:
        for i in range(n):
            await app(_scope(i), receive, send)

    return lambda: asyncio.run(many())


def in_process(n: int, repeats: int) -> None:
    variants = _variants()
    rows: list[list[Any]] = []
    base_us: float | None = None
    for label, app in variants.items():
        run = _drive(app, n)
        run()  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            run()
            best = min(best, time.process_time() - t0)
        us = best / n * 1e6
        profile = cProfile.Profile()
        profile.runcall(run)
        counts = _counts(pstats.Stats(profile), n)
        base_us = us if base_us is None else base_us
        rows.append([label, us, us - base_us if label != "the app alone" else None, *counts])
    header = ["server span (in process, no HTTP)", "CPU us/req", "+ vs app", *(c[0] for c in COUNTED)]
    H.print_table(
        f"1. in process: {n} requests x best of {repeats}, SDK tracer provider with a do-nothing processor, "
        "SDK meter provider without reader",
        header,
        rows,
        ["counts are per request, exact (cProfile); CPU is this process's, best repeat"],
    )


def _counts(stats: pstats.Stats, n: int) -> list[float]:
    table: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]  # pstats' own table
    out = []
    for _label, functions, where in COUNTED:
        calls = sum(v[1] for (path, _line, name), v in table.items() if name in functions and where in path)
        out.append(calls / n)
    return out


# --- 2. over HTTP --------------------------------------------------------------------------------------


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=H.REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def _snapshot(rev: str, into: Path, overlay: tuple[str, list[str]] | None = None) -> Path:
    """The package at ``rev`` laid out as installed (``exporters/`` inside it), with this checkout's bench;
    ``overlay``: another revision and the paths taken from it instead."""
    into.mkdir(parents=True)
    for source, paths in ((rev, ["otel_capture", "exporters"]), *([overlay] if overlay else [])):
        archive = subprocess.run(
            ["git", "archive", source, *paths], cwd=H.REPO, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    shutil.move(str(into / "exporters"), str(into / "otel_capture" / "exporters"))
    shutil.copytree(H.BENCH, into / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def _argv(source: Path, variant: str) -> list[str]:
    # run from the snapshot: opentelemetry-instrument puts the working directory on PYTHONPATH ahead of ours,
    # and the harness starts servers in this checkout (whose otel_capture would be imported instead)
    return [
        "env",
        "-C",
        str(source),
        G.INSTRUMENT,
        H.PYTHON,
        str(source / "bench" / "_servers.py"),
        variant,
        "--app",
        "starlette",
    ]


def _imported_from(source: Path) -> str:
    """Where a server started as :func:`_argv` starts them imports ``otel_capture`` from (checked, not assumed)."""
    env = {**H._clean_environ(), **G._zero_code_env(None), "PYTHONPATH": str(source)}
    argv = [
        "env",
        "-C",
        str(source),
        G.INSTRUMENT,
        H.PYTHON,
        "-c",
        "import otel_capture; print(otel_capture.__file__)",
    ]
    where = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(str(source)):
        raise RuntimeError(f"a server from {source} would import otel_capture from {where}")
    return where


def over_http(
    before: str, after: tuple[str, list[str]], data: Path, rounds: int, seconds: int, fp: bool
) -> None:
    """``after``: a revision and, if any, the only paths taken from it (the rest as at ``before``)."""
    old = _snapshot(before, data / "src-before")
    new = (
        _snapshot(before, data / "src-after", after) if after[1] else _snapshot(after[0], data / "src-after")
    )
    before, label = (
        before,
        after[0] + (f" ({', '.join(Path(p).name for p in after[1])} only)" if after[1] else ""),
    )
    for source in (old, new):
        _imported_from(source)
    # BENCH_SEES_SPANS: a processor that does nothing but sees the spans, so they are built (with none, ours
    # would make only their context; contrib's builds them regardless)
    span_only = {
        **G._zero_code_env(None),
        "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "otel_capture",
        "BENCH_SEES_SPANS": "1",
    }
    specs = [G.Spec("starlette", H.server_argv("bare", "--app", "starlette"), prefixed=False)]
    specs += [
        G.Spec(
            "contrib-span",
            _argv(new, "server-span"),
            env={**span_only, "PYTHONPATH": str(new)},
            prefixed=False,
        ),
        G.Spec(
            "lean-span",
            _argv(new, "lean-server-span"),
            env={**span_only, "PYTHONPATH": str(new)},
            prefixed=False,
        ),
    ]
    for tag, source in (("before", old), ("after", new)):
        specs.append(
            G.Spec(
                f"spans-{tag}",
                _argv(source, "bare"),
                env={**G._zero_code_env(None), "PYTHONPATH": str(source), "BENCH_SEES_SPANS": "1"},
            )
        )
        directory = data / f"capture-{tag}"
        specs.append(
            G.Spec(
                f"capture-{tag}",
                _argv(source, "bare"),
                capture_dir=directory,
                env={**G._zero_code_env(directory), "PYTHONPATH": str(source)},
            )
        )
    with G.Servers() as servers:
        for spec in specs:
            servers.start(spec)
        runs = G.rounds_of(servers, [s.name for s in specs], rounds, seconds, fp)
        disk = G._disk_check(servers, ["capture-before", "capture-after"])
    base = runs["starlette"]
    rows = [
        ("starlette app, uninstrumented", base, None),
        ("contrib server span alone", runs["contrib-span"], base),
        ("lean server span alone", runs["lean-span"], base),
        (f"zero-code, spans only, {before}", runs["spans-before"], base),
        (f"zero-code, spans only, {label}", runs["spans-after"], base),
        (f"zero-code durable capture, {before}", runs["capture-before"], base),
        (f"zero-code durable capture, {label}", runs["capture-after"], base),
    ]
    notes = [*disk, *_savings(runs)]
    G.run_table(
        f"2. over HTTP: goal 1's servers, {G.CONCURRENCY} concurrent, package at {before} and {label}",
        rows,
        notes,
    )


def _savings(runs: dict[str, G.Run]) -> list[str]:
    def us(name: str) -> float:
        return runs[name].cpu_us or 0.0

    app = us("starlette")
    lines = [
        f"server span alone, CPU per call over the app: contrib +{us('contrib-span') - app:.0f} us, "
        f"lean +{us('lean-span') - app:.0f} us"
    ]
    for what in ("spans", "capture"):
        b, a = runs[f"{what}-before"], runs[f"{what}-after"]
        lines.append(
            f"zero-code {what}: {us(f'{what}-before'):.0f} -> {us(f'{what}-after'):.0f} us CPU per call "
            f"({us(f'{what}-after') - us(f'{what}-before'):+.0f} us), {b.rps:,.0f} -> {a.rps:,.0f} req/s "
            f"({a.rps / b.rps:.2f}x)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer requests in process; one round of 2 s over HTTP"
    )
    parser.add_argument(
        "--before", help="package revision before (default: the commit before _server_span.py)"
    )
    parser.add_argument("--after", default="HEAD", help="package revision after (default HEAD)")
    parser.add_argument(
        "--only",
        help="comma-separated package paths: 'after' is --before with only these taken from --after (leaves "
        "out other engineers' commits in between)",
    )
    parser.add_argument("--seconds", type=int, help="seconds per measured HTTP run (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, help="rotated rounds per server (default 2; quick 1)")
    parser.add_argument("--no-http", action="store_true", help="only the in-process part")
    parser.add_argument(
        "--python-loadgen", action="store_true", help="the Python fallback even if wrk is installed"
    )
    args = parser.parse_args(argv)
    added = _git("log", "--diff-filter=A", "--format=%h", "--", "otel_capture/_server_span.py").splitlines()
    before = args.before or (f"{added[-1]}^" if added else "HEAD")
    before, after = _git("rev-parse", "--short", before), _git("rev-parse", "--short", args.after)
    print("== bench_server_span: zero-code's HTTP server span, contrib's against the lean one ==")
    print(H.machine_line())
    print(
        f"speed gauge: sum(range(1000)) takes {H.speed_gauge():.1f} us on one core now (roughly 10 us idle)"
    )
    in_process(2_000 if args.quick else 10_000, 3 if args.quick else 5)
    if args.no_http:
        return 0
    only = [p.strip() for p in (args.only or "").split(",") if p.strip()]
    changed = _git(
        "diff", "--stat", before, after, "--", *(only or ["otel_capture", "exporters"])
    ).splitlines()
    print(f"\npackage {before} -> {after}: {changed[-1].strip() if changed else 'no package change'}")
    for line in changed[:-1]:
        print(f"  {line.strip()}")
    print(f"load generator: {H.loadgen_name(args.python_loadgen)}, {G.CONCURRENCY} connections")
    data = Path(tempfile.mkdtemp(prefix="otel-capture-server-span-"))
    try:
        over_http(
            before,
            (after, only),
            data,
            args.rounds or (1 if args.quick else 2),
            args.seconds or (2 if args.quick else 3),
            args.python_loadgen,
        )
    finally:
        shutil.rmtree(data, ignore_errors=True)
    with contextlib.suppress(OSError):
        print(f"machine: load avg {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
