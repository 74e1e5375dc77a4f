"""BASELINE, NOT OURS: NeMo Gym 0.7.0's capture design, re-implemented for the benchmarks only.

What it reproduces (from NeMo Gym 0.7.0's ``nemo_gym/base_responses_api_model.py``, ``nemo_gym-0.7.0``
wheel on PyPI: ``CaptureStore``'s append, ``_CaptureMiddleware``, ``_parse_and_record``):

* a pure ASGI middleware; the ``/ng-rollout/<id>/`` prefix is matched with Gym's regex and stripped;
* the request body and the whole response body are buffered in memory;
* response chunks are forwarded as they come, except the terminal one (for JSON, the final
  ``more_body=False`` message), which is held;
* when the app is done, ``asyncio.to_thread`` (the default executor) runs ``_parse_and_record``: parse
  both bodies with orjson, build the exchange dict, ``orjson.dumps`` it, then ``open("ab")``,
  ``flock(LOCK_EX)``, ``write``, ``flush``, ``os.fsync``, ``LOCK_UN``: one fsync per call, in the request
  path; only then is the held terminal chunk released.

It is what the issue calls "the existing system's design": the per-call-fsync baseline. It handles JSON
(non-streaming) responses only, which is all the non-streaming benchmark sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

_ROLLOUT_PATH_RE = re.compile(
    r"^/ng-rollout/(?P<rollout_id>[^/]+)(?:/(?P<token_capture>training-token-capture))?(?P<rest>/.*)$"
)
_DIALECTS = {"/v1/responses": "responses", "/v1/chat/completions": "chat", "/v1/messages": "messages"}
_current_rollout: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollout_id", default=None)


class GymStore:
    """Gym's ``CaptureStore.append``: one open, lock, write, flush, fsync and close per line."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.records = 0
        self.fsyncs = 0

    def append(self, rollout_id: str, line: bytes) -> None:
        with (self.root / f"{rollout_id}.capture.jsonl").open("ab") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        self.records += 1  # threads of the default executor race here; a counter off by a few is fine
        self.fsyncs += 1

    def stats(self) -> dict[str, int]:
        """The benchmark's counters (one batch per record: nothing is grouped)."""
        return {"records": self.records, "fsyncs": self.fsyncs, "batches": self.records, "failures": 0}


class GymCaptureMiddleware:
    """The per-call-fsync baseline (see the module docstring)."""

    def __init__(self, app: Any, store: GymStore) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        match = _ROLLOUT_PATH_RE.match(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        rollout_id, rest = match["rollout_id"], match["rest"]
        scope = dict(scope, path=rest, raw_path=rest.encode())
        dialect = _DIALECTS.get(rest)
        token = _current_rollout.set(rollout_id)
        try:
            if dialect is None:
                await self.app(scope, receive, send)
                return
            await self._capture(scope, receive, send, rollout_id, dialect)
        finally:
            _current_rollout.reset(token)

    async def _capture(self, scope: Any, receive: Any, send: Any, rollout_id: str, dialect: str) -> None:
        started_at = time.time()
        t0 = time.perf_counter()
        request_body = bytearray()
        state: dict[str, Any] = {"status": None, "body": bytearray(), "ttft": None, "deferred": []}

        async def receive_wrapper() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                request_body.extend(message.get("body", b""))
            return message

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk and state["ttft"] is None:
                    state["ttft"] = (time.perf_counter() - t0) * 1000
                state["body"].extend(chunk)
                if not message.get("more_body", False):
                    state["deferred"].append(message)  # the terminal chunk waits for the fsync
                    return
            await send(message)

        error_category = None
        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except Exception:
            error_category = "exception"
            raise
        finally:
            latency_ms = round((time.perf_counter() - t0) * 1000, 2)
            # Gym logs, marks the rollout incomplete, never changes the response
            with contextlib.suppress(Exception):
                await asyncio.to_thread(
                    self._parse_and_record,
                    rollout_id,
                    dialect,
                    started_at,
                    latency_ms,
                    bytes(request_body),
                    state,
                    error_category,
                )
            for message in state["deferred"]:
                await send(message)

    def _parse_and_record(
        self,
        rollout_id: str,
        dialect: str,
        started_at: float,
        latency_ms: float,
        request_body: bytes,
        state: dict[str, Any],
        error_category: str | None,
    ) -> None:
        try:
            request = orjson.loads(request_body) if request_body else None
        except orjson.JSONDecodeError:
            request = None
        try:
            response = orjson.loads(bytes(state["body"])) if state["body"] else None
        except orjson.JSONDecodeError:
            response = None
        status = state["status"]
        if error_category is None and status is not None and status >= 400:
            error_category = "client_error" if status < 500 else "upstream_error"
        exchange = {
            "model_call_id": uuid.uuid4().hex,
            "dialect": dialect,
            "model_ref": {"type": "responses_api_models", "name": "bench"},
            "started_at": started_at,
            "completed_at": time.time(),
            "latency_ms": latency_ms,
            "latency_ttft_ms": None if state["ttft"] is None else round(state["ttft"], 2),
            "status_code": status,
            "error_category": error_category,
            "request": request,
            "response": response,
        }
        self.store.append(rollout_id, orjson.dumps(exchange) + b"\n")
