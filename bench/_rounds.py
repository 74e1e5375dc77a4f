"""Side-by-side measurement for the goals: servers started from specs, measured under the same load in
rotated rounds (each keeps its best), one call at a time for the time to first event, and the table of
runs with their baselines. ``bench_goals.py`` is the goals themselves (goal 4 in ``_goal_streaming.py``, the floors'
table in ``_goal_floors.py``)."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import _harness as H
from bench._servers import REQUEST_BODY

CONCURRENCY = 64
ROLLOUTS = 32
INSTRUMENT = str(Path(H.PYTHON).with_name("opentelemetry-instrument"))


def zero_code_env(directory: Path | None) -> dict[str, str]:
    """A zero-code server's ``OTEL_*`` set-up: records into ``directory``, or no exporter when it is None."""
    env = {"OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}
    if directory is None:
        env["OTEL_TRACES_EXPORTER"] = "none"
    else:
        env["OTEL_TRACES_EXPORTER"] = "model_call_jsonl"
        env["OTEL_EXPORTER_MODEL_CALL_JSONL_DIR"] = str(directory)
    return env


def server_span_only_env() -> dict[str, str]:
    """``opentelemetry-instrument`` with the capture's instrumentor off and no exporter: the diagnostic rows
    that measure an HTTP server span alone (the app wraps itself in it)."""
    return {**zero_code_env(None), "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "otel_capture"}


def zero_code_otlp_env(directory: Path, receiver: H.OtlpReceiver) -> dict[str, str]:
    """The README's set-up for Jaeger: records into ``directory`` and spans over OTLP/HTTP to ``receiver``."""
    env = zero_code_env(directory)
    env["OTEL_TRACES_EXPORTER"] = "otlp,model_call_jsonl"
    return {**env, **receiver.env()}


# --- servers ----------------------------------------------------------------------------------------


@dataclass
class Spec:
    """How to start one server and how to call it."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    prefixed: bool = True  # requests go to /ng-rollout/<id>/...; False: the plain path (nothing strips it)
    capture_dir: Path | None = None
    stats: bool = True  # the server answers GET /_bench/stats with its own writer's counters
    upstream: str | None = None  # name of the Spec whose URL goes after --upstream


class Servers:
    """Starts specs in order (an upstream before the servers that name it); stops them all."""

    def __init__(self) -> None:
        self.running: dict[str, H.ServerProcess] = {}
        self.specs: dict[str, Spec] = {}

    def start(self, spec: Spec) -> H.ServerProcess:
        argv = list(spec.argv)
        if spec.upstream is not None:
            url = self.running[spec.upstream].url
            argv = [url if a == "{upstream}" else a for a in argv]
        if spec.capture_dir is not None:
            spec.capture_dir.mkdir(parents=True, exist_ok=True)
        server = H.ServerProcess(argv, env=spec.env, name=spec.name)
        self.running[spec.name] = server
        self.specs[spec.name] = spec
        return server

    def stop_all(self) -> None:
        for server in reversed(list(self.running.values())):
            server.stop()
        self.running.clear()

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


# --- one measurement --------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    rps: float
    requests: int
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_us: float | None  # server CPU per call (process tree)
    server_cores: float
    upstream_cpu_us: float | None
    others_cores: float  # the rest of the machine during the window
    loadgen_cores: float
    records: int = 0
    fsyncs: int = 0
    batches: int = 0
    user_us: float | None = None  # the user-space part of cpu_us (the rest is system time: syscalls)
    loop_us: float | None = None  # the server's main thread (its event loop) alone; the rest of cpu_us is
    # its other threads (the capture's writer, the batch span processor) and child processes


def measure(
    servers: Servers,
    name: str,
    seconds: int,
    force_python: bool,
    *,
    body: bytes = REQUEST_BODY,
    upstream: str | None = None,
) -> Run:
    server = servers.running[name]
    spec = servers.specs[name]
    up = servers.running[upstream] if upstream else None
    before = server.stats() if spec.stats else None
    busy0, own0 = H.system_busy_seconds(), H.own_cpu_seconds()
    user0, sys0 = H.tree_cpu_split(server.pid)
    loop0 = _main_thread_cpu(server.pid)
    up0 = H.cpu_seconds(up.pid) if up else 0.0
    t0 = time.monotonic()
    load = H.run_load(
        server.url,
        body=body,
        concurrency=CONCURRENCY,
        seconds=seconds,
        rollouts=ROLLOUTS if spec.prefixed else 0,
        force_python=force_python,
    )
    wall = time.monotonic() - t0
    user1, sys1 = H.tree_cpu_split(server.pid)
    loop1 = _main_thread_cpu(server.pid)
    cpu, user = (user1 + sys1) - (user0 + sys0), user1 - user0
    up_cpu = (H.cpu_seconds(up.pid) - up0) if up else 0.0
    busy, own = H.system_busy_seconds() - busy0, H.own_cpu_seconds() - own0
    after = server.stats() if spec.stats else None
    delta = {k: after[k] - before[k] for k in after} if before and after else {}
    n = load.requests
    return Run(
        name,
        load.rps,
        n,
        load.p50_ms,
        load.p99_ms,
        load.errors,
        cpu_us=cpu / n * 1e6 if n else None,
        server_cores=cpu / wall,
        upstream_cpu_us=up_cpu / n * 1e6 if (up and n) else None,
        others_cores=max(0.0, (busy - cpu - up_cpu - load.loadgen_cpu - own) / wall),
        loadgen_cores=load.loadgen_cpu / wall,
        records=delta.get("records", 0),
        fsyncs=delta.get("fsyncs", 0),
        batches=delta.get("batches", 0),
        user_us=user / n * 1e6 if n else None,
        loop_us=(loop1 - loop0) / n * 1e6 if (n and loop0 is not None and loop1 is not None) else None,
    )


def _main_thread_cpu(pid: int) -> float | None:
    """User + system CPU seconds of ``pid``'s main thread (the server's event loop), or ``None`` once gone."""
    main = H.thread_cpu(pid).get(pid)
    return None if main is None else main.user + main.system


def rounds_of(
    servers: Servers,
    names: Sequence[str],
    rounds: int,
    seconds: int,
    force_python: bool,
    *,
    body: bytes = REQUEST_BODY,
    upstreams: dict[str, str] | None = None,
) -> dict[str, Run]:
    """Warm each server up (1 s), then ``rounds`` rotated rounds; the best round of each by req/s."""
    upstreams = upstreams or {}
    for name in names:
        spec = servers.specs[name]
        H.run_load(
            servers.running[name].url,
            body=body,
            concurrency=CONCURRENCY,
            seconds=1,
            rollouts=ROLLOUTS if spec.prefixed else 0,
            force_python=force_python,
        )
    for name in (
        names
    ):  # a capturing server that does not capture (say, the instrumentor failed to load) stops the run
        spec = servers.specs[name]
        if spec.capture_dir is not None and spec.stats and not servers.running[name].stats()["records"]:
            raise RuntimeError(
                f"{name} wrote no record during its warm-up; its log:\n{servers.running[name].log_tail()}"
            )
    best: dict[str, Run] = {}
    for r in range(rounds):
        order = list(names[r % len(names) :]) + list(names[: r % len(names)])
        for name in order:
            run = measure(servers, name, seconds, force_python, body=body, upstream=upstreams.get(name))
            if name not in best or run.rps > best[name].rps:
                best[name] = run
    return best


# --- time to first event, one call at a time ----------------------------------------------------------


def _ttft_call(sock: socket.socket, request: bytes, expected_end: bytes) -> float:
    """Send one streamed request on a kept-alive socket; seconds to the first SSE event's bytes."""
    t0 = time.perf_counter()
    sock.sendall(request)
    buffer = b""
    first = None
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("server closed the connection")
        buffer += data
        if first is None:
            head_end = buffer.find(b"\r\n\r\n")
            if head_end >= 0 and buffer.find(b"data: ", head_end) >= 0:
                first = time.perf_counter()
        if buffer.endswith(expected_end):
            assert first is not None
            return first - t0


def ttft_rounds(
    urls: dict[str, tuple[str, bool]], body: bytes, calls: int, warmup: int
) -> dict[str, list[float]]:
    """For each server (url, prefixed): ``calls`` streamed calls, one at a time, servers rotated call by
    call, each on its own kept-alive TCP_NODELAY connection. Returns the times to first event."""
    socks: dict[str, socket.socket] = {}
    requests: dict[str, list[bytes]] = {}
    for name, (url, prefixed) in urls.items():
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks[name] = sock
        paths = [
            f"/ng-rollout/ttft-{i % ROLLOUTS}/v1/chat/completions" if prefixed else "/v1/chat/completions"
            for i in range(ROLLOUTS)
        ]
        requests[name] = [
            (
                f"POST {p} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
            for p in paths
        ]
    out: dict[str, list[float]] = {name: [] for name in urls}
    order = list(urls)
    try:
        for i in range(warmup + calls):
            order = order[1:] + order[:1]
            for name in order:
                t = _ttft_call(socks[name], requests[name][i % ROLLOUTS], b"0\r\n\r\n")
                if i >= warmup:
                    out[name].append(t)
    finally:
        for sock in socks.values():
            sock.close()
    return out


# --- the report -------------------------------------------------------------------------------------


@dataclass
class Goal:
    number: str
    what: str
    figure: float | None
    target: float
    higher_better: bool
    unit: str  # "x", "us", "ms", "" (a plain number)
    this: Run | None = None
    base: Run | None = None
    base_label: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def met(self) -> bool | None:
        if self.figure is None:
            return None
        return self.figure >= self.target if self.higher_better else self.figure <= self.target

    def verdict(self) -> str:
        if self.met is None:
            return "not measured"
        if self.met:
            return "MET"
        assert self.figure is not None
        if self.higher_better:
            return f"MISSED: {self.figure / self.target:.0%} of the goal"
        return f"MISSED: {self.figure / self.target:.1f}x the limit"


def _fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "us":
        return f"{value:.2f} us" if value < 10 else f"{value:.0f} us"
    if unit == "ms":
        return f"{value:+.3f} ms"
    return f"{value:.3f}"


def goals_table(goals: Sequence[Goal]) -> None:
    header = [
        "goal",
        "figure",
        "measured",
        "target",
        "this req/s",
        "this CPU us/call",
        "baseline",
        "base req/s",
        "base CPU us/call",
        "verdict",
    ]
    rows = []
    for g in goals:
        rows.append(
            [
                g.number,
                g.what,
                _fmt_value(g.figure, g.unit),
                ("at least " if g.higher_better else "at most ") + _fmt_value(g.target, g.unit).lstrip("+"),
                g.this.rps if g.this else None,
                g.this.cpu_us if g.this else None,
                g.base_label or (g.base.name if g.base else "-"),
                g.base.rps if g.base else None,
                g.base.cpu_us if g.base else None,
                g.verdict(),
            ]
        )
    notes = [note for g in goals for note in g.notes]
    H.print_table(f"GOALS (issue #12), {CONCURRENCY} concurrent", header, rows, notes)


def run_table(title: str, runs: Sequence[tuple[str, Run, Run | None]], notes: Sequence[str] = ()) -> None:
    header = [
        "server",
        "req/s",
        "vs",
        "ratio",
        "CPU us/call",
        "loop us/call",
        "srv cores",
        "upstream us/call",
        "p50 ms",
        "p99 ms",
        "fsyncs/rec",
        "recs/batch",
        "other cores",
        "errors",
    ]
    rows = []
    for label, run, base in runs:
        rows.append(
            [
                label,
                run.rps,
                base.name if base else "-",
                H.ratio(run.rps, base.rps) if base else None,
                run.cpu_us,
                run.loop_us,
                run.server_cores,
                run.upstream_cpu_us,
                run.p50_ms,
                run.p99_ms,
                run.fsyncs / run.records if run.records else None,
                run.records / run.batches if run.batches else None,
                run.others_cores,
                run.errors,
            ]
        )
    H.print_table(title, header, rows, notes)


def ladder(steps: Sequence[tuple[str, Run]]) -> str:
    """CPU per call added by each layer, from servers measured side by side (differences of CPU per call)."""
    parts = [f"{steps[0][0]} {steps[0][1].cpu_us or 0:.0f} us"]
    for (_, before), (label, after) in itertools.pairwise(steps):
        parts.append(f"{label} {(after.cpu_us or 0) - (before.cpu_us or 0):+.0f} us")
    return "CPU per call, layer by layer: " + ", ".join(parts)


def spans_check(servers: Servers, name: str, receiver: H.OtlpReceiver) -> str:
    """The spans ``receiver`` got against the records ``name`` wrote (after its writer settled,
    :func:`disk_check`): a model-call span per record, and the server span around it. The batch
    processor's last export comes within its delay (5 s), so it is waited for, 12 s at most."""
    spec = servers.specs[name]
    assert spec.capture_dir is not None
    lines = H.count_lines(spec.capture_dir)
    deadline = time.monotonic() + 12.0
    while (model_calls := receiver.model_call_spans()) < lines and time.monotonic() < deadline:
        time.sleep(0.25)
    received = receiver.received()
    per = received["spans"] / lines if lines else 0.0
    return (
        f"{name}: {received['spans']:,} spans received over OTLP in {received['requests']:,} exports "
        f"({received['bytes'] / 1e6:.1f} MB), {per:.2f} per record on disk ({lines:,}); {model_calls:,} "
        "model-call spans" + ("" if model_calls >= lines else "  << SPANS MISSING")
    )


def disk_check(servers: Servers, names: Sequence[str]) -> list[str]:
    """Lines on disk against records the writer acknowledged (after calls in flight settle)."""
    notes = []
    for name in names:
        spec = servers.specs[name]
        assert spec.capture_dir is not None
        acknowledged, previous = servers.running[name].stats()["records"], -1
        while acknowledged != previous:
            time.sleep(0.3)
            previous, acknowledged = acknowledged, servers.running[name].stats()["records"]
        lines = H.count_lines(spec.capture_dir)
        notes.append(
            f"{name}: {lines:,} lines on disk, {acknowledged:,} acknowledged by its writer"
            + ("" if lines == acknowledged else "  << MISMATCH")
        )
    return notes
