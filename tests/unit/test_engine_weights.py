"""The engine's weight version as a capture layer observes it (``otel_capture._capture.engine``): the state
alone, then the RL routes' real shapes (vLLM 0.32.0's and SGLang's) passing through a tiny ASGI app."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from otel_capture._capture.engine import EngineWeights, engine_route


def _scope(path: str, method: str = "POST", query: bytes = b"", **extra: Any) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "query_string": query, "headers": [], **extra}


def test_a_call_during_which_nothing_changed_carries_only_its_admission_version() -> None:
    engine = EngineWeights()
    engine.set("7", "engine_update")
    admitted = engine.admit()
    assert engine.fields(admitted) == {
        "engine_weight_version": "7",
        "weight_version_sources": {"engine_weight_version": "engine_update"},
    }


def test_a_call_across_updates_has_the_version_at_end_and_every_version_it_saw_oldest_first() -> None:
    engine = EngineWeights()
    engine.set("7", "engine_info")
    admitted = engine.admit()
    engine.set("8", "engine_update")
    engine.set("8", "engine_update")  # the same version again: no change
    engine.set("9", "engine_update")
    later = engine.admit()
    fields = engine.fields(admitted)
    assert fields["engine_weight_version"] == "7"
    assert fields["engine_weight_version_at_end"] == "9"
    assert fields["engine_weight_versions"] == ["7", "8", "9"]
    assert fields["weight_version_sources"] == {
        "engine_weight_version": "engine_info",
        "engine_weight_version_at_end": "engine_update",
    }
    assert engine.fields(later)["engine_weight_version"] == "9"
    assert "engine_weight_versions" not in engine.fields(later)


def test_without_an_observed_version_the_answer_s_is_used_and_named_so() -> None:
    engine = EngineWeights()
    assert engine.fields(engine.admit()) == {}
    assert engine.fields(engine.admit(), answered="5") == {
        "engine_weight_version": "5",
        "weight_version_sources": {"engine_weight_version": "engine_answer"},
    }
    first = engine.admit()
    engine.set("3", "engine_update")  # the first version known: not a change for a call admitted before
    assert "engine_weight_version_at_end" not in engine.fields(first)


def test_pauses_a_call_waited_through_are_named_on_it_and_only_those() -> None:
    engine = EngineWeights()
    before = engine.admit()
    engine.pause("keep", at=10.0)
    during = engine.admit()  # admitted while paused: it waits for the resume
    engine.set("2", "engine_update")
    engine.resume(at=12.0)
    after = engine.admit()
    engine.pause("abort", at=20.0)
    engine.resume(at=21.0)
    first = {"mode": "keep", "paused_at": 10.0, "resumed_at": 12.0}
    second = {"mode": "abort", "paused_at": 20.0, "resumed_at": 21.0}
    assert engine.fields(before)["engine_pauses"] == [first, second]
    assert engine.fields(during)["engine_pauses"] == [first, second]
    assert engine.fields(after)["engine_pauses"] == [second]
    assert "engine_pauses" not in engine.fields(engine.admit())


def test_only_the_rl_routes_with_their_method_are_observed() -> None:
    assert engine_route(_scope("/update_weight_version")) is not None
    assert engine_route(_scope("/update_weight_version/")) is not None
    assert engine_route(_scope("/weight_info", "GET")) is not None
    assert engine_route(_scope("/weight_info", "POST")) is None
    assert engine_route(_scope("/update_weight_version", "GET")) is None
    for path in ("/v1/chat/completions", "/v1/models", "/health", "/"):
        assert engine_route(_scope(path)) is None


class _RlServer:
    """An ASGI app answering one RL route as the engine does: ``status`` and ``answer``; records the
    engine state seen when its last answer message is sent (through the observer's ``send``)."""

    def __init__(self, status: int, answer: dict[str, Any], chunks: int = 2) -> None:
        self.status, self.answer, self.chunks = status, answer, chunks
        self.request: bytes = b""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        self.request = message.get("body", b"")
        body = json.dumps(self.answer).encode()
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        cut = len(body) // 2
        await send({"type": "http.response.body", "body": body[:cut], "more_body": True})
        await send({"type": "http.response.body", "body": body[cut:], "more_body": False})


def _call_route(
    engine: EngineWeights, app: _RlServer, path: str, body: dict[str, Any] | None, query: bytes = b""
) -> list[str | None]:
    """Pass one request through the observer; the engine version each answer message left with."""
    seen: list[str | None] = []
    scope = _scope(path, query=query)
    route = engine_route(scope)
    assert route is not None
    payload = json.dumps(body).encode() if body is not None else b""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": payload, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            seen.append(engine.version)

    asyncio.run(engine.observe(route, app, scope, receive, send))
    return seen


def test_vllm_update_weight_version_is_applied_before_the_trainer_gets_its_answer() -> None:
    engine = EngineWeights()
    engine.set("1", "engine_info")
    server = _RlServer(200, {"success": True, "new_version": "2"})
    seen = _call_route(engine, server, "/update_weight_version", {"new_version": "2"})
    assert seen == ["1", "2"]  # the last message left after the change
    assert (engine.version, engine.source) == ("2", "engine_update")


def test_vllm_finish_weight_update_sets_the_version_its_request_named() -> None:
    engine = EngineWeights()
    _call_route(engine, _RlServer(200, {"message": "Weight update finished"}), "/finish_weight_update", {})
    assert engine.version is None  # finished without a version: the engine's is unchanged
    server = _RlServer(200, {"message": "Weight update finished"})
    _call_route(engine, server, "/finish_weight_update", {"weight_version": "step-3"})
    assert engine.version == "step-3"


def test_sglang_updates_set_the_version_only_when_they_succeed() -> None:
    engine = EngineWeights()
    engine.set("a", "engine_info")
    failed = _RlServer(400, {"success": False, "message": "bad path", "num_paused_requests": 0})
    _call_route(engine, failed, "/update_weights_from_disk", {"model_path": "/x", "weight_version": "b"})
    assert engine.version == "a"
    for route, version in (
        ("/update_weights_from_disk", "b"),
        ("/update_weights_from_tensor", "c"),
        ("/update_weights_from_distributed", "d"),
    ):
        ok = _RlServer(200, {"success": True, "message": f"Succeeded. Weight version updated to {version}."})
        _call_route(engine, ok, route, {"weight_version": version})
        assert engine.version == version
    sglang_answer = {"success": True, "message": "Weight version updated to e", "new_version": "e"}
    _call_route(engine, _RlServer(200, sglang_answer), "/update_weight_version", {"new_version": "e"})
    assert engine.version == "e"


def test_pause_and_resume_routes_of_both_engines_open_and_close_a_pause() -> None:
    engine = EngineWeights()
    admitted = engine.admit()
    _call_route(engine, _RlServer(200, {"status": "paused"}), "/pause", None, query=b"mode=keep")
    _call_route(engine, _RlServer(200, {"status": "resumed"}), "/resume", None)
    ok = {"message": "Generation paused successfully.", "status": "ok"}
    _call_route(engine, _RlServer(200, ok), "/pause_generation", None)
    _call_route(engine, _RlServer(500, {"error": "x"}), "/continue_generation", None)  # failed: still paused
    pauses = engine.fields(admitted)["engine_pauses"]
    assert [p["mode"] for p in pauses] == ["keep", None]
    assert pauses[0]["resumed_at"] is not None and pauses[1]["resumed_at"] is None
    _call_route(engine, _RlServer(200, {"status": "paused"}), "/pause", None)
    pauses = engine.fields(admitted)["engine_pauses"]  # paused again without a resume: the same pause
    assert len(pauses) == 2 and pauses[-1]["mode"] == "abort"  # vLLM's default mode, the latest asked


class _InfoServer:
    """Answers ``GET <path>`` with ``{"weight_version": version}`` (404 elsewhere), counting requests."""

    def __init__(self, path: str, version: str) -> None:
        self.path, self.version, self.requests = path, version, []  # type: ignore[var-annotated]
        self.release = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.requests.append((scope["method"], scope["path"]))
        await receive()
        status, body = (200, json.dumps({"weight_version": self.version}).encode())
        if scope["path"] != self.path:
            status, body = 404, b'{"detail": "Not Found"}'
        else:
            await self.release.wait()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})


def test_the_info_route_is_asked_once_for_a_batch_of_calls_admitted_together() -> None:
    async def scenario() -> None:
        engine = EngineWeights(ask_info=True)
        server = _InfoServer("/weight_info", "v1")
        batch = [
            asyncio.ensure_future(engine.ready(server, _scope("/v1/chat/completions"))) for _ in range(5)
        ]
        await asyncio.sleep(0)
        server.release.set()
        await asyncio.gather(*batch)
        assert server.requests == [("GET", "/weight_info")]
        assert (engine.version, engine.source) == ("v1", "engine_info")
        server.version = "v2"
        await engine.ready(server, _scope("/v1/chat/completions"))  # the next batch asks again
        assert len(server.requests) == 2 and engine.version == "v2"

    asyncio.run(scenario())


def test_sglang_s_info_route_is_asked_when_vllm_s_is_not_there() -> None:
    async def scenario() -> None:
        engine = EngineWeights(ask_info=True)
        server = _InfoServer("/get_weight_version", "s1")
        server.release.set()
        await engine.ready(server, _scope("/v1/chat/completions"))
        await engine.ready(server, _scope("/v1/chat/completions"))
        assert engine.version == "s1"
        assert server.requests == [
            ("GET", "/weight_info"),
            ("GET", "/get_weight_version"),
            ("GET", "/get_weight_version"),
        ]

    asyncio.run(scenario())


def test_inside_vllm_the_version_is_read_once_from_its_engine_client_without_asking_a_route() -> None:
    reads: list[int] = []

    async def get_weight_version() -> str:
        reads.append(1)
        return "default"

    app = SimpleNamespace(
        state=SimpleNamespace(engine_client=SimpleNamespace(get_weight_version=get_weight_version))
    )

    async def scenario() -> None:
        engine = EngineWeights()
        for _ in range(3):
            await engine.ready(app, _scope("/v1/completions", app=app))  # type: ignore[arg-type]
        assert (engine.version, engine.source) == ("default", "engine_info")

    asyncio.run(scenario())
    assert reads == [1]
