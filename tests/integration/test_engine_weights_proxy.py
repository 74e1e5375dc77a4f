"""The engine's weight version through a running capture proxy in front of a scripted engine (a real
uvicorn) that serves the RL routes with vLLM 0.32.0's shapes (``/update_weight_version``,
``/finish_weight_update``, ``/pause?mode=keep``, ``/resume``, ``/weight_info``) and SGLang's
(``/update_weights_from_disk``, ``/update_weights_from_tensor``, ``/get_weight_version``): the trainer's
update calls pass through the proxy, or, with ``engine_weight_info``, the proxy asks the engine. The RL
routes, ``/v1/models`` and ``/health`` stay unrecorded and leave the rollout complete (issue 32)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs

import httpx
import openai
import pytest
from support import Gate, Telemetry, serve

from otel_capture import CaptureSettings, build_model_call_capture, read_model_call_records, start_proxy
from otel_capture._proxy import RunningProxy

TIMEOUT = 30


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _delta(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return _sse({"id": "c1", "object": "chat.completion.chunk", "model": "policy", "choices": [choice]})


class ScriptedEngine:
    """An engine's HTTP face: chat completions (a stream held at ``gate`` after its first chunk, when set)
    and the RL routes, answering as vLLM 0.32.0 and SGLang do. ``requests`` lists (method, path)."""

    def __init__(self, version: str = "default", *, vllm_info: bool = True) -> None:
        self.version = version
        self.vllm_info = vllm_info
        self.gate: Gate | None = None
        self.requests: list[tuple[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        method, path = scope["method"], scope["path"]
        self.requests.append((method, path))
        request = json.loads(body) if body else {}
        if path == "/v1/chat/completions":
            await self._chat(request, send)
            return
        status, answer = self._rl(method, path, request, parse_qs(scope["query_string"].decode()))
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    def _rl(
        self, method: str, path: str, request: dict[str, Any], query: dict[str, list[str]]
    ) -> tuple[int, Any]:
        if (method, path) == ("POST", "/update_weight_version"):  # vLLM's and SGLang's
            self.version = request["new_version"]
            return 200, {"success": True, "new_version": self.version}
        if (method, path) == ("POST", "/finish_weight_update"):  # vLLM's
            self.version = request.get("weight_version") or self.version
            return 200, {"message": "Weight update finished"}
        if (method, path) in (("POST", "/start_weight_update"), ("POST", "/update_weights")):
            return 200, {"message": "ok"}
        if (method, path) == ("GET", "/weight_info") and self.vllm_info:
            return 200, {"weight_version": self.version}
        if (method, path) == ("POST", "/pause"):
            assert query.get("mode") == ["keep"]
            return 200, {"status": "paused"}
        if (method, path) == ("POST", "/resume"):
            return 200, {"status": "resumed"}
        if method == "POST" and path.startswith("/update_weights_from_"):  # SGLang's
            if request.get("model_path") == "missing":
                return 400, {"success": False, "message": "Failed to load.", "num_paused_requests": 0}
            self.version = request.get("weight_version") or self.version
            return 200, {"success": True, "message": f"Succeeded. Weight version updated to {self.version}."}
        if (method, path) == ("GET", "/get_weight_version"):  # SGLang's
            return 200, {"weight_version": self.version}
        if (method, path) == ("GET", "/v1/models"):
            return 200, {"object": "list", "data": [{"id": "policy", "object": "model"}]}
        if (method, path) == ("GET", "/health"):
            return 200, {}
        return 404, {"detail": "Not Found"}

    async def _chat(self, request: dict[str, Any], send: Any) -> None:
        if not request.get("stream"):
            answer = {
                "id": "c2",
                "object": "chat.completion",
                "created": 1,
                "model": "policy",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                ],
            }
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": json.dumps(answer).encode()})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": _delta("one "), "more_body": True})
        if self.gate is not None:
            await self.gate.wait()
        await send({"type": "http.response.body", "body": _delta("two", "stop"), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def proxy(
    engine: ScriptedEngine, telemetry: Telemetry, request: pytest.FixtureRequest
) -> Iterator[RunningProxy]:
    settings = CaptureSettings(engine_weight_info=getattr(request, "param", False))
    with (
        serve(engine) as url,
        start_proxy(url, settings=settings, tracer_provider=telemetry.provider) as running,
    ):
        yield running


def _trainer(proxy: RunningProxy, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    answer = httpx.request(method, proxy.url + path, json=body, timeout=TIMEOUT)
    answer.raise_for_status()
    return answer.json()


def _chat(proxy: RunningProxy, rollout_id: str, **headers: str) -> None:
    with openai.OpenAI(
        base_url=f"{proxy.url}/ng-rollout/{rollout_id}/v1",
        api_key="k",
        max_retries=0,
        default_headers=headers,
    ) as client:
        client.chat.completions.create(model="policy", messages=[])


def test_a_stream_across_a_kept_pause_and_an_update_records_both_versions_and_the_pause(
    engine: ScriptedEngine, proxy: RunningProxy, telemetry: Telemetry
) -> None:
    assert _trainer(proxy, "POST", "/update_weight_version", {"new_version": "7"})["new_version"] == "7"
    engine.gate = gate = Gate()
    text: list[str] = []
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            with openai.OpenAI(base_url=f"{proxy.url}/ng-rollout/across/v1", api_key="k", max_retries=0) as c:
                for chunk in c.chat.completions.create(model="policy", messages=[], stream=True):
                    text.extend(choice.delta.content or "" for choice in chunk.choices)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert gate.reached.wait(TIMEOUT)  # the first chunk is out: the call is running
        # the trainer's sync, as with vLLM's RL routes: pause keeping the call, load, name the version, resume
        assert _trainer(proxy, "POST", "/pause?mode=keep") == {"status": "paused"}
        _trainer(proxy, "POST", "/start_weight_update")
        _trainer(proxy, "POST", "/update_weights", {"update_info": {}})
        _trainer(proxy, "POST", "/finish_weight_update", {"weight_version": "8"})
        _trainer(proxy, "POST", "/resume")
    finally:
        gate.open()
        thread.join(TIMEOUT)
    assert not errors and "".join(text) == "one two"
    # not model calls: unrecorded, whatever rollout id they carry
    for path in ("/v1/models", "/health"):
        httpx.get(proxy.url + path, headers={"x-rollout-id": "across"}, timeout=TIMEOUT).raise_for_status()
    _chat(proxy, "across")  # admitted after the update

    across, after = read_model_call_records(telemetry.store, "across")
    assert (across.engine_weight_version, across.engine_weight_version_at_end) == ("7", "8")
    assert across.engine_weight_versions == ["7", "8"]
    [pause] = across.engine_pauses or []
    assert pause["mode"] == "keep" and pause["paused_at"] <= pause["resumed_at"]
    assert across.started_at is not None and across.completed_at is not None
    assert across.started_at <= pause["paused_at"] <= pause["resumed_at"] <= across.completed_at
    assert across.weight_version_sources == {
        "engine_weight_version": "engine_update",
        "engine_weight_version_at_end": "engine_update",
    }
    assert (after.engine_weight_version, after.engine_weight_version_at_end, after.engine_pauses) == (
        "8",
        None,
        None,
    )
    assert after.engine_weight_versions is None and after.weight_version is None

    attachment = build_model_call_capture(telemetry.store, "across")
    assert "gaps" not in attachment  # nothing incomplete, nothing in flight
    assert [c["engine_weight_versions"] for c in attachment["calls"]] == [["7", "8"], None]
    assert attachment["calls"][0]["engine_pauses"] == [pause]
    spans = [
        dict(s.attributes or {})
        for s in telemetry.spans.get_finished_spans()
        if (s.attributes or {}).get("rollout.id") == "across"
    ]
    assert [
        (a["otel_capture.engine_weight_version"], a.get("otel_capture.engine_weight_version_at_end"))
        for a in spans
    ] == [
        ("7", "8"),
        ("8", None),
    ]
    shown = subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "show", str(telemetry.store.root), "across"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    ).stdout.splitlines()
    assert shown[1].endswith(" - (engine 7->8, 1 pause)") and shown[2].endswith(" - (engine 8)")
    assert ("GET", "/weight_info") not in engine.requests  # not asked: the setting is off


def test_sglang_updates_through_the_proxy_set_the_version_only_when_they_succeed(
    engine: ScriptedEngine, proxy: RunningProxy, telemetry: Telemetry
) -> None:
    telemetry.store.set_weight_version("d1")
    _trainer(proxy, "POST", "/update_weights_from_disk", {"model_path": "/ckpt/3", "weight_version": "3"})
    _chat(proxy, "sglang")
    failed = httpx.post(
        proxy.url + "/update_weights_from_disk",
        json={"model_path": "missing", "weight_version": "4"},
        timeout=TIMEOUT,
    )
    assert failed.status_code == 400
    _chat(proxy, "sglang", **{"x-weight-version": "c9"})
    _trainer(
        proxy, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [], "weight_version": "5"}
    )
    _chat(proxy, "sglang")
    records = read_model_call_records(telemetry.store, "sglang")
    assert [(r.engine_weight_version, r.weight_version) for r in records] == [
        ("3", "d1"),
        ("3", "c9"),
        ("5", "d1"),
    ]
    assert [r.weight_version_sources for r in records] == [
        {"engine_weight_version": "engine_update"},
        {"engine_weight_version": "engine_update", "weight_version": "caller"},
        {"engine_weight_version": "engine_update"},
    ]
    assert [r.weight_version_source for r in records] == ["declared", "caller", "declared"]
    assert "gaps" not in build_model_call_capture(telemetry.store, "sglang")


@pytest.mark.parametrize("proxy", [True], indirect=True)
@pytest.mark.parametrize("vllm_info", [True, False], ids=["vllm", "sglang"])
def test_with_the_setting_the_proxy_asks_the_engine_whose_updates_do_not_pass_through_it(
    engine: ScriptedEngine, proxy: RunningProxy, telemetry: Telemetry, vllm_info: bool
) -> None:
    engine.vllm_info = vllm_info
    engine.version = "v1"  # set behind the proxy's back: the trainer talks to the engine directly
    _chat(proxy, "asked")
    engine.version = "v2"
    _chat(proxy, "asked")
    records = read_model_call_records(telemetry.store, "asked")
    assert [r.engine_weight_version for r in records] == ["v1", "v2"]
    assert [r.weight_version_sources for r in records] == [{"engine_weight_version": "engine_info"}] * 2
    asked = [r for r in engine.requests if r[0] == "GET"]
    info = "/weight_info" if vllm_info else "/get_weight_version"
    assert asked.count(("GET", info)) == 2  # once per call here: each came alone
