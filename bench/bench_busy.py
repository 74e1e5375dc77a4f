"""The latency the capture adds to one call on a busy server: captured against passed calls in the same
server while other streams keep its event loop busy, beside the barest durable capture's.

    python -m bench.bench_busy [--quick] [--seconds S] [--loads 0,4,16] [--events N]

A model server's event loop is often busy with other calls (an RL run's rollouts stream at once), and a
captured call pays there what a benchmark of throughput does not show: each thing it waits for (the
writer's sync, the loop running the waiter's callback, then the call's task) waits behind the other calls'
work, one loop iteration at a time. Two servers, one at a time: the Starlette app under
``opentelemetry-instrument`` with the records' exporter (zero-code, as goal 1a), and the durable floor
(``bench/_floors.py``: the barest capture that holds the last chunk until synced). Each streams ``--events``
Chat Completions chunks per call. For each load in ``--loads``, ``wrk`` keeps that many uncaptured streams
going (plain ``/v1/chat/completions``, read as fast as wrk reads) while a probe makes one call at a time,
captured (``/ng-rollout/probe/...``) and passed (the plain path) in turn, each read to its end; the run
prints the medians, the p90s and what capture adds (captured - passed), the capture's and the floor's side
by side. It exits 1 when a probe call failed or a captured probe call has no record.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import _harness as H
from bench import _rounds as R
from bench._servers import REQUEST_BODY

PROBE_ROLLOUT = "probe"
BODY = orjson.dumps({**orjson.loads(REQUEST_BODY), "stream": True})


def _probe(url: str, seconds: float) -> dict[str, list[float]]:
    """Calls one at a time for ``seconds``, captured and passed in turn: each one's ms, read to its end."""
    found: dict[str, list[float]] = {"captured": [], "passed": []}
    paths = {"captured": f"/ng-rollout/{PROBE_ROLLOUT}/v1/chat/completions", "passed": "/v1/chat/completions"}
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=120) as client:
        for path in paths.values():  # the connection, the rollout's files and each path, once
            client.post(url + path, content=BODY, headers=headers).raise_for_status()
        until = time.monotonic() + seconds
        turn = 0
        while time.monotonic() < until or turn % 2:
            kind = ("captured", "passed")[turn % 2]
            began = time.perf_counter()
            response = client.post(url + paths[kind], content=BODY, headers=headers)
            response.raise_for_status()
            found[kind].append((time.perf_counter() - began) * 1000)
            turn += 1
    return found


def _load(url: str, streams: int, seconds: int, out: dict[str, H.LoadResult]) -> None:
    """``streams`` uncaptured streamed calls at once for ``seconds`` (wrk, or the Python load generator)."""
    out["load"] = H.run_load(url, body=BODY, concurrency=streams, seconds=seconds, rollouts=0)


def _rows(server: str, spec: R.Spec, loads: list[int], seconds: int) -> tuple[list[list[Any]], bool]:
    rows: list[list[Any]] = []
    ok = True
    with R.Servers() as servers:
        url = servers.start(spec).url
        for load in loads:
            loaded: dict[str, H.LoadResult] = {}
            wrk = threading.Thread(target=_load, args=(url, load, seconds + 2, loaded))
            if load:
                wrk.start()
                time.sleep(1)  # the load under way before the probe starts
            found = _probe(url, seconds)
            if load:
                wrk.join()
            captured, passed = found["captured"], found["passed"]
            c50, p50 = statistics.median(captured), statistics.median(passed)
            rows.append(
                [
                    server, load, len(captured), p50, c50, c50 - p50, c50 / p50,
                    H.percentile(passed, 0.9), H.percentile(captured, 0.9),
                    loaded["load"].rps if load else None,
                ]
            )  # fmt: skip
    assert spec.capture_dir is not None
    lines = H.count_lines(spec.capture_dir, f"{PROBE_ROLLOUT}.capture.jsonl")  # the load is not captured
    expected = sum(row[2] + 1 for row in rows)  # and each probe's warm-up call
    if lines != expected:
        print(f"<< {server}: {lines} record lines for {expected} captured probe calls")
        ok = False
    return rows, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s per load, loads 0 and 4")
    parser.add_argument("--seconds", type=int, default=10, help="probe time per load (default 10)")
    parser.add_argument("--loads", default="0,4,16", help="uncaptured streams at once (default 0,4,16)")
    parser.add_argument("--events", type=int, default=512, help="chunks per streamed call (default 512)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.loads = 3, "0,4"
    loads = [int(n) for n in args.loads.split(",")]
    print(H.machine_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-busy-") as tmp:
        data = Path(tmp)
        events = ("--events", str(args.events))
        specs = {
            "capture (zero-code)": R.Spec(
                "capture",
                [R.INSTRUMENT, *H.server_argv("bare", "--app", "starlette", *events)],
                env=R.zero_code_env(data / "capture"),
                capture_dir=data / "capture",
            ),
            "durable floor": R.Spec(
                "floor",
                H.server_argv("floor", "--app", "starlette", *events, "--capture-dir", str(data / "floor")),
                capture_dir=data / "floor",
            ),
        }
        rows: list[list[Any]] = []
        ok = True
        for server, spec in specs.items():
            found, fine = _rows(server, spec, loads, args.seconds)
            rows += found
            ok &= fine
    added = {(row[0], row[1]): row[5] for row in rows}
    H.print_table(
        f"one call at a time while other streams keep the loop busy ({args.events}-chunk streams; ms, medians)",
        ["server", "busy streams", "probe calls", "passed", "captured", "added", "x passed", "passed p90",
         "captured p90", "load req/s"],
        rows,
        [
            f"at {load} busy streams the capture adds "
            f"{H.ratio(added[('capture (zero-code)', load)], added[('durable floor', load)])} what the floor adds"
            for load in loads
            if added[("durable floor", load)]
        ],
    )  # fmt: skip
    print(f"every probe call answered and recorded: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
