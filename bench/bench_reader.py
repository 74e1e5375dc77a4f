"""The readers on one big capture file, against a plain per-line pydantic validation (the existing reader).

    python -m bench.bench_reader [--quick] [--lines N] [--repeat N] [--dir DIR]

The file: ``--lines`` lines (default 100,000; quick 20,000) cycled from NeMo Gym 0.7.0's own capture file
(``tests/fixtures/nemo_gym/gym_server_0-0.capture.jsonl``: Responses calls with reasoning, tool calls
and cache counts), each with a fresh ``model_call_id``; when that fixture is absent, lines of the
non-streaming benchmark's chat call in the same format. Written to a temporary directory, deleted after.

Measured, best of ``--repeat`` (default 2), each run side by side with the baseline:

* ``read_model_call_records`` (strict), ``read_available_model_call_records`` (tolerant),
  ``aggregate_model_call_metrics`` (strict read + sums);
* the baseline, NeMo Gym 0.7.0's reader as it works: under ``flock(LOCK_SH)``, per line ``orjson.loads``
  then ``ModelCallRecord.model_validate`` of the dict Gym's ``build_model_call_record`` builds (the same
  derivation as ours: token counts, tool calls, reasoning), i.e. full pydantic validation of every line;
  and its aggregate, the same sums over those records.
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import itertools
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench import _harness as H
from otel_capture import (
    CaptureStore,
    ModelCallRecord,
    aggregate_model_call_metrics,
    read_available_model_call_records,
    read_model_call_records,
)
from otel_capture._records import aggregate_model_call_records
from otel_capture._records.build import _line_values

FIXTURE = H.REPO / "tests" / "fixtures" / "nemo_gym" / "gym_server_0-0.capture.jsonl"
ROLLOUT = "bench-reader"


def source_lines() -> tuple[list[dict[str, Any]], str]:
    if FIXTURE.exists():
        lines = [orjson.loads(line) for line in FIXTURE.read_bytes().splitlines() if line.strip()]
        return lines, f"NeMo Gym 0.7.0's {FIXTURE.name} ({len(lines)} distinct lines, cycled)"
    from bench._servers import REQUEST_BODY, RESPONSE_BODY

    line = {
        "model_call_id": "",
        "dialect": "chat",
        "model_ref": {"type": "responses_api_models", "name": "bench"},
        "started_at": 1796040241.38,
        "completed_at": 1796040241.43,
        "latency_ms": 45.2,
        "latency_ttft_ms": 45.1,
        "status_code": 200,
        "error_category": None,
        "request": orjson.loads(REQUEST_BODY),
        "response": orjson.loads(RESPONSE_BODY),
    }
    return [line], "the non-streaming benchmark's chat call (fixture not found)"


def write_file(directory: Path, count: int) -> tuple[Path, int, str]:
    sources, described = source_lines()
    path = directory / f"{ROLLOUT}.capture.jsonl"
    with path.open("wb") as handle:
        for _, line in zip(range(count), itertools.cycle(sources)):
            handle.write(
                orjson.dumps(dict(line, model_call_id=uuid.uuid4().hex), option=orjson.OPT_APPEND_NEWLINE)
            )
    return path, path.stat().st_size, described


def gym_style_read(store: CaptureStore, rollout_id: str) -> list[ModelCallRecord]:
    """BASELINE: NeMo Gym 0.7.0's strict reader (full pydantic validation of every line)."""
    records = []
    with store.data_path(rollout_id).open("rb") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_SH)
        try:
            index = 0
            for raw in handle:
                raw = raw.strip()
                if not raw:
                    continue
                records.append(ModelCallRecord.model_validate(_line_values(orjson.loads(raw), index)))
                index += 1
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return records


def gym_style_aggregate(store: CaptureStore, rollout_id: str) -> dict[str, Any]:
    return aggregate_model_call_records(gym_style_read(store, rollout_id))


def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lines", type=int)
    parser.add_argument("--repeat", type=int)
    parser.add_argument("--dir", help="where the file goes (default: a new temporary directory)")
    args = parser.parse_args(argv)
    count = args.lines or (20_000 if args.quick else 100_000)
    repeat = args.repeat or 2
    directory = Path(tempfile.mkdtemp(prefix="otel-capture-bench-reader-", dir=args.dir))
    print("== bench_reader: reading one rollout's capture file ==")
    print(H.machine_line(directory))
    try:
        _, size, described = write_file(directory, count)
        print(f"file: {count:,} lines, {size / 1e6:.1f} MB, from {described}; best of {repeat} runs")
        store = CaptureStore(directory)
        candidates: list[tuple[str, Callable[[], Any]]] = [
            (
                "baseline: per-line orjson + ModelCallRecord.model_validate (Gym 0.7.0's reader)",
                lambda: gym_style_read(store, ROLLOUT),
            ),
            ("read_model_call_records (strict)", lambda: read_model_call_records(store, ROLLOUT)),
            (
                "read_available_model_call_records (tolerant)",
                lambda: read_available_model_call_records(store, ROLLOUT),
            ),
            ("baseline aggregate: Gym's reader + sums", lambda: gym_style_aggregate(store, ROLLOUT)),
            ("aggregate_model_call_metrics", lambda: aggregate_model_call_metrics(store, ROLLOUT)),
        ]
        best: dict[str, float] = {}
        results: dict[str, Any] = {}
        for _ in range(repeat):
            for name, fn in candidates:  # interleaved, so load bursts hit every candidate alike
                seconds, result = _time(fn)
                best[name] = min(best.get(name, seconds), seconds)
                results[name] = result
                del result
        same = _same_records(results[candidates[0][0]], results[candidates[1][0]])
        same_tolerant = _same_records(results[candidates[0][0]], results[candidates[2][0]].records)
        same_aggregate = results[candidates[3][0]] == results[candidates[4][0]]
        base_read, base_agg = best[candidates[0][0]], best[candidates[3][0]]
        rows = []
        for name, _ in candidates:
            base = base_agg if "aggregate" in name else base_read
            rows.append(
                [
                    name,
                    count / best[name],
                    best[name] * 1000,
                    f"{base / best[name]:.2f}x",
                    size / best[name] / 1e6,
                ]
            )
        H.print_table(
            f"reader: {count:,}-line file",
            ["reader", "records/s", "ms", "speed vs baseline", "MB/s"],
            rows,
            [
                (
                    f"same records as the baseline (counts, and the first 2,000 field by field): strict {same}, "
                    f"tolerant {same_tolerant}; same aggregate: {same_aggregate}"
                ),
                (
                    "limit: one core of CPU (the file is in the page cache after the first read): orjson parsing, "
                    "deriving token counts/tool calls/reasoning per line, and building the pydantic objects"
                ),
            ],
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def _same_records(a: list[ModelCallRecord], b: list[ModelCallRecord]) -> bool:
    return len(a) == len(b) and all(
        x.model_dump() == y.model_dump() for x, y in zip(a[:2000], b[:2000], strict=False)
    )


if __name__ == "__main__":
    sys.exit(main())
