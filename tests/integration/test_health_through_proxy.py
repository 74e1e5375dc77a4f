"""Rollout health from real calls: the official openai SDK through the capture proxy to a scripted upstream
(a real uvicorn on 127.0.0.1), each check made to fire by what the upstream answers, and a healthy rollout
shown to stay healthy. The verdict is read by ``rollout_health`` and by ``otel-capture health``."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from support import Gate, Telemetry, read_body, serve, serve_lifespan

from otel_capture import (
    CaptureSettings,
    CaptureStore,
    ModelCallCaptureMiddleware,
    ModelCallRecord,
    ProxySettings,
    WriterSettings,
    aggregate_model_call_metrics,
    attach_model_call_capture,
    build_model_call_capture,
    read_model_call_records,
    rollout_health,
    start_proxy,
)
from otel_capture._cli.main import main

TIMEOUT = 30
OVERFLOW = (
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the "
    "messages, 1000 in the completion). Please reduce the length of the messages or completion."
)


class ScriptedModel:
    """An OpenAI-compatible chat server whose answer is chosen by the last message's text: ``ok``,
    ``zero`` (no token generated), ``long`` (stopped at the request's ``max_tokens``), ``nousage``,
    ``fail`` (500), ``overflow`` (vLLM's 400 for a prompt over the context), ``replayed`` (the same
    ``x-request-id`` every time), ``hold`` (waits at :attr:`gate`, then ``ok``), ``mismatch`` (vLLM's
    token ids, one more than the usage counts). Streams when asked."""

    def __init__(self) -> None:
        self.gate = Gate()
        self._ids = itertools.count()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        request = json.loads(await read_body(receive))
        word = request["messages"][-1]["content"]
        if word == "hold":
            await self.gate.wait()
        n = next(self._ids)
        request_id = b"req-replayed" if word == "replayed" else f"req-{n}".encode()
        if word in ("fail", "overflow"):
            status = 500 if word == "fail" else 400
            message = "the engine died" if word == "fail" else OVERFLOW
            error = {"error": {"message": message, "type": "BadRequestError", "code": status}}
            await _send(send, status, b"application/json", request_id, [json.dumps(error).encode()])
            return
        tokens = {"zero": 0, "long": request.get("max_tokens")}.get(word, 2)
        usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
        finish = "length" if word == "long" else "stop"
        text = "" if word == "zero" else "fine " * tokens
        if request.get("stream"):
            chunk = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 1, "model": "m"}
            events = [
                {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}]},
                {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
            ]
            if (request.get("stream_options") or {}).get("include_usage") and word != "nousage":
                events.append({**chunk, "choices": [], "usage": usage})
            body = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
            await _send(send, 200, b"text/event-stream", request_id, body)
            return
        answer: dict[str, Any] = {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            ],
        }
        if word != "nousage":
            answer["usage"] = usage
        if word == "mismatch":  # vLLM's return_token_ids, one id more than the usage counts
            answer["prompt_token_ids"] = [1, 2, 3, 4, 5]
            answer["choices"][0]["token_ids"] = [11, 12, 13]
        await _send(send, 200, b"application/json", request_id, [json.dumps(answer).encode()])


async def _send(send: Any, status: int, content_type: bytes, request_id: bytes, chunks: list[bytes]) -> None:
    headers = [(b"content-type", content_type), (b"x-request-id", request_id)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    for chunk in chunks:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture
def model() -> ScriptedModel:
    return ScriptedModel()


@pytest.fixture
def upstream(model: ScriptedModel) -> Iterator[str]:
    with serve(model) as url:
        yield url


@pytest.fixture
def capture_dir(tmp_path: Path) -> Path:
    return tmp_path / "calls"


@pytest.fixture
def proxy_url(upstream: str, capture_dir: Path) -> Iterator[str]:
    with start_proxy(upstream, str(capture_dir), proxy=ProxySettings(max_concurrent_calls=1)) as proxy:
        yield proxy.url


def _client(proxy_url: str, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy_url}/ng-rollout/{rollout_id}/v1", api_key="k", max_retries=0)


def call(proxy_url: str, rollout_id: str, word: str, **options: Any) -> Any:
    """One chat call; an error answer is returned as the SDK's exception, not raised."""
    with _client(proxy_url, rollout_id) as client:
        try:
            response = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": word}], **options
            )
            if options.get("stream"):
                return list(response)
            return response
        except openai.APIStatusError as exc:
            return exc


def fired(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in result["checks"]}


def records(capture_dir: Path, rollout_id: str) -> list[ModelCallRecord]:
    return read_model_call_records(CaptureStore(capture_dir), rollout_id)


def cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["health", *argv])
    return code, capsys.readouterr().out.splitlines()


# --- a healthy rollout ----------------------------------------------------------------------------------


def test_a_healthy_rollout_stays_healthy(
    proxy_url: str, upstream: str, capture_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call(proxy_url, "good", "ok", max_tokens=50)
    call(proxy_url, "good", "ok", stream=True, stream_options={"include_usage": True})
    call(proxy_url, "good", "fail")  # failed, then retried successfully: not the rollout's end
    call(proxy_url, "good", "ok")

    assert rollout_health(capture_dir, "good") == {"verdict": "healthy", "checks": []}
    record: dict[str, Any] = {"_ng_rollout_id": "good"}
    assert attach_model_call_capture(record, capture_dir)["health"] == {"verdict": "healthy", "checks": []}
    code, out = cli(str(capture_dir), capsys=capsys)
    assert (code, out) == (0, ["Rollout health: 1 checked, 1 healthy, 0 unhealthy, 0 unobserved"])

    # every record names its writer: this host and process, the proxy and the upstream it forwarded to
    first = records(capture_dir, "good")[0]
    assert first.writer == {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "layer": "proxy",
        "upstream": upstream,
    }
    assert [r.upstream_request_id for r in records(capture_dir, "good")] == [f"req-{n}" for n in range(4)]


def test_an_in_process_capture_names_its_process_and_no_upstream(
    model: ScriptedModel, telemetry: Telemetry
) -> None:
    app = ModelCallCaptureMiddleware(model, tracer_provider=telemetry.provider, settings=CaptureSettings())
    with serve(app) as url:
        call(url, "inside", "ok")
    [record] = read_model_call_records(telemetry.store, "inside")
    assert record.writer == {"host": socket.gethostname(), "pid": os.getpid(), "layer": "in_process"}
    assert record.upstream_request_id is None  # the server is the writer: there is no upstream
    assert rollout_health(telemetry.store, "inside") == {"verdict": "healthy", "checks": []}


def test_the_writer_never_names_a_key_in_the_upstreams_url(upstream: str, capture_dir: Path) -> None:
    with start_proxy(upstream + "/?api-key=hidden", str(capture_dir)) as proxy:
        call(proxy.url, "creds", "ok")
    [record] = records(capture_dir, "creds")
    assert record.writer is not None and record.writer["upstream"] == upstream
    assert "hidden" not in CaptureStore(capture_dir).data_path("creds").read_text()


# --- unhealthy checks ------------------------------------------------------------------------------------


def test_last_call_failed(proxy_url: str, capture_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    call(proxy_url, "ended-badly", "ok")
    call(proxy_url, "ended-badly", "fail")
    failing = records(capture_dir, "ended-badly")[1]
    result = rollout_health(capture_dir, "ended-badly")
    assert result["verdict"] == "unhealthy"
    assert fired(result)["last_call_failed"]["calls"] == [failing.model_call_id]
    assert "status 500" in fired(result)["last_call_failed"]["detail"]
    code, out = cli(str(capture_dir), capsys=capsys)
    assert code == 1
    assert out == [
        "ended-badly: unhealthy: last_call_failed",
        "Rollout health: 1 checked, 0 healthy, 1 unhealthy, 0 unobserved",
    ]


def test_zero_completion_tokens(proxy_url: str, capture_dir: Path) -> None:
    call(proxy_url, "empty", "zero")
    result = rollout_health(capture_dir, "empty")
    assert result["verdict"] == "unhealthy"
    assert fired(result)["zero_completion_tokens"]["calls"] == [
        records(capture_dir, "empty")[0].model_call_id
    ]


def test_runaway_generation(proxy_url: str, capture_dir: Path) -> None:
    call(proxy_url, "runaway", "long", max_tokens=7)
    result = rollout_health(capture_dir, "runaway")
    assert result["verdict"] == "unhealthy"
    assert list(fired(result)) == ["runaway_generation"]


def test_usage_missing(proxy_url: str, capture_dir: Path) -> None:
    call(proxy_url, "no-usage", "ok", stream=True)  # a stream without include_usage: no token counts
    result = rollout_health(capture_dir, "no-usage")
    assert result["verdict"] == "unhealthy"
    assert list(fired(result)) == ["usage_missing"]


def test_tokens_missing(proxy_url: str, capture_dir: Path) -> None:
    call(proxy_url, "no-logprobs", "ok", logprobs=True)  # asked for log-probs, answered without
    result = rollout_health(capture_dir, "no-logprobs")
    assert result["verdict"] == "unhealthy"
    check = fired(result)["tokens_missing"]
    assert check["calls"] == [records(capture_dir, "no-logprobs")[0].model_call_id]
    assert "logprobs" in check["detail"]


def test_token_mismatch(proxy_url: str, capture_dir: Path) -> None:
    # three generated ids where the usage counts two completion tokens
    call(proxy_url, "mismatch", "mismatch", extra_body={"return_token_ids": True})
    [record] = records(capture_dir, "mismatch")
    result = rollout_health(capture_dir, "mismatch")
    assert result["verdict"] == "unhealthy"
    check = fired(result)["token_mismatch"]
    assert check["calls"] == [record.model_call_id]
    assert record.token_mismatch is not None and record.token_mismatch in check["detail"]


def test_in_flight(proxy_url: str, model: ScriptedModel, capture_dir: Path) -> None:
    call(proxy_url, "busy", "ok")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(call, proxy_url, "busy", "hold")
        try:
            assert model.gate.reached.wait(TIMEOUT)  # the upstream has it: the call is in flight
            during = rollout_health(capture_dir, "busy")
        finally:
            model.gate.open()
        held.result(TIMEOUT)
    assert during["verdict"] == "unhealthy"
    [mcid] = fired(during)["in_flight"]["calls"]
    assert rollout_health(capture_dir, "busy") == {"verdict": "healthy", "checks": []}  # it ended
    assert mcid == records(capture_dir, "busy")[1].model_call_id


def test_the_attachment_names_a_call_frozen_out_in_flight(
    proxy_url: str, model: ScriptedModel, capture_dir: Path
) -> None:
    call(proxy_url, "late", "ok")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(call, proxy_url, "late", "hold")
        try:
            assert model.gate.reached.wait(TIMEOUT)
            record: dict[str, Any] = {"_ng_rollout_id": "late"}
            attachment = attach_model_call_capture(record, capture_dir, wait_s=0)  # the collector gives up
        finally:
            model.gate.open()
        held.result(TIMEOUT)
    health = attachment["health"]
    assert health["verdict"] == "unhealthy"
    [mcid] = fired(health)["in_flight"]["calls"]
    assert mcid not in [c["model_call_id"] for c in attachment["calls"]]
    assert [c["name"] for c in health["checks"]] == ["in_flight"]


HOLDER = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)


def test_lost_calls(upstream: str, capture_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writer = WriterSettings.from_environ(directory=capture_dir, lock_timeout_s=0.5)
    with start_proxy(upstream, writer=writer) as proxy:
        call(proxy.url, "locked", "ok")
        path = CaptureStore(capture_dir).data_path("locked")
        # another process holds the data file's lock past the writer's timeout: the next line is lost
        with subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE) as holder:
            try:
                assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
                answered = call(proxy.url, "locked", "ok")
            finally:
                holder.kill()
                holder.wait(TIMEOUT)
    assert answered.choices[0].message.content == "fine fine "  # the client got its answer all the same
    [kept] = records(capture_dir, "locked")
    result = rollout_health(capture_dir, "locked")
    assert result["verdict"] == "unhealthy"
    check = fired(result)["lost_calls"]
    assert len(check["calls"]) == 1 and check["calls"] != [kept.model_call_id]
    assert "locked by another process" in check["detail"]
    assert build_model_call_capture(capture_dir, "locked")["health"] == result  # the attachment says so too
    code, out = cli(str(capture_dir), capsys=capsys)
    assert (code, out[0]) == (1, "locked: unhealthy: lost_calls")


def test_duplicate_call_same_answer_twice(proxy_url: str, capture_dir: Path) -> None:
    call(proxy_url, "replay", "replayed")
    call(proxy_url, "replay", "replayed")  # a replaying gateway: the same upstream answer again
    result = rollout_health(capture_dir, "replay")
    assert result["verdict"] == "unhealthy"
    check = fired(result)["duplicate_call"]
    assert check["calls"] == [r.model_call_id for r in records(capture_dir, "replay")]
    assert "req-replayed" in check["detail"]


def test_duplicate_call_same_record_in_two_directories(
    proxy_url: str, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call(proxy_url, "copied", "ok")
    other = tmp_path / "node-2"
    other.mkdir()
    store = CaptureStore(capture_dir)
    shutil.copy(store.data_path("copied"), CaptureStore(other).data_path("copied"))  # a file copied twice
    assert rollout_health(capture_dir, "copied")["verdict"] == "healthy"
    result = rollout_health([capture_dir, other], "copied")
    assert fired(result)["duplicate_call"]["calls"] == [records(capture_dir, "copied")[0].model_call_id]
    code, out = cli(str(capture_dir), str(other), capsys=capsys)
    assert code == 1 and out[0] == "copied: unhealthy: duplicate_call"


def test_unobserved_rollout(proxy_url: str, capture_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    call(proxy_url, "seen", "ok")
    assert rollout_health(capture_dir, "never") == {"verdict": "unobserved", "checks": []}
    code, out = cli(str(capture_dir), "--rollout", "seen", "--rollout", "never", capsys=capsys)
    assert code == 1
    assert out == ["never: unobserved", "Rollout health: 2 checked, 1 healthy, 0 unhealthy, 1 unobserved"]


# --- reported, never unhealthy --------------------------------------------------------------------------


def test_refused_calls_are_retries_not_failures(
    proxy_url: str, model: ScriptedModel, capture_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(call, proxy_url, "busy", "hold")
        try:
            assert model.gate.reached.wait(TIMEOUT)  # the proxy's one place is taken
            refused = call(proxy_url, "busy", "ok", stream=True, stream_options={"include_usage": True})
        finally:
            model.gate.open()
        held.result(TIMEOUT)
    assert isinstance(refused, openai.APIStatusError) and refused.status_code == 503
    assert refused.response.headers["retry-after"] == "1"
    call(proxy_url, "busy", "ok", stream=True, stream_options={"include_usage": True})  # the retry

    [refusal] = [r for r in records(capture_dir, "busy") if r.status_code == 503]
    assert refusal.refused and refusal.stream is True  # what the client asked for, not the 503's JSON
    assert (refusal.upstream_attempted, refusal.response_source) == (False, "local")
    assert refusal.local_response_reason == "proxy_over_capacity"
    metrics = aggregate_model_call_metrics(CaptureStore(capture_dir), "busy")
    assert (metrics["num_calls"], metrics["num_errors"], metrics["num_refused"]) == (3, 0, 1)

    result = rollout_health(capture_dir, "busy")
    assert result["verdict"] == "healthy"
    assert fired(result)["refused_calls"]["calls"] == [refusal.model_call_id]
    assert cli(str(capture_dir), capsys=capsys)[0] == 0

    assert main(["ls", str(capture_dir)]) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    names = header.replace("tokens in", "tokens_in").replace("tokens out", "tokens_out").split()
    names = " ".join(names).replace("model s", "model_s").replace(" ms", "_ms").split()
    cells = dict(zip(names, row.split(), strict=False))
    assert (cells["calls"], cells["errors"], cells["refused"]) == ("3", "0", "1")


def test_context_overflow_is_kept_apart(proxy_url: str, capture_dir: Path) -> None:
    call(proxy_url, "full", "ok")
    call(proxy_url, "full", "overflow")  # the rollout ended on the model's context: not a failed rollout
    result = rollout_health(capture_dir, "full")
    assert result["verdict"] == "healthy"
    assert fired(result)["context_overflow"]["calls"] == [records(capture_dir, "full")[1].model_call_id]


def test_weight_version_changed(proxy_url: str, model: ScriptedModel, capture_dir: Path) -> None:
    store = CaptureStore(capture_dir)
    call(proxy_url, "update", "ok")
    store.set_weight_version("7")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(call, proxy_url, "update", "hold")
        try:
            assert model.gate.reached.wait(TIMEOUT)
            store.set_weight_version("8")  # the trainer synced new weights while the call ran
        finally:
            model.gate.open()
        held.result(TIMEOUT)
    result = rollout_health(capture_dir, "update")
    assert result["verdict"] == "healthy"
    assert fired(result)["weight_version_changed"]["calls"] == [
        records(capture_dir, "update")[1].model_call_id
    ]


def test_several_writers(proxy_url: str, upstream: str, capture_dir: Path, tmp_path: Path) -> None:
    call(proxy_url, "spread", "ok")
    with serve(ScriptedModel()) as second_upstream, start_proxy(second_upstream, str(capture_dir)) as second:
        call(second.url, "spread", "ok")  # round-robin: the next call went to another model server
    result = rollout_health(capture_dir, "spread")
    assert result["verdict"] == "healthy", result
    check = fired(result)["several_writers"]
    assert check["calls"] == [r.model_call_id for r in records(capture_dir, "spread")]
    assert upstream in check["detail"] and second_upstream in check["detail"]


def test_the_summary_file(proxy_url: str, capture_dir: Path, tmp_path: Path) -> None:
    call(proxy_url, "a", "ok")
    call(proxy_url, "b", "zero")
    summary_path = tmp_path / "summary.json"
    assert main(["health", str(capture_dir), "--summary", str(summary_path)]) == 1
    summary = json.loads(summary_path.read_text())
    zero_call = records(capture_dir, "b")[0].model_call_id
    assert summary == {
        "checked": 2,
        "healthy": 1,
        "unhealthy": 1,
        "unobserved": 0,
        "rollouts": {
            "a": {"verdict": "healthy", "checks": []},
            "b": {
                "verdict": "unhealthy",
                "checks": [
                    {
                        "name": "zero_completion_tokens",
                        "calls": [zero_call],
                        "detail": "1 call(s) answered 0 tokens",
                    }
                ],
            },
        },
    }
