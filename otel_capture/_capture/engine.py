"""The weight version the engine holds, as this capture layer sees it (``docs/tokens.md``, "The engine's
weight version").

One :class:`EngineWeights` per capture middleware (so per app, or per proxy). It learns the engine's
version from what passes through the same app:

* the trainer's RL routes (:data:`ENGINE_ROUTES`), observed when they succeed: vLLM's
  ``/update_weight_version`` and ``/finish_weight_update`` with a ``weight_version``, SGLang's
  ``/update_weight_version`` and ``/update_weights_from_{disk,tensor,distributed,ipc}`` with a
  ``weight_version``, and both engines' pause and resume routes;
* the engine's own report: read once at start inside vLLM's API server (its engine client, no HTTP), and,
  when :attr:`~otel_capture.CaptureSettings.engine_weight_info` is on, its info route (``GET
  /weight_info``, else SGLang's ``/get_weight_version``) asked at most once per batch of calls.

A change is applied before the route's last answer byte goes back, so a call the trainer starts after its
update returned is admitted under the new version. Per call the cost is reading two counters at admission
(:meth:`EngineWeights.admit`); the rest happens only when something changed while the call ran
(:meth:`EngineWeights.fields`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs

import orjson

from .._asgi import ASGIApp, Message, Receive, Scope, Send
from .weight import usable_version

_logger = logging.getLogger(__name__)

RouteKind = Literal["update", "info", "pause", "resume"]
VersionSource = Literal["caller", "declared", "engine_update", "engine_info", "engine_answer"]
"""Where a version on a record came from: the caller's ``x-weight-version`` (or baggage), the version
declared for the directory, an update route seen passing through, the engine's own report (its engine
client at start, or its info route), the call's answer."""

_KEEP = 1024  # changes and pauses remembered: a call that outlives more sees the latest ones only
_MAX_OBSERVED_BYTES = 1 << 20  # an RL route's request or answer read for its version, at most


@dataclass(frozen=True, slots=True)
class EngineRoute:
    """An RL route: what it does, its HTTP method, and where its body names the version it sets."""

    kind: RouteKind
    method: str = "POST"
    request_key: str | None = None  # the request body's key naming the version it sets
    answer_key: str | None = None  # the answer's key naming it (read first)
    default_mode: str | None = None  # a pause's mode when the request names none


_SGLANG_UPDATE = EngineRoute("update", request_key="weight_version")
ENGINE_ROUTES: dict[str, EngineRoute] = {
    # vLLM 0.32.0 with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/rl/online/api_router.py); SGLang's
    # /update_weight_version has the same shapes (python/sglang/srt/entrypoints/http_server.py)
    "/update_weight_version": EngineRoute("update", request_key="new_version", answer_key="new_version"),
    "/finish_weight_update": EngineRoute("update", request_key="weight_version"),
    "/weight_info": EngineRoute("info", method="GET", answer_key="weight_version"),
    "/pause": EngineRoute("pause", default_mode="abort"),  # ?mode=abort|wait|keep
    "/resume": EngineRoute("resume"),
    # SGLang: the version is set only when the update succeeded; the answer says so in text only
    "/update_weights_from_disk": _SGLANG_UPDATE,
    "/update_weights_from_tensor": _SGLANG_UPDATE,
    "/update_weights_from_distributed": _SGLANG_UPDATE,
    "/update_weights_from_ipc": _SGLANG_UPDATE,
    "/get_weight_version": EngineRoute("info", method="GET", answer_key="weight_version"),
    "/get_model_info": EngineRoute("info", method="GET", answer_key="weight_version"),
    "/pause_generation": EngineRoute("pause"),
    "/continue_generation": EngineRoute("resume"),
}
INFO_PATHS = ("/weight_info", "/get_weight_version")  # asked, in this order, when the setting is on


def engine_route(scope: Scope) -> EngineRoute | None:
    """The RL route ``scope`` requests, or ``None`` (a dict lookup: every request that is not a model call
    passes here)."""
    path: str = scope.get("path", "")
    route = ENGINE_ROUTES.get(path if len(path) < 2 or path[-1] != "/" else path[:-1])
    if route is None or scope.get("method") != route.method:
        return None
    return route


@dataclass(slots=True)
class Pause:
    """One pause of the engine: between the successful answers of its pause and resume routes."""

    mode: str | None
    paused_at: float
    resumed_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "paused_at": self.paused_at, "resumed_at": self.resumed_at}


@dataclass(slots=True)  # not frozen: made per call, and a frozen one's __init__ costs more
class Admission:
    """What the engine held when a call was admitted: its version and where it came from, and the
    positions of the change and pause logs then."""

    version: str | None
    source: VersionSource | None
    changes: int
    pauses: int  # the first pause the call may have waited through (the open one, if paused then)


class EngineWeights:
    """The engine's weight version and pauses as this capture layer observed them (module docstring).
    Used from one event loop."""

    def __init__(self, *, ask_info: bool = False) -> None:
        self.version: str | None = None
        self.source: VersionSource | None = None
        self._ask_info = ask_info
        self._changes = 0  # changes applied so far; the log keeps the latest _KEEP
        self._log: deque[str] = deque(maxlen=_KEEP)  # the version set by each change
        self._pauses: deque[Pause] = deque(maxlen=_KEEP)
        self._pause_count = 0
        self._open: Pause | None = None
        self._started = False  # the in-process read at start was tried
        self._reading: asyncio.Future[None] | None = None  # the info read in flight: one per batch
        self._info_paths: tuple[str, ...] = INFO_PATHS

    # -- what the engine holds ----------------------------------------------------------------------

    def set(self, version: str, source: VersionSource) -> None:
        """The engine now holds ``version``. A first version is no change; the same one again neither."""
        if version == self.version:
            return
        if self.version is not None:
            self._changes += 1
            self._log.append(version)
        self.version, self.source = version, source

    def pause(self, mode: str | None, at: float | None = None) -> None:
        if self._open is not None:  # paused again without a resume: one pause, the latest mode
            self._open.mode = mode
            return
        self._open = Pause(mode, time.time() if at is None else at)
        self._pauses.append(self._open)
        self._pause_count += 1

    def resume(self, at: float | None = None) -> None:
        if self._open is not None:
            self._open.resumed_at = time.time() if at is None else at
            self._open = None

    # -- per call -----------------------------------------------------------------------------------

    @property
    def unready(self) -> bool:
        """Whether a call must await :meth:`ready` before its admission (the first, or every batch's)."""
        return self._ask_info or not self._started

    def admit(self) -> Admission:
        """The call admitted now: a snapshot, no allocation beyond it."""
        first_pause = self._pause_count - (self._open is not None)
        return Admission(self.version, self.source, self._changes, first_pause)

    def fields(self, admission: Admission, answered: str | None = None) -> dict[str, Any]:
        """The record's engine fields for a call admitted at ``admission`` and finishing now:
        ``engine_weight_version`` (at admission; else what the answer reported), and when the version
        changed while it ran ``engine_weight_version_at_end`` and ``engine_weight_versions`` (every version
        it saw, oldest first); ``engine_pauses`` (the pauses it waited through); the sources of both
        versions in ``weight_version_sources``."""
        if admission.version is None and answered is None and self._pause_count == admission.pauses:
            return {}  # the usual call: no version known, no pause waited through
        found: dict[str, Any] = {}
        sources: dict[str, str] = {}
        if admission.version is not None:
            found["engine_weight_version"] = admission.version
            sources["engine_weight_version"] = admission.source or "engine_info"
        elif answered is not None:
            found["engine_weight_version"] = answered
            sources["engine_weight_version"] = "engine_answer"
        changed = self._changes - admission.changes
        if changed and admission.version is not None:
            seen = list(self._log)[-min(changed, len(self._log)) :]
            found["engine_weight_version_at_end"] = self.version
            found["engine_weight_versions"] = [admission.version, *seen]
            sources["engine_weight_version_at_end"] = self.source or "engine_info"
        waited = self._pause_count - admission.pauses
        if waited > 0:
            found["engine_pauses"] = [
                p.as_dict() for p in list(self._pauses)[-min(waited, len(self._pauses)) :]
            ]
        if sources:
            found["weight_version_sources"] = sources
        return found

    # -- learning it --------------------------------------------------------------------------------

    async def observe(
        self, route: EngineRoute, app: ASGIApp, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Run ``app`` for an RL route, unchanged, and apply what it did when it succeeded, before its
        last answer message goes back."""
        request = bytearray()
        answer = bytearray()
        status = 0
        applied = False

        async def observed_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(request) < _MAX_OBSERVED_BYTES:
                request.extend(message.get("body", b""))
            return message

        async def observed_send(message: Message) -> None:
            nonlocal status, applied
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not applied:
                if len(answer) < _MAX_OBSERVED_BYTES:
                    answer.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    applied = True
                    if 200 <= status < 300:
                        self._apply(route, scope, bytes(request), bytes(answer))
            await send(message)

        await app(scope, observed_receive, observed_send)

    def _apply(self, route: EngineRoute, scope: Scope, request: bytes, answer: bytes) -> None:
        """Never raises: a body this cannot read changes nothing (logged at debug)."""
        try:
            if route.kind == "pause":
                self.pause(_pause_mode(route, scope, request))
            elif route.kind == "resume":
                self.resume()
            else:
                version = _version_in(answer, route.answer_key) or _version_in(request, route.request_key)
                if version is not None:
                    self.set(version, "engine_update" if route.kind == "update" else "engine_info")
        except Exception:
            _logger.debug("could not read %s's answer", scope.get("path"), exc_info=True)

    async def ready(self, app: ASGIApp, scope: Scope) -> None:
        """Before a call is admitted: the in-process read at start (once), and with ``ask_info`` the
        engine's info route, asked once for every call admitted while that one request is in flight."""
        if not self._started:
            self._started = True
            await self._read_in_process(scope)
        if not self._ask_info:
            return
        reading = self._reading
        if reading is None:
            reading = self._reading = asyncio.get_running_loop().create_future()
            try:
                await self._ask(app, scope)
            finally:
                self._reading = None
                reading.set_result(None)
        else:
            await asyncio.shield(reading)

    async def _read_in_process(self, scope: Scope) -> None:
        """Inside vLLM's API server: its engine client's ``get_weight_version()`` (what ``GET
        /weight_info`` answers, without the route being enabled)."""
        state = getattr(scope.get("app"), "state", None)
        client = getattr(state, "engine_client", None) if state is not None else None
        get = getattr(client, "get_weight_version", None)
        if get is None or self.version is not None:
            return
        try:
            version = usable_version(await get())
        except Exception:
            _logger.debug("could not read the engine's weight version at start", exc_info=True)
            return
        if version is not None and self.version is None:  # an update seen meanwhile is newer
            self.set(version, "engine_info")

    async def _ask(self, app: ASGIApp, scope: Scope) -> None:
        for path in self._info_paths:
            try:
                status, body = await _get(app, scope, path)
            except Exception:
                _logger.debug("asking the engine's %s failed", path, exc_info=True)
                return
            if status == 404 and len(self._info_paths) > 1:
                continue
            if 200 <= status < 300:
                self._info_paths = (path,)  # the engine's route, from now on
                version = _version_in(body, "weight_version")
                if version is not None:
                    self.set(version, "engine_info")
            return


def _version_in(body: bytes, key: str | None) -> str | None:
    if key is None or not body:
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    return usable_version(parsed.get(key))


def _pause_mode(route: EngineRoute, scope: Scope, request: bytes) -> str | None:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("mode"):
        mode: str = query["mode"][0][:32]
        return mode
    if request:
        try:
            parsed = orjson.loads(request)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("mode"), str):
            return str(parsed["mode"])[:32]
    return route.default_mode


async def _get(app: ASGIApp, scope: Scope, path: str) -> tuple[int, bytes]:
    """``GET path`` through ``app`` (what a call's ``scope`` reaches: the engine in-process, the upstream
    behind a proxy), with the call's credentials; its status and body."""
    headers = [
        (k, v) for k, v in scope.get("headers", ()) if k.lower() in (b"authorization", b"x-api-key", b"host")
    ]
    sub: Scope = {k: v for k, v in scope.items() if not k.startswith("otel_capture")}
    sub.update(
        method="GET",
        path=path,
        raw_path=path.encode("latin-1"),
        query_string=b"",
        root_path="",
        headers=[*headers, (b"accept", b"application/json")],
    )
    done = asyncio.Event()
    sent_body = False
    status = 0
    body = bytearray()

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()  # no client to leave: the request ends when the answer has
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            if len(body) < _MAX_OBSERVED_BYTES:
                body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(sub, receive, send)
    finally:
        done.set()
    return status, bytes(body)
