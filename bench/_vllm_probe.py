"""A bench-only probe inside the vLLM API server: where the capture's added CPU goes (``bench_vllm --probe``).

    python -m _vllm_probe vllm.entrypoints.openai.api_server ARGS...

(from a folder holding this file and a copy of ``bench/_floors.py``, put first on the server's
``PYTHONPATH``) installs the counters below, then runs the module named like ``python -m`` would. Never
imported by otel_capture; nothing here changes what the server answers, the counters only count:

* every garbage collection (``gc.callbacks``): per generation and per thread (the event loop's, the capture
  writer's, any other), how many and their wall time (a collection holds the GIL: its own CPU);
* the capture writer's wake-ups (``JsonlWriter._next`` returning) by what woke it (a line, a tick, ...), the
  CPU the thread spent between two waits (``time.thread_time``), its batches, and the wake-ups it sends
  to the loop (``Completions.flush``: one ``call_soon_threadsafe`` per loop per batch);
* with ``$BENCH_VLLM_PROBE_MARKER_DELAY=S`` (an experiment that breaks contract D19 for calls shorter than
  ``S`` seconds: other processes do not see them in flight): every ``JsonlWriter`` made with that in-flight
  marker delay instead of 20 ms, so with ``S`` longer than the calls no ``+`` marker is written, and what the
  markers cost is the difference from a run without it; applied with ``--floor`` too, without ``--probe``;
* the begins that time a marker (``JsonlWriter._wake_when_due``: one timer per writer, armed by the first) and the timer's firings;
* with ``$BENCH_VLLM_PROBE_NULL_WRITE=1`` (an experiment that breaks durability: the run's record count
  fails): the writer acknowledges each batch without writing it, so its I/O and its GIL holds are gone
  while the loop's side of the capture is unchanged;
* the capture's synchronous code on the loop (correlate, the span's start and the call's finish, the
  body's parsing, the waiters' wake-up), its thread CPU (``loopcode/...``);
* per thread, from ``/proc``: CPU (``schedstat``), times run, voluntary and involuntary context switches,
  user and system ticks.

The counters are read over a Unix socket (``$BENCH_VLLM_PROBE``): connect, read one JSON object. Without
that variable none of the above is installed.

With ``$BENCH_VLLM_PROBE_FLOOR`` (a directory; ``bench_vllm --floor``) the server's Starlette/FastAPI app
is wrapped, outermost, in ``bench/_floors.py``'s barest durable capture under the prefix
:data:`FLOOR_PREFIX`: a call sent there (and marked ``x-otel-capture: captured``, so the capture below
passes it) has its bodies kept, one line built and made durable by one writer thread with group commit
before its last chunk goes out, and nothing else: the least any durable capture costs in this server,
beside the capture's own cost in the same run. Every other call passes it by one prefix test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import runpy
import socket
import sys
import threading
import time
from collections import defaultdict
from typing import Any

WRITER = "otel-capture-writer"

_lock = threading.Lock()
_gc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # "thread/gen" -> [collections, ns, collected]
_counts: dict[str, int] = defaultdict(int)
_gc_started = threading.local()
_main_ident = threading.main_thread().ident
_depth = threading.local()  # how deep in timed capture code this thread is


def _kind() -> str:
    ident = threading.get_ident()
    if ident == _main_ident:
        return "loop"
    return "writer" if threading.current_thread().name == WRITER else "other"


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started.at = time.perf_counter_ns()
        return
    took = time.perf_counter_ns() - getattr(_gc_started, "at", time.perf_counter_ns())
    entry = _gc[f"{_kind()}/{info.get('generation')}"]
    entry[0] += 1
    entry[1] += took
    entry[2] += info.get("collected", 0)


def _count(name: str, by: int = 1) -> None:
    with _lock:
        _counts[name] += by


def _patch_writer() -> None:
    """Wrap the writer's wait, its batch write, its loop wake-ups and the loop's marker timers."""
    from otel_capture._store import writer, writer_items

    jsonl = writer.JsonlWriter
    next_, write_batch, wake_when_due, marker_due = (
        jsonl._next, jsonl._write_batch, jsonl._wake_when_due, jsonl._marker_due
    )  # fmt: skip
    flush = writer_items.Completions.flush
    busy = threading.local()

    def _next(self: Any) -> object:
        now = time.thread_time_ns()
        if hasattr(busy, "since"):
            _count("writer_busy_ns", now - busy.since)
        obj = next_(self)
        busy.since = time.thread_time_ns()
        kind = "tick" if obj is writer._TICK else type(obj).__name__.lstrip("_").lower()
        _count(f"writer_wakeups/{kind}")
        return obj

    null_write = os.environ.get("BENCH_VLLM_PROBE_NULL_WRITE") == "1"

    def _write_batch(self: Any, batch: list[Any], begins: list[Any]) -> None:
        if null_write:  # an experiment: nothing written, every call acknowledged (no durability at all)
            _count("writer_batches")
            for item in batch:
                self._done.resolve(item)
            return
        _count("writer_batches")
        _count("writer_batch_items", len(batch))
        _count("writer_batch_markers", len(begins))
        before = time.thread_time_ns()
        try:
            write_batch(self, batch, begins)
        finally:
            _count("writer_batch_ns", time.thread_time_ns() - before)

    def _flush(self: Any) -> None:
        _count("loop_wakeups_sent", len(self._wakeups))
        flush(self)

    def _wake_when_due(self: Any, *args: Any) -> None:  # counts each call: it arms a timer, or reuses one
        _count("marker_timers")
        wake_when_due(self, *args)

    def _marker_due(self: Any, *args: Any) -> None:
        _count("marker_timers_fired")
        marker_due(self, *args)

    jsonl._next, jsonl._write_batch = _next, _write_batch  # type: ignore[method-assign]
    jsonl._wake_when_due, jsonl._marker_due = _wake_when_due, _marker_due  # type: ignore[method-assign]
    writer_items.Completions.flush = _flush  # type: ignore[method-assign]


def _timed(name: str, function: Any) -> Any:
    """``function`` with its thread CPU counted under ``loopcode/<name>`` and, outermost only, in
    ``loopcode/total`` (a wrapped function called by another is not counted twice in the total)."""
    depth = _depth

    def timed(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(depth, "n", 0) == 0
        depth.n = getattr(depth, "n", 0) + 1
        before = time.thread_time_ns()
        try:
            return function(*args, **kwargs)
        finally:
            took = time.thread_time_ns() - before
            depth.n -= 1
            _count(f"loopcode/{name}_ns", took)
            if outer:
                _count("loopcode/total_ns", took)

    return timed


def _patch_capture() -> None:
    """The capture's synchronous code on the event loop, timed (its coroutines' own frames are not)."""
    from otel_capture._capture import call, exchange, middleware
    from otel_capture._store import writer_items

    middleware.correlate = _timed("correlate", middleware.correlate)  # type: ignore[attr-defined]
    for cls, names in (
        (middleware.ModelCallCaptureMiddleware, ("_start_span", "_finish")),
        (exchange.CapturedExchange, ("begin",)),
        (call.InFlightCall, ("set_request", "on_response_start", "on_body")),
    ):
        for name in names:
            setattr(cls, name, _timed(name, getattr(cls, name)))
    writer_items._wake = _timed("wake", writer_items._wake)  # type: ignore[attr-defined]


FLOOR_PREFIX = "/floor-rollout/"


def _marker_delay(seconds: float) -> int:
    """Every ``JsonlWriter`` with ``marker_delay=seconds`` (the experiment above): those made from now on
    and those that exist already (``opentelemetry-instrument`` makes the exporter's before this module
    runs; each reads its delay at each begin). How many existed."""
    from otel_capture._store import writer

    init = writer.JsonlWriter.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["marker_delay"] = seconds
        init(self, *args, **kwargs)

    writer.JsonlWriter.__init__ = __init__  # type: ignore[method-assign]
    found = [o for o in gc.get_objects() if isinstance(o, writer.JsonlWriter)]
    for existing in found:
        existing._marker_delay = seconds
    return len(found)


def install_floor(directory: str) -> None:
    """Wrap every Starlette (and so FastAPI) app, outermost, in the floor capture writing to ``directory``
    (one :class:`FloorWriter` for the process): ``Starlette.__call__`` is where a FastAPI app's call goes
    too, before its middleware stack, the capture's included."""
    try:
        from bench._floors import FloorCapture, FloorWriter
    except ImportError:  # inside vLLM: the copy beside this file
        from _floors import FloorCapture, FloorWriter  # type: ignore[import-not-found,no-redef]
    from starlette.applications import Starlette

    writer = FloorWriter(directory)
    original = Starlette.__call__
    floors: dict[int, Any] = {}

    async def __call__(self: Any, scope: Any, receive: Any, send: Any) -> None:
        floor = floors.get(id(self))
        if floor is None:

            async def app(scope: Any, receive: Any, send: Any) -> None:
                await original(self, scope, receive, send)

            floor = floors[id(self)] = FloorCapture(app, writer, prefix=FLOOR_PREFIX)
        await floor(scope, receive, send)

    Starlette.__call__ = __call__  # type: ignore[method-assign]


def _threads() -> dict[str, dict[str, int]]:
    """Per thread kind (loop, writer): CPU ns, times run, context switches, user and system ticks."""
    found: dict[str, dict[str, int]] = {}
    native = {t.native_id: t.name for t in threading.enumerate()}
    for tid_text in os.listdir("/proc/self/task"):
        tid = int(tid_text)
        kind = "loop" if tid == os.getpid() else ("writer" if native.get(tid) == WRITER else None)
        if kind is None:
            continue
        task = f"/proc/self/task/{tid}"
        try:
            with open(f"{task}/schedstat") as f:
                on_cpu, _, runs = (int(x) for x in f.read().split())
            with open(f"{task}/status") as f:
                status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        found[kind] = {
            "cpu_ns": on_cpu,
            "runs": runs,
            "voluntary": int(status["voluntary_ctxt_switches"]),
            "involuntary": int(status["nonvoluntary_ctxt_switches"]),
            "utime_ticks": int(fields[11]),
            "stime_ticks": int(fields[12]),
        }
    return found


def snapshot() -> dict[str, Any]:
    with _lock:
        counts = dict(_counts)
    return {
        "gc": {key: list(value) for key, value in _gc.items()},
        "counts": counts,
        "threads": _threads(),
        "gc_count": gc.get_count(),
        "gc_frozen": gc.get_freeze_count(),
        "gc_threshold": gc.get_threshold(),
    }


def _serve(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(4)
        while True:
            connection, _ = server.accept()
            with connection:
                connection.sendall(json.dumps(snapshot()).encode())


def read(path: str, timeout: float = 10.0) -> dict[str, Any]:
    """The probe's counters now (from the bench, outside the server)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(timeout)
        client.connect(path)
        chunks = []
        while chunk := client.recv(65536):
            chunks.append(chunk)
    found: dict[str, Any] = json.loads(b"".join(chunks))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", help="the module to run as `python -m` would (the API server)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    found = parser.parse_args()
    if os.environ.get("BENCH_VLLM_PROBE_MARKER_DELAY"):
        made = _marker_delay(float(os.environ["BENCH_VLLM_PROBE_MARKER_DELAY"]))
        delay = os.environ["BENCH_VLLM_PROBE_MARKER_DELAY"]
        print(
            f"_vllm_probe: marker delay {delay} s ({made} writer(s) made before)",
            file=sys.stderr,
            flush=True,
        )
    if os.environ.get("BENCH_VLLM_PROBE_FLOOR"):
        install_floor(os.environ["BENCH_VLLM_PROBE_FLOOR"])
    if os.environ.get("BENCH_VLLM_PROBE"):
        gc.callbacks.append(_on_gc)
        _patch_writer()
        _patch_capture()
        threading.Thread(target=_serve, args=(os.environ["BENCH_VLLM_PROBE"],), daemon=True).start()
    sys.argv = [found.module, *found.args]
    runpy.run_module(found.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
