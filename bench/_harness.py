"""What every benchmark shares: the machine's description, tables of ratios, server processes, and the
load generator (``wrk`` when installed, else a clearly labelled Python fallback in its own process).

Nothing here is timed against a fixed number: each benchmark measures its baseline in the same run and
prints ratios, because this machine is shared and noisy (absolute times mean little; ratios measured side
by side do).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent  # every server and load generator runs from here: `python -m bench.<name>`

PYTHON = sys.executable
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --- the machine ------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def filesystem_of(path: str | os.PathLike[str]) -> str:
    """``ext4 on /dev/vda`` for the mount holding ``path`` (longest mount-point prefix)."""
    target = os.path.realpath(path)
    best = ("", "unknown", "unknown")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                best = (mount, fstype, device)
    except OSError:
        pass
    return f"{best[1]} on {best[2]}"


def uvicorn_impl() -> str:
    """What uvicorn's ``auto`` picks here: the HTTP parser and the event loop."""
    import importlib.util

    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"uvicorn http={http} loop={loop}"


def speed_gauge() -> float:
    """Microseconds for ``sum(range(1000))`` in this interpreter, best of 5 runs of 2,000: how fast one core
    runs Python right now. On an idle recent x86 core it is roughly 10 us; a shared machine under load reads
    several times that, and every CPU-per-call figure of the same run is inflated alike."""
    import timeit

    return min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6


def package_line() -> str:
    """Which ``otel_capture`` the servers import (its path), and the git state of that checkout: the
    commit, and whether the package's files differ from it (engineers edit the shared tree while this runs)."""
    import importlib.util

    spec = importlib.util.find_spec("otel_capture")
    where = Path(spec.origin).parent.parent if spec and spec.origin else REPO
    try:
        commit = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--", "otel_capture", "exporters"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    state = (
        (f"git {commit}" + (", package files modified since" if dirty else ", package files as committed"))
        if commit
        else "not a git checkout"
    )
    return f"package: otel_capture from {where} ({state})"


def machine_line(data_dir: str | os.PathLike[str] | None = None) -> str:
    where = data_dir if data_dir is not None else tempfile.gettempdir()
    parts = [
        f"{_cpu_model()}, {os.cpu_count()} cores",
        f"Linux {platform.release()}",
        f"Python {platform.python_version()}",
        uvicorn_impl(),
        f"data dir {where} ({filesystem_of(where)})",
    ]
    try:
        load = os.getloadavg()[0]
        parts.append(f"load avg {load:.2f} at start")
    except OSError:
        pass
    return "machine: " + "; ".join(parts)


# --- tables -----------------------------------------------------------------------------------------


def print_table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = ()
) -> None:
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print()
    print(title)
    print("  ".join(h.ljust(w) for h, w in zip(cells[0], widths, strict=False)))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=False)))
    for note in notes:
        print(note)
    sys.stdout.flush()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value >= 1000:
            return f"{value:,.0f}"
        if value >= 100:
            return f"{value:.0f}"
        if value >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] == "-" or cell.endswith("x"))


def ratio(value: float | None, base: float | None) -> str | None:
    if value is None or not base:
        return None
    return f"{value / base:.2f}x"


# --- processes --------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process, all its threads included (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15)


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a live process, all its threads."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


@dataclass(frozen=True)
class ThreadCPU:
    """One thread's CPU so far: on CPU (``schedstat``, nanoseconds, as seconds), user and system (ticks)."""

    name: str
    on_cpu: float
    user: float
    system: float


def thread_cpu(pid: int | str = "self") -> dict[int, ThreadCPU]:
    """Every live thread of ``pid`` by thread id, with its kernel name (``comm``) and CPU so far; a thread
    that ends while it is read is left out."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        task = f"/proc/{pid}/task/{tid}"
        try:
            with (
                open(f"{task}/comm") as comm,
                open(f"{task}/schedstat") as sched,
                open(f"{task}/stat") as stat,
            ):
                name, on_cpu_ns = comm.read().strip(), int(sched.read().split()[0])
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue
        found[int(tid)] = ThreadCPU(
            name, on_cpu_ns / 1e9, int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS
        )
    return found


def tree_cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` and every live descendant."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    user = system = 0.0
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            u, s = cpu_split(current)
        except (OSError, ValueError, IndexError):
            continue
        user, system = user + u, system + s
        todo.extend(children.get(current, ()))
    return user, system


def system_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all cores; not idle, not iowait), from ``/proc/stat``."""
    with open("/proc/stat") as handle:
        fields = [int(x) for x in handle.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def own_cpu_seconds() -> float:
    """This process's CPU (the benchmark driver itself)."""
    t = os.times()
    return t.user + t.system


class ServerProcess:
    """A server in its own process (its own GIL), that prints ``listening on <url>`` as its first line."""

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None, name: str = "") -> None:
        self.name = name or argv[-1]
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**_clean_environ(), **(env or {})},
            cwd=REPO,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().decode().strip()
        if not first.startswith("listening on "):
            self.stop()
            self._log.seek(0)
            raise RuntimeError(f"{self.name} did not start: {first!r}\n{self._log.read().decode()[-3000:]}")
        self.url = first.removeprefix("listening on ").strip()
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        # "listening on" is printed once the socket is bound, before uvicorn calls listen().
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.stats()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self) -> dict[str, int]:
        """The server's capture counters (``GET /_bench/stats``)."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/_bench/stats", timeout=30) as response:
            return json.loads(response.read())

    def log_tail(self, chars: int = 3000) -> str:
        """The end of what the server wrote on stderr so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_RECEIVER = """
import http.server, json, threading
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
counts = {"requests": 0, "spans": 0, "bytes": 0, "scopes": {}}
lock = threading.Lock()
class Receiver(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        request = ExportTraceServiceRequest.FromString(body)
        scopes = [(s.scope.name, len(s.spans)) for r in request.resource_spans for s in r.scope_spans]
        with lock:
            counts["requests"] += 1
            counts["bytes"] += len(body)
            for name, spans in scopes:
                counts["spans"] += spans
                counts["scopes"][name] = counts["scopes"].get(name, 0) + spans
        self._answer(b"", "application/x-protobuf")
    def do_GET(self):
        with lock:
            self._answer(json.dumps(counts).encode(), "application/json")
    def _answer(self, body, content_type):
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class OtlpReceiver:
    """An OTLP/HTTP traces receiver in its own process, where a Collector or Jaeger would be (its CPU is not
    a server's): every export is answered at once with success, and its spans are counted by
    instrumentation scope (:meth:`received`), so a run can say whether the spans of its calls arrived."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([PYTHON, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{port}"
        self.endpoint = self.url + "/v1/traces"

    def env(self) -> dict[str, str]:
        """The ``OTEL_*`` variables that send a process's spans here, as the README's Jaeger set-up does."""
        return {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": self.url}

    def received(self) -> dict[str, Any]:
        """Export requests, spans and bytes received so far, and the spans by instrumentation scope
        (``scopes``)."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/count", timeout=30) as response:
            counts: dict[str, Any] = json.loads(response.read())
            return counts

    def model_call_spans(self) -> int:
        """The model-call spans received: those of the capture middleware's tracer."""
        from otel_capture._capture import middleware

        scopes: dict[str, int] = self.received()["scopes"]
        return scopes.get(middleware.__name__, 0)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _clean_environ() -> dict[str, str]:
    """The environment without OTEL_* variables: each variant says itself what it captures."""
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def server_argv(variant: str, *extra: str) -> list[str]:
    return [PYTHON, "-m", "bench._servers", variant, *extra]


# --- load generation --------------------------------------------------------------------------------


@dataclass
class LoadResult:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    loadgen_cpu: float  # the load generator's CPU seconds, to show it is not the bottleneck

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


def loadgen_name(force_python: bool = False) -> str:
    if wrk_available() and not force_python:
        return "wrk (Debian's package, 1 thread, Lua script picks the rollout path per request)"
    return "FALLBACK Python asyncio load generator (own process; wrk not installed: apt-get install wrk)"


_WRK_LUA = r"""
local n = 0
local rollouts = %(rollouts)d
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%(body)s]==]
request = function()
  n = n + 1
  if rollouts == 0 then
    return wrk.format(nil, "%(suffix)s")
  end
  return wrk.format(nil, "%(prefix)s" .. (n %% rollouts) .. "%(suffix)s")
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {\"requests\":%%d,\"duration_us\":%%d,\"errors\":%%d,\"p50_us\":%%d,\"p99_us\":%%d}\n",
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def _run_reaped(argv: Sequence[str], timeout: float) -> tuple[str, float]:
    """Run a child, return its stdout and its CPU seconds (from ``wait4``'s rusage)."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        out, err = _communicate_no_reap(proc, timeout)
    except BaseException:
        proc.kill()
        raise
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return out.decode(), usage.ru_utime + usage.ru_stime


def _communicate_no_reap(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes]:
    # Read both pipes to EOF without letting Popen reap the child (wait4 must get its rusage).
    import threading

    assert proc.stdout is not None and proc.stderr is not None
    err_chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + timeout
    out = proc.stdout.read()
    reader.join(max(0.0, deadline - time.monotonic()))
    return out, b"".join(err_chunks)


def run_load(
    url: str,
    *,
    body: bytes,
    concurrency: int,
    seconds: int,
    rollouts: int = 32,
    prefix: str = "/ng-rollout/bench-",
    suffix: str = "/v1/chat/completions",
    force_python: bool = False,
) -> LoadResult:
    """Closed-loop load: ``concurrency`` keep-alive connections POSTing ``body`` for ``seconds``, each
    request to ``<prefix><n % rollouts><suffix>`` (``rollouts=0``: every request to ``suffix`` alone)."""
    if wrk_available() and not force_python:
        return _run_wrk(url, body, concurrency, seconds, rollouts, prefix, suffix)
    argv = [
        PYTHON,
        "-m",
        "bench._loadgen",
        url,
        "--concurrency",
        str(concurrency),
        "--seconds",
        str(seconds),
        "--rollouts",
        str(rollouts),
        "--prefix",
        prefix,
        "--suffix",
        suffix,
    ]
    with tempfile.NamedTemporaryFile(suffix=".json") as body_file:
        body_file.write(body)
        body_file.flush()
        out, cpu = _run_reaped([*argv, "--body-file", body_file.name], timeout=seconds + 60)
    data = json.loads(out.strip().splitlines()[-1])
    return LoadResult(data["requests"], data["seconds"], data["p50_ms"], data["p99_ms"], data["errors"], cpu)


def _run_wrk(
    url: str, body: bytes, concurrency: int, seconds: int, rollouts: int, prefix: str, suffix: str
) -> LoadResult:
    text = body.decode()
    if "]==]" in text:
        raise ValueError("request body cannot be embedded in the Lua script")
    script = _WRK_LUA % {"rollouts": rollouts, "body": text, "prefix": prefix, "suffix": suffix}
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as lua:
        lua.write(script)
        lua.flush()
        argv = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "30s", "-s", lua.name, url]
        out, cpu = _run_reaped(argv, timeout=seconds + 60)
    line = next(line for line in out.splitlines() if line.startswith("WRKJSON "))
    data = json.loads(line.removeprefix("WRKJSON "))
    return LoadResult(
        data["requests"],
        data["duration_us"] / 1e6,
        data["p50_us"] / 1000,
        data["p99_us"] / 1000,
        data["errors"],
        cpu,
    )


def count_lines(directory: Path, pattern: str = "*.capture.jsonl") -> int:
    total = 0
    for path in directory.glob(pattern):
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                total += chunk.count(b"\n")
    return total


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --- memory -----------------------------------------------------------------------------------------


def status_kib(field: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` figure in KiB: ``VmRSS`` (resident now), ``VmHWM`` (the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss(pid: int | str = "self") -> None:
    """Make ``VmHWM`` start again from the current RSS (``clear_refs`` 5), so the next peak is the
    operation's; without the permission the peak is since the process started."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")
