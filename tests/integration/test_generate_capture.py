"""Token-in/token-out calls captured end to end (issue 32, item 2): vLLM's ``/inference/v1/generate`` and
SGLang's native ``/generate``, streamed and not, through the real capture proxy (and in-process under the
capture middleware), in front of a scripted upstream that answers in the servers' shapes
(``tests/fixtures/generate/``, one SSE event per chunk, as a server flushes them). The client is httpx, as
the trainers' clients are; the record is compared with what the client received. The servers' other
routes (models, health, the RL routes) pass through unrecorded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from support import FIXTURES_ROOT, Telemetry, serve

from otel_capture import CaptureStore, ModelCallCaptureMiddleware, read_model_call_records, start_proxy
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

GENERATE = FIXTURES_ROOT / "generate"
PROMPT = [2, 651, 6037, 576, 6081, 603]
OUTPUT = [7127, 235265, 714, 6037]
LOG_PROBS = [-0.0625, -0.375, -1.125, -0.8125]
VLLM = ("/inference/v1/generate", {"model": "gemma-3-270m", "token_ids": PROMPT, "return_token_ids": True,
        "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 1}})  # fmt: skip
SGLANG = ("/generate", {"input_ids": PROMPT, "return_logprob": True,
          "sampling_params": {"max_new_tokens": 4, "temperature": 0}})  # fmt: skip
NOT_MODEL_CALLS = [
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("POST", "/update_weight_version"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/inference/v1/abort_requests"),
    ("POST", "/update_weights_from_disk"),
    ("GET", "/generate"),
]


class ScriptedEngine:
    """vLLM's and SGLang's token-in/token-out routes replaying the fixtures; ``sglang_stream`` names the
    SGLang stream it replays (SGLang's default, cumulative, or ``--incremental-streaming-output``)."""

    def __init__(self) -> None:
        self.sglang_stream = "sglang_generate_cumulative.sse"
        self.seen: list[str] = []
        routes = [
            Route("/inference/v1/generate", self.vllm, methods=["POST"]),
            Route("/generate", self.sglang, methods=["POST", "GET"]),
            *(
                Route(path, self.other, methods=[method])
                for method, path in NOT_MODEL_CALLS
                if path != "/generate"
            ),
        ]
        self.app = Starlette(routes=routes)

    async def vllm(self, request: Request) -> Response:
        return await self._answer(request, "vllm_generate.json", "vllm_generate.sse")

    async def sglang(self, request: Request) -> Response:
        if request.method == "GET":
            return await self.other(request)
        return await self._answer(request, "sglang_generate.json", self.sglang_stream)

    async def other(self, request: Request) -> Response:
        self.seen.append(request.url.path)
        return JSONResponse({"success": True, "path": request.url.path})

    async def _answer(self, request: Request, body: str, stream: str) -> Response:
        self.seen.append(request.url.path)
        if (await request.json()).get("stream"):
            return StreamingResponse(
                _events((GENERATE / stream).read_bytes()), media_type="text/event-stream"
            )
        return Response((GENERATE / body).read_bytes(), media_type="application/json")


async def _events(raw: bytes) -> AsyncIterator[bytes]:
    for event in raw.split(b"\n\n"):
        if event.strip():
            yield event + b"\n\n"
            await asyncio.sleep(0.002)  # a model generates token by token


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def proxied(
    engine: ScriptedEngine, tmp_path: Path
) -> Iterator[tuple[str, CaptureStore, InMemorySpanExporter]]:
    store = CaptureStore(tmp_path / "calls")
    provider = TracerProvider()
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    provider.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(store.root)))
    with serve(engine.app) as upstream, start_proxy(upstream, tracer_provider=provider) as proxy:
        yield proxy.url, store, spans
    provider.shutdown()


def _call(url: str, body: dict[str, Any], *, stream: bool) -> tuple[Any, list[dict[str, Any]]]:
    """One call as a trainer makes it: the JSON body, or the stream's chunks in order."""
    with httpx.Client(timeout=30, headers={"x-rollout-id": "r1"}) as client:
        if not stream:
            answer = client.post(url, json=body)
            answer.raise_for_status()
            return answer.json(), []
        with client.stream("POST", url, json={**body, "stream": True,
                                                "stream_options": {"include_usage": True}}) as answer:  # fmt: skip
            answer.raise_for_status()
            raw = b"".join(answer.iter_bytes())
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert raw.endswith(b"data: [DONE]\n\n")
    return None, chunks


def _vllm_from_chunks(chunks: list[dict[str, Any]]) -> tuple[list[int], list[float], str, dict[str, Any]]:
    """What the client got from vLLM's stream: the ids and log-probs of its chunks, the finish reason, usage."""
    ids: list[int] = []
    log_probs: list[float] = []
    finish = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids += choice["token_ids"]
            log_probs += [entry["logprob"] for entry in choice["logprobs"]["content"]]
            finish = choice["finish_reason"] or finish
    return ids, log_probs, finish, chunks[-1]["usage"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_vllm_generate_call_through_the_proxy_is_recorded_as_the_client_got_it(
    proxied: tuple[str, CaptureStore, InMemorySpanExporter], engine: ScriptedEngine, stream: bool
) -> None:
    url, store, spans = proxied
    path, body = VLLM
    answer, chunks = _call(url + path, body, stream=stream)

    (record,) = read_model_call_records(store, "r1")
    assert (record.dialect, record.status_code, record.error_category, record.stream) == (
        "generate", 200, None, stream)  # fmt: skip
    assert record.request is not None and record.request["token_ids"] == PROMPT
    assert record.response is not None
    if stream:
        ids, log_probs, finish, usage = _vllm_from_chunks(chunks)
        (choice,) = record.response["choices"]
        assert choice["token_ids"] == ids
        assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == log_probs
        assert (choice["finish_reason"], record.response["usage"]) == (finish, usage)
        assert record.response["prompt_token_ids"] == chunks[0]["prompt_token_ids"]
    else:
        assert record.response == answer  # the body, byte for byte
        ids, finish = answer["choices"][0]["token_ids"], answer["choices"][0]["finish_reason"]
    assert (ids, finish) == (OUTPUT, "length")
    assert (record.tokens_in, record.tokens_out, record.finish_reason, record.model) == (
        6,
        4,
        "length",
        "gemma-3-270m",
    )
    raw = store.read_token_lines("r1")
    assert raw is not None
    (line,) = (json.loads(x) for x in raw.lines)
    assert (line["model_call_id"], line["prompt_token_ids"]) == (record.model_call_id, PROMPT)
    assert line["generations"] == [{"index": 0, "token_ids": OUTPUT, "log_probs": LOG_PROBS}]
    (span,) = [s for s in spans.get_finished_spans() if s.attributes and "rollout.id" in s.attributes]
    assert span.attributes is not None and span.name == "text_completion gemma-3-270m"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert span.attributes["gen_ai.usage.output_tokens"] == 4


@pytest.mark.parametrize(
    ("stream", "mode"),
    [(False, None), (True, "sglang_generate_cumulative.sse"), (True, "sglang_generate_incremental.sse")],
    ids=["json", "sse-cumulative", "sse-incremental"],
)
def test_an_sglang_generate_call_through_the_proxy_is_recorded_as_the_client_got_it(
    proxied: tuple[str, CaptureStore, InMemorySpanExporter],
    engine: ScriptedEngine,
    stream: bool,
    mode: str | None,
) -> None:
    url, store, _ = proxied
    if mode is not None:
        engine.sglang_stream = mode
    path, body = SGLANG
    answer, chunks = _call(url + path, body, stream=stream)

    (record,) = read_model_call_records(store, "r1")
    assert (record.dialect, record.error_category, record.stream) == ("generate", None, stream)
    if stream and mode == "sglang_generate_cumulative.sse":
        got = chunks[-1]  # each chunk is the whole answer so far: the last is the answer
    elif stream:  # each chunk its step: the client joins them
        got = {
            "text": "".join(c["text"] for c in chunks),
            "output_ids": [i for c in chunks for i in c["output_ids"]],
            "meta_info": {**chunks[-1]["meta_info"],
                          "output_token_logprobs": [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]},
        }  # fmt: skip
    else:
        got = answer
    assert record.response == got
    assert got["output_ids"] == OUTPUT
    assert (record.tokens_in, record.tokens_out, record.finish_reason) == (6, 4, "length")
    assert (record.response_id, record.engine_weight_version) == (got["meta_info"]["id"], "default")
    raw = store.read_token_lines("r1")
    assert raw is not None
    (line,) = (json.loads(x) for x in raw.lines)
    assert (line["prompt_token_ids"], line["generations"]) == (
        PROMPT, [{"index": 0, "token_ids": OUTPUT, "log_probs": LOG_PROBS}])  # fmt: skip


def test_the_engines_other_routes_pass_through_unrecorded(
    proxied: tuple[str, CaptureStore, InMemorySpanExporter], engine: ScriptedEngine
) -> None:
    url, store, _ = proxied
    with httpx.Client(timeout=30, headers={"x-rollout-id": "r1"}) as client:
        for method, path in NOT_MODEL_CALLS:
            answer = client.request(method, url + path, json={} if method == "POST" else None)
            assert answer.status_code == 200 and answer.json()["path"] == path
        path, body = VLLM
        client.post(url + path, json=body).raise_for_status()
    assert engine.seen == [path for _, path in NOT_MODEL_CALLS] + ["/inference/v1/generate"]
    (record,) = read_model_call_records(store, "r1")  # the model call alone
    assert record.dialect == "generate" and record.error_category is None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_generate_call_in_process_under_the_middleware(
    engine: ScriptedEngine, telemetry: Telemetry, stream: bool
) -> None:
    app = ModelCallCaptureMiddleware(engine.app, tracer_provider=telemetry.provider)
    with serve(app) as url:
        _call(url + VLLM[0], VLLM[1], stream=stream)
        _call(url + SGLANG[0], SGLANG[1], stream=stream)
    vllm, sglang = read_model_call_records(telemetry.store, "r1")
    assert [r.dialect for r in (vllm, sglang)] == ["generate", "generate"]
    assert [(r.tokens_out, r.finish_reason, r.stream) for r in (vllm, sglang)] == [(4, "length", stream)] * 2
