"""``bench_vllm --probe`` wraps the capture's own methods inside vLLM's server (``bench/_vllm_probe.py``): a
wrapper whose signature has drifted from the capture's breaks every captured call there (vLLM answers 400),
so the probe is installed here, in a process of its own, around real captured calls, one of them longer
than the in-flight marker delay; the calls must be recorded and the counters must have counted them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys

    import httpx
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from bench import _vllm_probe as probe

    probe._patch_writer()
    probe._patch_capture()

    from otel_capture import CaptureSettings, CaptureStore, ModelCallCaptureMiddleware, read_model_call_records
    from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

    BODY = (
        b'{"id":"c1","object":"chat.completion","model":"m","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
    )

    async def app(scope, receive, send):
        while (await receive()).get("more_body", False):
            pass
        await asyncio.sleep(float(dict(scope["headers"]).get(b"x-think", b"0")))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": BODY})

    folder = sys.argv[1]
    exporter = ModelCallJsonlExporter(folder)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    middleware = ModelCallCaptureMiddleware(app, tracer_provider=provider, settings=CaptureSettings())

    async def calls():
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            statuses = []
            for rollout, think in (("r-quick", "0"), ("r-long", "0.1"), ("r-quick", "0")):
                answer = await client.post(
                    f"/ng-rollout/{rollout}/v1/chat/completions",
                    content=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
                    headers={"content-type": "application/json", "x-think": think},
                )
                statuses.append(answer.status_code)
            return statuses

    statuses = asyncio.run(calls())
    provider.shutdown()
    store = CaptureStore(folder)
    records = {r: len(read_model_call_records(store, r)) for r in ("r-quick", "r-long")}
    print(json.dumps({"statuses": statuses, "records": records, "counts": probe.snapshot()["counts"]}))
    """
)


def _run(script: str, *args: str) -> Any:
    """``script`` in a process of its own (the probe patches classes), from the repository; the JSON object
    its last line prints."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_vllm_probe_wraps_the_capture_without_changing_a_call(tmp_path: Path) -> None:
    found = _run(SCRIPT, str(tmp_path / "calls"))
    assert found["statuses"] == [200, 200, 200]
    assert found["records"] == {"r-quick": 2, "r-long": 1}
    counts = found["counts"]
    for counted in ("loopcode/_finish_ns", "loopcode/begin_ns", "loopcode/on_body_ns", "writer_batches"):
        assert counts.get(counted, 0) > 0, (counted, counts)
    assert counts.get("marker_timers", 0) >= 1  # the long call's marker was timed through the wrapper


FLOOR_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys

    import httpx
    import orjson
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from bench import _vllm_probe as probe

    probe.install_floor(sys.argv[2])

    from otel_capture import CaptureSettings, CaptureStore, ModelCallCaptureMiddleware, read_model_call_records
    from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

    BODY = (
        b'{"id":"c1","object":"chat.completion","model":"m","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'
    )

    EVENTS = [b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\\n\\n', b"data: [DONE]\\n\\n"]

    async def chat(request):
        await request.body()
        return Response(BODY, media_type="application/json")

    async def stream(request):
        await request.body()

        async def events():
            for event in EVENTS:
                yield event

        return StreamingResponse(events(), media_type="text/event-stream")

    folder = sys.argv[1]
    exporter = ModelCallJsonlExporter(folder)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/stream", stream, methods=["POST"])],
        middleware=[Middleware(ModelCallCaptureMiddleware, tracer_provider=provider, settings=CaptureSettings())],
    )

    async def calls():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            answers = []
            for path, headers in (
                (probe.FLOOR_PREFIX + "r-floor/v1/chat/completions", {"x-otel-capture": "captured"}),
                ("/ng-rollout/r-captured/v1/chat/completions", {}),
                ("/v1/chat/completions", {"x-otel-capture": "captured"}),
                (probe.FLOOR_PREFIX + "r-floor/v1/stream", {"x-otel-capture": "captured"}),
            ):
                answer = await client.post(
                    path, content=b'{"model":"m","messages":[]}',
                    headers={"content-type": "application/json", **headers},
                )
                answers.append([answer.status_code, answer.content.decode()])
            return answers

    answers = asyncio.run(calls())
    provider.shutdown()
    store = CaptureStore(folder)
    records = {r: len(read_model_call_records(store, r)) for r in ("r-floor", "r-captured")}
    sse = b"".join(EVENTS).decode()
    print(json.dumps({"answers": answers, "records": records, "body": BODY.decode(), "sse": sse}))
    """
)


def test_the_floor_inside_a_server_keeps_its_own_calls_durable_and_passes_the_others(tmp_path: Path) -> None:
    """``bench_vllm --floor`` wraps the server's app in the barest durable capture (``bench/_floors.py``)
    under its own prefix, outside the capture: a call sent there is answered as the app answers it, written
    as one line of the floor's own, and passed by the capture (no record); a captured call and a passed one
    go through the floor untouched (no floor line)."""
    floor = tmp_path / "floor"
    found = _run(FLOOR_SCRIPT, str(tmp_path / "calls"), str(floor))
    assert found["answers"] == [[200, found["body"]]] * 3 + [[200, found["sse"]]]
    assert found["records"] == {"r-floor": 0, "r-captured": 1}
    assert sorted(p.name for p in floor.iterdir()) == ["r-floor.capture.jsonl"]
    chat, stream = (json.loads(line) for line in (floor / "r-floor.capture.jsonl").read_bytes().splitlines())
    assert chat["rollout_id"] == "r-floor" and chat["status"] == 200
    assert chat["response"] == json.loads(found["body"])
    assert chat["request"] == {"model": "m", "messages": []}
    assert stream["response"] == found["sse"]  # an SSE answer is one string: one line per call


MARKER_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, pathlib, sys

    from otel_capture._capture import LoopWaiter
    from otel_capture._store import JsonlWriter

    from bench import _vllm_probe as probe

    root = pathlib.Path(sys.argv[1])
    before = JsonlWriter(root / "before")  # made before the experiment, as opentelemetry-instrument makes it
    made = probe._marker_delay(3600)
    after = JsonlWriter(root / "after")

    async def long_call(writer):
        loop = asyncio.get_running_loop()
        writer.begin("r-long", "a" * 32)
        await asyncio.sleep(0.2)  # ten times the marker delay the capture runs with
        markers = [p.name for p in (writer.root / ".otel-capture" / "inflight").glob("*")]
        future = loop.create_future()
        writer.submit("r-long", b'{"x":1}\\n', "a" * 32, None, LoopWaiter(loop, future))
        await future
        return markers

    found = {"made": made, "before": asyncio.run(long_call(before)), "after": asyncio.run(long_call(after))}
    before.close()
    after.close()
    found["lines"] = [len((root / d / "r-long.capture.jsonl").read_bytes().splitlines()) for d in ("before", "after")]
    print(json.dumps(found))
    """
)


def test_the_marker_delay_experiment_reaches_the_writer_made_before_it(tmp_path: Path) -> None:
    """``$BENCH_VLLM_PROBE_MARKER_DELAY`` must reach the exporter's writer, which ``opentelemetry-instrument``
    makes before the probe runs: a call longer than the capture's delay then writes no ``+`` marker, in a
    writer made before the experiment and in one made after, and its line is still written."""
    found = _run(MARKER_SCRIPT, str(tmp_path))
    assert found == {"made": 1, "before": [], "after": [], "lines": [1, 1]}
