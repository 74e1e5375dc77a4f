"""One model call being captured: what arrives, what leaves, and what it becomes (a record line and
span attributes). No I/O here: the middleware feeds bytes in and takes dicts and bytes out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

import orjson

from .. import _attributes as A
from .._dialects import DIALECTS, Dialect
from .._dialects.deferred import StreamReassembly
from .._dialects.mismatch import token_mismatch
from .._dialects.missing import tokens_missing
from .._dialects.stream import close_cut_json, loads_nonstandard
from .._dialects.tokens import extract_tokens, with_request_prompt
from .._records import SCHEMA_VERSION, call_failed, encode_record_line, encode_tokens_line, tokens_line
from .._records.schema import REFUSED_OVER_CAPACITY
from .._settings import CaptureSettings
from .._telemetry import content_attributes, request_attributes, response_attributes
from .content_encoding import ResponseDecoding, decoding_for
from .weight import engine_weight_version

_logger = logging.getLogger(__name__)

_MODEL_REF_TYPE = "responses_api_models"  # the only type NeMo Gym's reader accepts

# Set in a captured call's scope by the app below the capture when it is the capture proxy (its forwarding,
# :mod:`otel_capture._proxy.app`): the upstream it forwards to (credentials removed), the upstream's
# ``x-request-id``, and a local answer's reason (a refusal for capacity). Read when the line is built.
SCOPE_UPSTREAM = "otel_capture.upstream"
SCOPE_UPSTREAM_REQUEST_ID = "otel_capture.upstream_request_id"
SCOPE_LOCAL_RESPONSE = "otel_capture.local_response"

# The record's ``writer``, one per (process, upstream): built once, not per call (os.getpid is a syscall);
# a forked child starts again with its own process id.
_WRITERS: dict[str | None, dict[str, Any]] = {}
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WRITERS.clear)


def writer_of(upstream: str | None) -> dict[str, Any]:
    """The record's ``writer``: this host and process, the capture layer (``proxy`` when there is an
    ``upstream``, else ``in_process``) and the upstream. The same dict for every call: never changed."""
    writer = _WRITERS.get(upstream)
    if writer is None:
        writer = {"host": socket.gethostname(), "pid": os.getpid()}
        if upstream is None:
            writer["layer"] = "in_process"
        else:
            writer["layer"] = "proxy"
            writer["upstream"] = upstream
        _WRITERS[upstream] = writer
    return writer


class _Body:
    """Raw bytes kept up to a cap; past it they are counted, not kept."""

    __slots__ = ("cap", "chunks", "size", "truncated")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - self.size
        if room <= 0:
            self.truncated = self.truncated or bool(chunk)
        elif len(chunk) > room:
            self.chunks.append(chunk[:room])
            self.truncated = True
        else:
            self.chunks.append(chunk)
        self.size += len(chunk)

    def bytes(self) -> bytes:
        return b"".join(self.chunks)


def parse_object(raw: bytes) -> dict[str, Any] | None:
    """A JSON object, or None for anything else (malformed, a list, a scalar, empty). A body with
    ``NaN`` or ``±Infinity`` (Python's JSON, e.g. a NaN log-prob) is read too (:func:`parse_body`)."""
    return parse_body(raw)[0]


def parse_body(raw: bytes) -> tuple[dict[str, Any] | None, bool]:
    """The JSON object in ``raw`` (:func:`parse_object`) and whether it is non-standard: read only with
    ``NaN`` or ``±Infinity``, which strict JSON refuses. Such a body cannot be embedded as sent (the line
    would not be JSON): it is written re-encoded, those values as ``null``, and a response's bytes as sent
    are kept in ``response_raw``. One parse says both: strict JSON read it, or it refused it and
    :func:`loads_nonstandard` (which reads nothing without those words) read it; no scan of the body for
    the words (about a microsecond a kilobyte each)."""
    if not raw:
        return None, False
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = loads_nonstandard(raw)
        if isinstance(value, dict):
            return value, True
        return None, False
    return (value, False) if isinstance(value, dict) else (None, False)


def _as_fragment(raw: bytes, parsed: dict[str, Any], is_nonstandard: bool) -> Any:
    """Embed the exact body bytes in the line (no re-serialisation, no int/float drift) when they are one
    line of strict JSON; else the parsed object. ``is_nonstandard``: :func:`parse_body`'s word on it."""
    if is_nonstandard or b"\n" in raw or b"\r" in raw:
        return parsed
    return orjson.Fragment(raw)


def classify_status(status: int | None) -> str | None:
    """NeMo Gym's HTTP status classes (its reader and health checks key on these names)."""
    if status is None or status < 400:
        return None
    if status in (408, 504):
        return "timeout"
    if status == 429:
        return "rate_limit"
    if status in (401, 403):
        return "auth"
    if status == 404:
        return "not_found"
    return "client_error" if status < 500 else "upstream_error"


# Classes of libraries the host app may use, looked up only once the library is imported (an exception of
# a library that was never imported cannot exist). httpx re-raises httpcore's as its own; aiohttp's timeout
# errors are ``asyncio.TimeoutError`` subclasses.
_LIBRARY_CLASSES: dict[str, tuple[tuple[str, str], ...]] = {
    "cancelled": (("trio", "Cancelled"),),
    "timeout": (("httpx", "TimeoutException"), ("httpcore", "TimeoutException")),
    # the peer went away: a refused or reset connection, or one closed in the middle of a message
    "connection": (
        ("httpx", "NetworkError"),
        ("httpx", "RemoteProtocolError"),
        ("httpcore", "NetworkError"),
        ("httpcore", "RemoteProtocolError"),
        ("aiohttp", "ClientConnectionError"),
    ),
}
_BUILTIN_CLASSES: dict[str, tuple[type[BaseException], ...]] = {
    "cancelled": (asyncio.CancelledError, concurrent.futures.CancelledError),
    "timeout": (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError),
    "connection": (ConnectionError,),
}


def _classes(category: str) -> tuple[type[BaseException], ...]:
    found = list(_BUILTIN_CLASSES[category])
    for module_name, class_name in _LIBRARY_CLASSES[category]:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def classify_exception(exc: BaseException) -> str:
    """The error category of an exception that ended a call, by its class and bases (never its name):
    ``cancelled``, ``timeout``, ``connection``, else ``exception``."""
    for category in ("cancelled", "timeout", "connection"):
        if isinstance(exc, _classes(category)):
            return category
    return "exception"


def _hundredths(ms: float) -> float:
    """``ms`` to 0.01 ms at a third of ``round(ms, 2)``'s cost (which formats the float in decimal). They
    differ only for a value within a rounding error of a half-hundredth (``0.005``): none in two million
    random times from 1 µs to 1,000 s."""
    return round(ms * 100) / 100


_NO_TOKENS: dict[str, Any] = {"prompt_token_ids": None, "generations": []}  # extract_tokens found none


def _token_checks(
    request: dict[str, Any] | None, response: dict[str, Any] | None, dialect: str
) -> tuple[str | None, str | None, dict[str, Any] | None]:
    """``(tokens_missing, token_mismatch, tokens)`` of an answer (``docs/tokens.md``), its tokens read
    once, for the checks and the tokens line: ``extract_tokens(response)``, :data:`_NO_TOKENS` when the
    answer carries none (so no tokens line either), ``None`` when they could not be read."""
    try:
        found = extract_tokens(response)
        if found is None:  # no tokens at all (most answers): nothing to mismatch, and not read twice more
            return tokens_missing(request, response, dialect, _NO_TOKENS), None, _NO_TOKENS
        return (
            tokens_missing(request, response, dialect, found),
            token_mismatch(request, response, dialect, found),
            found,
        )
    except Exception:  # capture never fails a call; a body this cannot read is a bug, logged
        _logger.debug("could not check the answer's tokens", exc_info=True)
        return None, None, None


class InFlightCall:
    """State of one captured call, from request receipt to its finished record."""

    def __init__(
        self,
        dialect: Dialect,
        rollout_id: str,
        settings: CaptureSettings,
        *,
        session_id: str | None = None,
        weight_version: str | None = None,
        scope: Mapping[str, Any] | None = None,
    ) -> None:
        # 128 random bits as 32 hex digits, like NeMo Gym's uuid4().hex; from `random` (reseeded after fork,
        # as the OpenTelemetry SDK's span ids are) because os.urandom is a ~10 us syscall per call here;
        # randbytes().hex() is getrandbits(128) as bytes, a third quicker than formatting the int
        self.model_call_id = random.randbytes(16).hex()
        self.dialect = dialect
        self._spec = DIALECTS[dialect]
        self.rollout_id = rollout_id
        self.settings = settings
        self.session_id = session_id
        self.weight_version = weight_version  # the caller's (x-weight-version or baggage), if it sent one
        self._scope = scope  # what the app below writes there for the record (SCOPE_UPSTREAM...)
        self.weight_fields: dict[str, Any] | None = None  # the engine's versions, sources: set at finish
        # One clock reading starts both the record's latency and the span (start_time_ns, end_time_ns): a
        # span's duration in a tracing backend is the record's latency_ms
        self.start_time_ns = time.time_ns()
        self.started_at = self.start_time_ns / 1e9
        self._t0 = time.perf_counter()
        self.end_time_ns: int | None = None
        self.request = _Body(settings.max_body_bytes)
        self.request_obj: dict[str, Any] | None = None
        self._request_nonstandard = False  # a body with NaN/Infinity: re-encoded in the line
        self.request_model: str | None = None  # the request's "model", once set_request has parsed it
        self.response = _Body(settings.max_body_bytes)
        self.status_code: int | None = None
        self.stream = False
        self._decoding: ResponseDecoding | None = None  # undoes a Content-Encoding, for the record only
        self._reassembly: StreamReassembly | None = None  # a stream's events -> the answer (.deferred)
        self.ttft_ms: float | None = None
        self._first_byte_ms: float | None = None
        self.error_category: str | None = None
        self.failure: dict[str, Any] | None = None
        self.completed_at: float | None = None
        self.latency_ms: float | None = None
        self.response_obj: dict[str, Any] | None = None
        self.tokens_missing: str | None = None  # why the tokens asked for are not all there (docs/tokens.md)
        self.token_mismatch: str | None = None  # which token invariant the answer breaks (docs/tokens.md)
        self._response_nonstandard = False  # a body with NaN/Infinity: re-encoded, its bytes kept raw
        self.engine_version: str | None = None  # the weight version the answer reports: set at finish
        # the answer's tokens as extract_tokens read them at finish (_NO_TOKENS: none, so no tokens line);
        # None: not read there (not an answer, or unreadable)
        self._tokens: dict[str, Any] | None = None

    # -- request ------------------------------------------------------------------------------------

    def set_request(self, raw: bytes) -> None:
        """The whole request body (the middleware reads it before the app does). Parsed in full even
        past the cap, for the span's request attributes; the record keeps at most the cap."""
        self.request.add(raw)
        self.request_obj, self._request_nonstandard = parse_body(raw)
        model = self.request_obj.get("model") if self.request_obj else None
        self.request_model = model if isinstance(model, str) else None

    # -- response -----------------------------------------------------------------------------------

    def on_response_start(self, status: int, content_type: str, content_encoding: str = "") -> None:
        self.status_code = status
        self._decoding = decoding_for(content_encoding) if content_encoding else None
        if content_type.lower().lstrip().startswith("text/event-stream"):
            self.stream = True
            # decoded and accumulated in batches after the first model output, bounded by the body cap
            self._reassembly = StreamReassembly(self._spec.accumulator, self.settings.max_body_bytes)

    def on_body(self, chunk: bytes) -> bool:
        """Take one response chunk; True once the dialect's terminal event has been seen."""
        reassembly = self._reassembly
        if not chunk:
            return reassembly is not None and reassembly.accumulator.terminal is not None
        if self._first_byte_ms is None or self.ttft_ms is None:
            now_ms = (time.perf_counter() - self._t0) * 1000
            if self._first_byte_ms is None:
                self._first_byte_ms = now_ms
        else:
            now_ms = 0.0  # both times are taken: the clock is not read again for every event
        if self._decoding is not None:
            # the client got the bytes as sent; the record keeps them decoded
            chunk = self._decoding.decode(chunk)
            self.response.truncated = self.response.truncated or self._decoding.failed
        response = self.response
        if response.size + len(chunk) <= response.cap:  # _Body.add when the chunk fits, inlined
            response.chunks.append(chunk)
            response.size += len(chunk)
        else:
            response.add(chunk)
        if reassembly is None:
            if self.ttft_ms is None:
                self.ttft_ms = now_ms
            return False
        if reassembly.feed(chunk) and self.ttft_ms is None:
            self.ttft_ms = now_ms
        return reassembly.accumulator.terminal is not None

    @property
    def stream_complete(self) -> bool:
        """The stream's last event has arrived: a completed, incomplete or failed terminal event (after an
        error event a server may still send more, e.g. chat's ``data: [DONE]``)."""
        terminal = self._reassembly.accumulator.terminal if self._reassembly is not None else None
        return terminal is not None and terminal != "error"

    # -- end ----------------------------------------------------------------------------------------

    def finish(self, *, exception: BaseException | None = None, cancelled: bool = False) -> None:
        """Close the call: timings, the reassembled response, the error category."""
        elapsed = time.perf_counter() - self._t0
        self.latency_ms = _hundredths(elapsed * 1000)
        self.end_time_ns = self.start_time_ns + int(elapsed * 1e9)
        self.completed_at = self.end_time_ns / 1e9
        if self.ttft_ms is None:
            self.ttft_ms = self._first_byte_ms
        category = classify_status(self.status_code)
        if self._reassembly is not None:
            accumulator = self._reassembly.close()
            if self._reassembly.truncated:  # an event cut at the cap, or output past it (contract D36)
                self.response.truncated = True
            self.response_obj = accumulator.result()
            terminal = accumulator.terminal
            if category is None and terminal in ("failed", "error"):
                category = "upstream_error"
            elif category is None and terminal == "incomplete":
                category = "incomplete"
            if terminal is None and category is None:
                category = "cancelled" if cancelled else "stream_truncated"
            if accumulator.error is not None:
                self.failure = {"error": accumulator.error}
        elif not self.response.truncated:
            self.response_obj, self._response_nonstandard = parse_body(self.response.bytes())
        elif self.response.size:  # over the cap: what it kept, its JSON closed at the cut (flagged truncated)
            self.response_obj = parse_object(close_cut_json(self.response.bytes()) or b"")
        if exception is not None:
            if self.status_code is None:
                self.status_code = 500  # what the server answers for an exception before the response start
            if cancelled:
                category = "cancelled"
            elif category != "stream_truncated":
                # A stream the exception cut before its terminal event stays `stream_truncated` (its
                # partial reconstruction is kept); the exception itself goes to `failure`.
                category = classify_exception(exception)
            self.failure = {"exception": type(exception).__name__, "message": str(exception)[:1000]}
        elif cancelled and category is None:
            category = "cancelled"
        if category is None and self.response.size and self.response_obj is None:
            category = "capture_parse_error"
        self.error_category = category
        if category in (None, "incomplete"):  # an answer: are the tokens it was asked for there?
            self.tokens_missing, self.token_mismatch, self._tokens = _token_checks(
                self.request_obj, self.response_obj, self.dialect
            )
        self.engine_version = engine_weight_version(self.response_obj)

    def release_bodies(self) -> None:
        """Once the line is built: a call waiting until its record is durable holds only its line, not
        the bodies and reassembly it was made from as well (200 cut streams at once: half the memory)."""
        self.request.chunks = []
        self.response.chunks = []
        self._reassembly = None
        self.request_obj = self.response_obj = None
        self._tokens = None

    def _request_kept(self) -> bool:
        return self.request_obj is not None and not self.request.truncated

    def _raw_response_needed(self) -> bool:
        if self.stream:
            partial = self.error_category is not None or self.response_obj is None or self.response.truncated
            return partial or self.settings.keep_raw_stream
        if self.response.size > 0 and (self.response_obj is None or self.response.truncated):
            return True
        return self._response_nonstandard  # its NaN are null in `response`: the bytes as sent are kept

    def line(self, trace_id: int, span_id: int) -> bytes:
        """The record as one NeMo Gym 0.7.0 line (its keys first, in its order; ours after): the values
        are decided here, the line is the codec's (:func:`otel_capture._records.codec.encode_record_line`)."""
        record: dict[str, Any] = {
            "model_call_id": self.model_call_id,
            "dialect": self.dialect,
            "model_ref": (
                {"type": _MODEL_REF_TYPE, "name": self.settings.service_name}
                if self.settings.service_name
                else None
            ),
            "started_at": self.started_at,
            "completed_at": self.completed_at,
            "latency_ms": self.latency_ms,
            "latency_ttft_ms": None if self.ttft_ms is None else _hundredths(self.ttft_ms),
            "status_code": self.status_code,
            "error_category": self.error_category,
            "request": self._request_value(),
            "response": self._response_value(),
        }
        if self.session_id:
            record["client_session_id"] = self.session_id
        if not self._request_kept() and self.request.size:
            record["request_raw"] = self.request.bytes().decode("utf-8", errors="replace")
        if self._raw_response_needed():
            record["response_raw"] = self.response.bytes().decode("utf-8", errors="replace")
        scope = self._scope or {}
        refused = scope.get(SCOPE_LOCAL_RESPONSE) == REFUSED_OVER_CAPACITY
        if refused:
            record["upstream_attempted"] = False
            record["response_source"] = "local"
            record["local_response_reason"] = REFUSED_OVER_CAPACITY
        record["schema_version"] = SCHEMA_VERSION
        record["rollout_id"] = self.rollout_id
        record["trace_id"] = format(trace_id, "032x")
        record["span_id"] = format(span_id, "016x")
        if refused:
            # answered by the proxy itself (a JSON 503): the call's `stream` is what the client asked for
            record["stream"] = bool(self.request_obj and self.request_obj.get("stream") is True)
        else:
            record["stream"] = self.stream
        record["stream_truncated"] = self.error_category in ("stream_truncated", "cancelled") and self.stream
        if self.request.truncated or self.response.truncated:
            # which body was cut shows in the record itself: its parsed form is null and its raw form is cut
            record["truncated"] = True
        if self.failure is not None:
            record["failure"] = self.failure
        if self.tokens_missing is not None:
            record["tokens_missing"] = self.tokens_missing
        if self.token_mismatch is not None:
            record["token_mismatch"] = self.token_mismatch
        record["writer"] = writer_of(scope.get(SCOPE_UPSTREAM))
        upstream_request_id = scope.get(SCOPE_UPSTREAM_REQUEST_ID)
        if upstream_request_id is not None:
            record["upstream_request_id"] = upstream_request_id
        if self.engine_version is not None:
            record["engine_weight_version"] = self.engine_version
        if self.weight_fields:
            record.update(self.weight_fields)
        if self.weight_version is not None:
            record["weight_version"] = self.weight_version
        return encode_record_line(record)

    def tokens_line(self) -> bytes | None:
        """The call's ``<id>.tokens.jsonl`` line (:func:`otel_capture._records.tokens_line`), or ``None``
        without token data; after :meth:`finish`, whose reading of the answer's tokens it reuses."""
        found = self._tokens
        if found is _NO_TOKENS:  # none in the answer; the request alone adds none
            return None
        if found is None or self.response_obj is None:  # not read at finish
            return tokens_line(
                self.response_obj,
                rollout_id=self.rollout_id,
                model_call_id=self.model_call_id,
                request=self.request_obj,
            )
        return encode_tokens_line(
            with_request_prompt(found, self.request_obj),
            self.response_obj,
            rollout_id=self.rollout_id,
            model_call_id=self.model_call_id,
        )

    def _request_value(self) -> Any:
        if self.request_obj is None or self.request.truncated:
            return None
        return _as_fragment(self.request.bytes(), self.request_obj, self._request_nonstandard)

    def _response_value(self) -> Any:
        if self.response_obj is None:
            return None
        if self.stream or self.response.truncated or self._response_nonstandard:
            return self.response_obj
        return _as_fragment(self.response.bytes(), self.response_obj, False)  # nonstandard: returned above

    # -- span ----------------------------------------------------------------------------------------

    def start_attributes(self) -> dict[str, Any]:
        """What samplers may use (set at span start): operation, provider, model, request parameters."""
        spec = self._spec
        attributes: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: spec.operation_name,
            A.GEN_AI_PROVIDER_NAME: spec.provider_name,
            A.ROLLOUT_ID: self.rollout_id,
            A.MODEL_CALL_ID: self.model_call_id,
        }
        if spec.openai_api_type is not None:
            attributes[A.OPENAI_API_TYPE] = spec.openai_api_type
        model = self.request_model
        if model:
            attributes[A.GEN_AI_REQUEST_MODEL] = model
        if self.session_id:
            attributes[A.GEN_AI_CONVERSATION_ID] = self.session_id
        attributes.update(request_attributes(self.request_obj))
        return attributes

    def end_attributes(self) -> dict[str, Any]:
        attributes: dict[str, Any] = {}
        if self.stream:
            attributes[A.GEN_AI_REQUEST_STREAM] = True
        elif not (self.request_obj and self.request_obj.get("stream") is True):
            attributes[A.GEN_AI_REQUEST_STREAM] = False
        if self.status_code is not None:
            attributes[A.HTTP_RESPONSE_STATUS_CODE] = self.status_code
        if self.stream and self.ttft_ms is not None:
            attributes[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = self.ttft_ms / 1000
        if self.response_obj is not None:
            attributes.update(response_attributes(self.response_obj, self.dialect))
        if self.stream and self.error_category in ("stream_truncated", "cancelled"):
            # a finish reason was expected but never came: the semconv's "error" in its place
            attributes.setdefault(A.GEN_AI_RESPONSE_FINISH_REASONS, ["error"])
        if self.error_category is not None:
            attributes[A.ERROR_TYPE] = self.error_category
        if self.tokens_missing is not None:
            attributes[A.MODEL_CALL_TOKENS_MISSING] = self.tokens_missing
        if self.token_mismatch is not None:
            attributes[A.MODEL_CALL_TOKEN_MISMATCH] = self.token_mismatch
        if self.engine_version is not None:
            attributes[A.ENGINE_WEIGHT_VERSION] = self.engine_version
        return attributes

    def content_attributes(self, max_length: int) -> dict[str, str]:
        """The opt-in message content (semconv JSON text, each at most ``max_length`` characters)."""
        return content_attributes(self.dialect, self.request_obj, self.response_obj, max_length)

    # -- metrics ------------------------------------------------------------------------------------

    @property
    def failed(self) -> bool:
        """Whether the call failed, by the records' definition (:func:`call_failed`); after :meth:`finish`."""
        status = self.response_obj.get("status") if self.response_obj is not None else None
        return call_failed(self.status_code, self.error_category, status if isinstance(status, str) else None)

    def server_timings(self, output_tokens: object = None) -> tuple[float | None, float | None, float | None]:
        """``(request duration, time to first token, time per output token)`` in seconds, for the
        ``gen_ai.server.*`` histograms. TTFT and TPOT only for streams that did not fail
        (a non-streamed body arrives all at once: its first byte says nothing about the first token);
        TPOT only with more than one output token (``output_tokens``, the span's
        ``gen_ai.usage.output_tokens``): ``(duration - ttft) / (output tokens - 1)``."""
        if self.latency_ms is None:
            return None, None, None
        duration = self.latency_ms / 1000
        if not self.stream or self.failed or self.ttft_ms is None:
            return duration, None, None
        ttft = self.ttft_ms / 1000
        if not isinstance(output_tokens, int) or output_tokens < 2:
            return duration, ttft, None
        return duration, ttft, max(duration - ttft, 0.0) / (output_tokens - 1)
