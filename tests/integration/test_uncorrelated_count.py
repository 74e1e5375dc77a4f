"""Model calls served without a rollout id are counted in the capture directory itself, so ``otel-capture
check``, ``show`` and ``ls`` say so even where the serving process's log was silenced or never read:
through a real uvicorn, with the CLI as a user runs it (a separate process)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support import Telemetry, recorded_json, serve

from otel_capture import CaptureSettings, ModelCallCaptureMiddleware, read_model_call_records
from otel_capture._store import read_uncorrelated
from otel_capture._store.names import UNCORRELATED_PREFIX as PREFIX
from otel_capture._store.uncorrelated import WRITE_INTERVAL_S


async def _chat(request: Request) -> JSONResponse:
    await request.body()
    return JSONResponse(json.loads(recorded_json("chat")))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", *args], capture_output=True, text=True, check=False
    )


def _wait_for_count(directory: Path, calls: int) -> None:
    deadline = time.monotonic() + WRITE_INTERVAL_S + 30  # a bounded wait: written within a second
    while read_uncorrelated(directory).calls != calls:
        assert time.monotonic() < deadline, read_uncorrelated(directory)
        time.sleep(0.05)  # polling interval of a bounded wait


def test_uncorrelated_calls_are_counted_and_reported_by_check_show_and_ls(telemetry: Telemetry) -> None:
    root = telemetry.store.root
    app = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])])
    with serve(
        ModelCallCaptureMiddleware(app, tracer_provider=telemetry.provider, settings=CaptureSettings())
    ) as url:
        body = {"model": "m", "messages": []}
        assert httpx.post(f"{url}/ng-rollout/r-1/v1/chat/completions", json=body).status_code == 200
        clean = _cli("check", str(root), "--strict")
        assert clean.returncode == 0 and "without a rollout id" not in clean.stdout
        for _ in range(3):  # served, not recorded
            assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200
        # recorded by a capture layer in front (it marked the request): not uncorrelated here
        marked = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-otel-capture": "captured"})
        assert marked.status_code == 200
        _wait_for_count(root, 3)
        assert len(read_model_call_records(telemetry.store, "r-1")) == 1
    (counter,) = [p.name for p in root.iterdir() if p.name.startswith(PREFIX)]
    assert counter.endswith(".json")

    check = _cli("check", str(root))
    assert check.returncode == 0, check.stdout  # not damage: nothing on disk is wrong
    line = "3 model call(s) without a rollout id were served and not recorded (3 chat; 1 process(es)"
    assert line in check.stdout
    assert check.stdout.splitlines()[-2].startswith("1 rollout(s), 1 record(s)")  # the rollouts as before
    assert _cli("check", str(root), "--strict").returncode == 1  # a lost call fails the strict check
    ls = _cli("ls", str(root))
    rows = ls.stdout.splitlines()
    assert ls.returncode == 0 and rows[0].split()[:2] == ["rollout", "state"]
    assert [row.split()[:3] for row in rows[1:-1]] == [["r-1", "live", "1"]]
    assert rows[-1].startswith(line) and line not in ls.stderr  # after the table, on stdout, as check says it
    show = _cli("show", str(root))  # `show DIR` is `ls DIR`
    assert (show.returncode, show.stdout) == (0, ls.stdout)


def test_a_burst_after_the_first_write_is_counted_by_the_deferred_write(telemetry: Telemetry) -> None:
    root = telemetry.store.root
    app = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])])
    with (
        serve(
            ModelCallCaptureMiddleware(app, tracer_provider=telemetry.provider, settings=CaptureSettings())
        ) as url,
        httpx.Client() as client,
    ):
        client.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []})
        _wait_for_count(root, 1)  # the first call is written at once
        (path,) = [p for p in root.iterdir() if p.name.startswith(PREFIX)]
        first = path.stat().st_ino
        for _ in range(20):
            client.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []})
        # the next write waits for the interval (a timer on the loop), then has the whole burst
        _wait_for_count(root, 21)
    assert path.stat().st_ino != first  # replaced whole (a reader never sees half a file)
