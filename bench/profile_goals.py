"""Where a captured call's CPU goes: each of issue #12's configurations profiled under load, by component.

    python bench/profile_goals.py [--configs zero-code,library,...] [--seconds N] [--no-cprofile] [--no-strace]

Not a benchmark (``run_all.py`` does not run it): a profiler attached to the server process, which slows it.
For each configuration, the server runs in its own process under wrk (64 connections, 32 rollouts), and:

1. **CPU per call** without any profiler: user and system time of the server process from ``/proc``, per call
   (kernel time is the syscalls: socket writes, epoll, file writes, fsync);
2. **py-spy** (``--gil``: only the thread holding the GIL, so the samples are Python CPU time, not waiting)
   attributes every sample to a component by the innermost frame that belongs to one: the HTTP server and
   event loop, the contrib ASGI server span, the OpenTelemetry SDK (span, attribute validation, context,
   metrics: split by whose span called it, the contrib server span or our model-call span), our middleware,
   the call's parsing and record line, the writer thread, the app. The shares are scaled to the user CPU
   per call measured in step 1;
3. **cProfile** of the event-loop thread (``BENCH_CPROFILE``): exact call counts per request of what the
   issue names (``_clean_attribute_value``, histogram records, spans started, ...);
4. **strace -c -f** on the server: system calls per request (the writer's opens, closes, flocks, writes,
   fsyncs/syncfs, stats).

Configurations: ``starlette`` / ``server-span`` / ``zero-code`` / ``zero-code-spans`` (goal 1), ``bare`` / ``library`` /
``library-spans`` / ``library-nosync`` (goal 2), ``proxy`` / ``proxy-off`` (goal 3, against an upstream in
its own process), ``gym`` (the Starlette app with the per-call-fsync baseline), ``stream-bare`` (512-event
streams, no capture), ``stream-library`` and ``stream-zero-code`` (512-event streams, capture on).
"""

from __future__ import annotations

import argparse
import collections
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H
from _servers import REQUEST_BODY

INSTRUMENT = str(Path(H.PYTHON).with_name("opentelemetry-instrument"))
PY_SPY = shutil.which("py-spy", path=str(Path(H.PYTHON).parent)) or shutil.which("py-spy")
STREAM_BODY = orjson.dumps(
    {**orjson.loads(REQUEST_BODY), "stream": True, "stream_options": {"include_usage": True}}
)
CONCURRENCY = 64


def _zc_env(directory: Path | None) -> dict[str, str]:
    env = {"OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}
    if directory is None:
        env["OTEL_TRACES_EXPORTER"] = "none"
    else:
        env.update(OTEL_TRACES_EXPORTER="model_call_jsonl", OTEL_EXPORTER_MODEL_CALL_JSONL_DIR=str(directory))
    return env


@dataclass
class Config:
    argv: list[str]
    env: dict[str, str] | None = None
    prefixed: bool = True
    upstream: bool = False  # needs a bare upstream; "{upstream}" in argv is replaced by its URL
    body: bytes = REQUEST_BODY


def configs(data: Path) -> dict[str, Config]:
    st = H.server_argv("bare", "--app", "starlette")
    return {
        "starlette": Config(st, prefixed=False),
        "zero-code": Config([INSTRUMENT, *st], env=_zc_env(data / "zero-code")),
        # spans built, no records: a processor that sees them (BENCH_SEES_SPANS), else only their context is made
        "zero-code-spans": Config([INSTRUMENT, *st], env={**_zc_env(None), "BENCH_SEES_SPANS": "1"}),
        "server-span": Config(
            [INSTRUMENT, *H.server_argv("server-span", "--app", "starlette")],
            env={**_zc_env(None), "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "otel_capture"},
            prefixed=False,
        ),
        "gym": Config(H.server_argv("gym", "--app", "starlette", "--capture-dir", str(data / "gym"))),
        "bare": Config(H.server_argv("bare")),
        "library": Config(H.server_argv("capture", "--capture-dir", str(data / "library"))),
        "library-spans": Config(H.server_argv("spans"), env={"BENCH_SEES_SPANS": "1"}),
        "library-nosync": Config(H.server_argv("capture-nosync", "--capture-dir", str(data / "nosync"))),
        "proxy": Config(
            H.server_argv("proxy", "--upstream", "{upstream}", "--capture-dir", str(data / "proxy")),
            upstream=True,
        ),
        "proxy-off": Config(H.server_argv("proxy", "--upstream", "{upstream}"), upstream=True),
        "stream-bare": Config(H.server_argv("bare", "--events", "512"), prefixed=False, body=STREAM_BODY),
        "stream-library": Config(
            H.server_argv("capture", "--events", "512", "--capture-dir", str(data / "sl")), body=STREAM_BODY
        ),
        "stream-zero-code": Config(
            [INSTRUMENT, *H.server_argv("bare", "--app", "starlette", "--events", "512")],
            env=_zc_env(data / "szc"),
            body=STREAM_BODY,
        ),
    }


# --- components -------------------------------------------------------------------------------------

_CONTRIB = ("opentelemetry/instrumentation/", "opentelemetry/util/http", "opentelemetry/semconv")
_SDK_GROUPS = [
    ("attribute validation", ("opentelemetry/attributes/",)),
    ("metrics (histograms, counters)", ("opentelemetry/sdk/metrics", "opentelemetry/metrics")),
    (
        "span (SDK/API: create, end, processors, ids)",
        (
            "opentelemetry/sdk/trace",
            "opentelemetry/trace",
            "opentelemetry/sdk/util",
            "opentelemetry/util/",
            "opentelemetry/sdk/resources",
        ),
    ),
    (
        "context, propagation, baggage",
        ("opentelemetry/context", "opentelemetry/propagat", "opentelemetry/baggage"),
    ),
]
_GROUPS = [
    ("writer thread (otel_capture/_store)", ("otel_capture/_store/",)),
    (
        "call: parse, reassemble, record line",
        (
            "otel_capture/_call.py",
            "otel_capture/_dialects/",
            "otel_capture/_records/",
            "otel_capture/_semconv.py",
            "otel_capture/_attributes.py",
            "orjson",
        ),
    ),
    ("capture middleware and sink (ours)", ("otel_capture/", "exporters/")),
    ("contrib ASGI server span (its own code)", _CONTRIB),
    ("proxy client: httpx/httpcore/h11", ("httpx/", "httpcore/", "h11/")),
    ("proxy client: aiohttp, multidict, yarl", ("aiohttp/", "multidict/", "yarl/", "propcache/")),
    ("anyio", ("anyio/",)),
    ("Starlette (the app's framework)", ("starlette/",)),
    ("Gym baseline middleware", ("_gym_baseline.py",)),
    ("the model app (bench)", ("_servers.py",)),
    (
        "uvicorn + httptools + event loop",
        ("uvicorn/", "httptools", "asyncio/", "uvloop", "selectors.py", "socket.py"),
    ),
    ("threads, queues, futures", ("threading.py", "queue.py", "concurrent/")),
]


def component(frames: list[str]) -> str:
    """The innermost frame that belongs to a known component names the sample's component; SDK frames
    are split by whose span they serve (the innermost of the contrib middleware and our code above them)."""
    for i in range(len(frames) - 1, -1, -1):
        frame = frames[i]
        for name, needles in _SDK_GROUPS:
            if any(n in frame for n in needles):
                owner = "?"
                for above in reversed(frames[:i]):
                    if any(n in above for n in _CONTRIB):
                        owner = "contrib server span"
                        break
                    if "otel_capture/" in above or "exporters/" in above:
                        owner = "model-call span (ours)"
                        break
                return f"SDK {name} <- {owner}"
        for name, needles in _GROUPS:
            if any(n in frame for n in needles):
                return name
    return "other"


def read_folded(path: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            out.append((stack.split(";"), int(count)))
    return out


# --- measuring --------------------------------------------------------------------------------------


def _wrk(url: str, config: Config, seconds: int) -> H.LoadResult:
    return H.run_load(
        url, body=config.body, concurrency=CONCURRENCY, seconds=seconds, rollouts=32 if config.prefixed else 0
    )


def _start(
    name: str, config: Config, upstream: H.ServerProcess | None, extra_env: dict[str, str] | None = None
) -> H.ServerProcess:
    argv = [upstream.url if (a == "{upstream}" and upstream) else a for a in config.argv]
    return H.ServerProcess(argv, env={**(config.env or {}), **(extra_env or {})}, name=name)


def profile(
    name: str, config: Config, seconds: int, data: Path, use_cprofile: bool, use_strace: bool
) -> None:
    for sub in ("zero-code", "gym", "library", "nosync", "proxy", "sl", "szc"):
        (data / sub).mkdir(parents=True, exist_ok=True)
    upstream = H.ServerProcess(H.server_argv("bare"), name="upstream") if config.upstream else None
    try:
        print(
            f"\n######## {name}: {' '.join(Path(a).name if a.startswith('/') else a for a in config.argv)}"
            + (f"  env {config.env}" if config.env else ""),
            flush=True,
        )
        with _start(name, config, upstream) as server:
            _wrk(server.url, config, 1)  # warm-up
            # 1. CPU per call, no profiler
            u0, s0 = H.cpu_split(server.pid)
            busy0 = H.system_busy_seconds()
            t0 = time.monotonic()
            load = _wrk(server.url, config, seconds)
            wall = time.monotonic() - t0
            u1, s1 = H.cpu_split(server.pid)
            busy = H.system_busy_seconds() - busy0
            n = max(load.requests, 1)
            user_us, sys_us = (u1 - u0) / n * 1e6, (s1 - s0) / n * 1e6
            print(
                f"no profiler: {load.rps:,.0f} req/s, CPU per call {user_us + sys_us:.0f} us (user {user_us:.0f}, "
                f"system {sys_us:.0f}); server {(u1 - u0 + s1 - s0) / wall:.2f} cores; machine busy "
                f"{busy / wall:.2f} of {os.cpu_count()} cores; errors {load.errors}"
            )
            # 2. py-spy, GIL holder only
            if PY_SPY:
                _py_spy(server, config, seconds, user_us, data / f"{name}.folded")
            # 4. strace: syscalls per request
            if use_strace and shutil.which("strace"):
                _strace(server, config, seconds, data / f"{name}.strace")
        if use_cprofile:  # 3. a fresh server under cProfile
            _cprofile(name, config, upstream, seconds, data / f"{name}.pstats")
    finally:
        if upstream:
            upstream.stop()


def _py_spy(server: H.ServerProcess, config: Config, seconds: int, user_us: float, out: Path) -> None:
    spy = subprocess.Popen(
        [
            PY_SPY,
            "record",
            "--gil",
            "--nonblocking",
            "--full-filenames",
            "-r",
            "400",
            "-d",
            str(seconds),
            "-f",
            "raw",
            "-o",
            str(out),
            "-p",
            str(server.pid),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.5)
    load = _wrk(server.url, config, seconds)
    _, err = spy.communicate(timeout=seconds + 60)
    if not out.exists():
        print(f"py-spy failed: {err.decode()[-500:]}")
        return
    samples = read_folded(out)
    total = sum(c for _, c in samples)
    by_component: collections.Counter[str] = collections.Counter()
    by_function: collections.Counter[str] = collections.Counter()
    by_thread: collections.Counter[str] = collections.Counter()
    for frames, count in samples:
        by_component[component(frames)] += count
        by_function[frames[-1]] += count
        by_thread[
            "writer thread"
            if any("otel_capture/_store/writer.py" in f for f in frames)
            else ("event loop" if any(("asyncio" in f or "uvicorn" in f) for f in frames) else frames[0])
        ] += count
    print(
        f"py-spy --gil: {total} samples (GIL held) while serving {load.rps:,.0f} req/s; shares scaled to the "
        f"{user_us:.0f} us of user CPU per call measured without the profiler:"
    )
    for comp, count in by_component.most_common():
        print(f"  {count / total:6.1%}  {count / total * user_us:7.1f} us  {comp}")
    print("  by thread: " + ", ".join(f"{t} {c / total:.1%}" for t, c in by_thread.most_common(4)))
    print("  top functions (self):")
    for fn, count in by_function.most_common(18):
        print(f"  {count / total:6.1%}  {count / total * user_us:7.1f} us  {fn}")


def _cprofile(name: str, config: Config, upstream: H.ServerProcess | None, seconds: int, out: Path) -> None:
    with _start(name, config, upstream, {"BENCH_CPROFILE": str(out)}) as server:
        requests = _wrk(server.url, config, 1).requests + _wrk(server.url, config, seconds).requests
    # the stats are written when the server stops (on leaving the block)
    if not out.exists():
        print("cProfile: no stats written")
        return
    stats = pstats.Stats(str(out))
    rows: dict[str, int] = collections.defaultdict(int)
    for (filename, line, function), (_cc, nc, _tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows[f"{Path(filename).parent.name}/{Path(filename).name}:{line}({function})"] += nc
    # wrk counts the answers it read; the server also served the calls in flight when wrk stopped. Count
    # what runs once per call in the server: our metrics' record (once per captured call), else uvicorn's
    # on_headers_complete (once per request parsed).
    served = sum(
        v for k, v in rows.items() if k.startswith("otel_capture/_metrics.py") and k.endswith("(record)")
    )
    what = "captured calls"
    if not served:
        served = sum(
            v for k, v in rows.items() if "httptools_impl.py" in k and k.endswith("(on_headers_complete)")
        )
        what = "requests parsed"
    if served:
        requests = served
    else:
        what = "answers wrk read"
    print(
        f"cProfile (event-loop thread only; {requests:,} {what}): calls per call of plain functions (a "
        "coroutine counts once per resumption, so async functions are left out)"
    )
    wanted = (
        "_clean_attribute_value",
        "(start_span)",
        "(record)",
        "(add)",
        "(set_attribute)",
        "(set_attributes)",
        "(attach)",
        "(extract)",
        "(end)",
        "(_set_items)",
        "(get_current_span)",
        "(dumps)",
        "(loads)",
        "(create_future)",
        "(call_soon_threadsafe)",
        "(submit)",
        "(begin)",
        "(put)",
        "(getpid)",
        "(collect_request_attributes)",
        "(get_host_port_url_tuple)",
        "(_parse_url_query)",
        "(urandom)",
        "(getrandbits)",
        "(time_ns)",
        "(perf_counter)",
        "(isinstance)",
    )
    picked = sorted(((k, v) for k, v in rows.items() if any(w in k for w in wanted)), key=lambda kv: -kv[1])
    for key, count in picked[:30]:
        if count / requests >= 0.5:
            print(f"  {count / requests:8.2f}  {key}")
    total_tt = sum(v[2] for v in stats.stats.values()) or 1  # type: ignore[attr-defined]
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]  # type: ignore[attr-defined]
    print("  top by own time (cProfile's own clock, inflated by the profiler):")
    for (filename, line, function), (_cc, nc, tt, _ct, _callers) in top:
        print(f"  {tt / total_tt:6.1%}  {nc / requests:6.2f}/req  {Path(filename).name}:{line}({function})")


def _strace(server: H.ServerProcess, config: Config, seconds: int, out: Path) -> None:
    tracer = subprocess.Popen(
        ["strace", "-f", "-c", "-o", str(out), "-p", str(server.pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    load = _wrk(server.url, config, seconds)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(30)
    n = max(load.requests, 1)
    lines = out.read_text().splitlines() if out.exists() else []
    calls = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            try:
                count = int(parts[3])
            except ValueError:
                continue
            calls.append((parts[-1], count))
    calls.sort(key=lambda c: -c[1])
    print(
        f"strace -c -f ({load.requests:,} requests, slowed by strace): system calls per request: "
        + ", ".join(f"{name} {count / n:.2f}" for name, count in calls[:16])
    )


def reassembly(events: int = 512) -> None:
    """One streamed call's capture work without HTTP: ``InFlightCall`` fed ``events`` chat chunks one by one
    (request parse, SSE decoding, reassembly, end attributes, record line), against the same call with a
    small JSON answer; the difference per event is the reassembly's own CPU (one thread, no GIL contention,
    no socket). Uses package internals: it says so and returns if they moved."""
    import timeit

    from _servers import chat_events

    try:
        from otel_capture import CaptureSettings
        from otel_capture._call import InFlightCall
        from otel_capture._dialects import DIALECT_PATHS
    except ImportError as exc:
        print(f"\n######## stream reassembly without HTTP: skipped, the internals moved ({exc})")
        return
    bodies = chat_events(events)
    dialect = DIALECT_PATHS["/v1/chat/completions"]
    settings = CaptureSettings()

    def call(streamed: bool) -> None:
        c = InFlightCall(dialect, "r1", settings)
        c.set_request(STREAM_BODY)
        if streamed:
            c.on_response_start(200, "text/event-stream")
            for body in bodies:
                c.on_body(body)
        else:
            c.on_response_start(200, "application/json")
            c.on_body(b'{"id":"x","object":"chat.completion","choices":[]}')
        c.finish(exception=None, cancelled=False)
        c.end_attributes()
        c.line(1, 2)

    streamed = min(timeit.repeat(lambda: call(True), number=20, repeat=5)) / 20 * 1e6
    plain = min(timeit.repeat(lambda: call(False), number=200, repeat=5)) / 200 * 1e6
    print(f"\n######## stream reassembly without HTTP ({events} chat chunks, one ASGI message each)")
    print(
        f"InFlightCall: {streamed:,.0f} us for the streamed call, {plain:,.0f} us for a JSON one: "
        f"{(streamed - plain) / (len(bodies)):.2f} us per event (speed gauge now {H.speed_gauge():.1f} us)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        default="starlette,zero-code,zero-code-spans,bare,library,library-spans,library-nosync,proxy,proxy-off",
    )
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--no-cprofile", action="store_true")
    parser.add_argument("--no-strace", action="store_true")
    parser.add_argument(
        "--no-reassembly", action="store_true", help="skip the stream reassembly measured without HTTP"
    )
    parser.add_argument(
        "--keep", help="keep the raw profiles (folded stacks, pstats, strace) in this directory"
    )
    args = parser.parse_args()
    data = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="otel-capture-profile-"))
    data.mkdir(parents=True, exist_ok=True)
    print("== profile_goals: where the CPU per call goes, 64 concurrent under wrk ==")
    print(H.machine_line(data))
    print(H.package_line())
    print(f"py-spy: {PY_SPY or 'NOT INSTALLED (pip install py-spy)'}")
    table = configs(data)
    try:
        if not args.no_reassembly:
            reassembly()
        for name in args.configs.split(","):
            profile(name, table[name], args.seconds, data, not args.no_cprofile, not args.no_strace)
    finally:
        if not args.keep:
            shutil.rmtree(data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
