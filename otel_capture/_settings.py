"""Every ``OTEL_*`` and ``OTEL_CAPTURE_*`` variable the package reads is read here, once, when a settings
object is built (never at import time); everything else takes the plain objects.

- :class:`CaptureSettings`: what the middleware captures and puts on spans;
- :class:`WriterSettings`: where and how the ``model_call_jsonl`` exporter writes records;
- :class:`CorrelationSettings`: whether the agent-side helpers correlate;
- :class:`ProxySettings`: the capture proxy's upstream timeout, request-size limit, shutdown bound and the
  headers it never puts on spans;
- :func:`upstream_from_environ`, :func:`cache_dir`: the proxy's upstream (for ``--workers``) and the cache.

Precedence: constructor argument, then our variable, then the standard ``OTEL_*`` variable, then the
default. An empty variable counts as unset (as the OpenTelemetry SDK treats it). A bad value is logged with
its name and replaced by the default (it does not fall through to the next variable: a typo should not
silently pick up some other setting), except where a default would silently change what the capture does:
the API key's rollout pattern (no default would record nothing) and a value that goes into a request head
(the upstream's key: one with CR/LF would add a header upstream, one outside latin-1 fail every call). Those
raise :class:`~otel_capture._errors.ConfigurationError` naming the variable, so the proxy never starts with
them. Tests pass ``environ=`` instead of patching ``os.environ``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import unquote

from ._errors import ConfigurationError
from ._key_pattern import ApiKeyRolloutPattern
from ._notices import notify

_logger = logging.getLogger(__name__)

# ours
ENV_CAPTURE_DIR = "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR"
ENV_MAX_BODY_BYTES = "OTEL_CAPTURE_MAX_BODY_BYTES"
ENV_KEEP_RAW_STREAM = "OTEL_CAPTURE_KEEP_RAW_STREAM"
ENV_SYNC = "OTEL_CAPTURE_SYNC"
ENV_CAPTURE_CONTENT = "OTEL_CAPTURE_MESSAGE_CONTENT"
ENV_CONTENT_MAX_LENGTH = "OTEL_CAPTURE_CONTENT_MAX_LENGTH"
ENV_CORRELATION = "OTEL_CAPTURE_CORRELATION"
ENV_UPSTREAM = "OTEL_CAPTURE_UPSTREAM"
ENV_CACHE = "OTEL_CAPTURE_CACHE"
ENV_DURABLE_TIMEOUT = "OTEL_CAPTURE_DURABLE_TIMEOUT_S"
ENV_ALLOW_SHARED_DIR = "OTEL_CAPTURE_ALLOW_SHARED_DIR"
ENV_UPSTREAM_TIMEOUT = "OTEL_CAPTURE_UPSTREAM_TIMEOUT"
ENV_MAX_REQUEST_BYTES = "OTEL_CAPTURE_MAX_REQUEST_BYTES"
ENV_SHUTDOWN_TIMEOUT = "OTEL_CAPTURE_SHUTDOWN_TIMEOUT"
ENV_MAX_CONCURRENT_CALLS = "OTEL_CAPTURE_MAX_CONCURRENT_CALLS"
ENV_LOCK_TIMEOUT = "OTEL_CAPTURE_LOCK_TIMEOUT_S"
ENV_API_KEY_ROLLOUT_PATTERN = "OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN"
ENV_SESSION_ID_AS_ROLLOUT = "OTEL_CAPTURE_SESSION_ID_AS_ROLLOUT"
ENV_UPSTREAM_API_KEY = "OTEL_CAPTURE_UPSTREAM_API_KEY"
# standard
ENV_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
JSONL_EXPORTER = "model_call_jsonl"  # the records' exporter, by its entry-point name
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
ENV_GENAI_CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
ENV_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT = "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT"
ENV_ATTRIBUTE_VALUE_LENGTH_LIMIT = "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"
ENV_SANITIZE_HEADERS = "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS"
ENV_CAPTURE_REQUEST_HEADERS = "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST"
ENV_CAPTURE_RESPONSE_HEADERS = "OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_RESPONSE"

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_CONTENT_MAX_LENGTH = 16 * 1024
DEFAULT_DURABLE_TIMEOUT_S = 120.0  # a sync that takes longer is a hung disk: answer the call, mark it failed
DEFAULT_UPSTREAM_TIMEOUT = 600.0  # seconds without a byte from the upstream: model calls are long
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024  # long contexts with several images fit
# Calls the proxy forwards at once; beyond it a 503 with Retry-After. Each holds what its client has been
# sent so far for the record (up to twice max_body_bytes: raw and reassembled): this bounds the sum.
DEFAULT_MAX_CONCURRENT_CALLS = 1024
DEFAULT_SHUTDOWN_TIMEOUT = 25  # inside the 30 s an orchestrator (Kubernetes) waits before SIGKILL
DEFAULT_LOCK_TIMEOUT_S = 30.0  # a data file's flock is held for one append: longer is a stuck process
# Headers that carry credentials: the proxy never puts their values on spans, whatever
# OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST/_RESPONSE ask for (patterns, matched anywhere
# in the name, case-insensitively, as the instrumentation matches its sanitize list).
SECRET_HEADERS: tuple[str, ...] = (
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
    "cookie",
    "set-cookie",
)

ContentCapture = Literal["no_content", "span_only", "event_only", "span_and_event"]
CONTENT_CAPTURE_MODES: tuple[ContentCapture, ...] = (
    "no_content",
    "span_only",
    "event_only",
    "span_and_event",
)

_T = TypeVar("_T")
SyncMode = Literal["auto", "fsync"]
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True, slots=True)
class CaptureSettings:
    """What the capture middleware keeps of each call and puts on its span."""

    service_name: str | None = None
    """The model server's name, written as the record's ``model_ref.name``."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Cap on each raw body kept in memory and on disk; longer bodies are cut and flagged ``truncated``."""
    keep_raw_stream: bool = False
    """Keep the raw SSE text (``response_raw``) for clean streams too, not only for partial ones."""
    capture_content: ContentCapture = "no_content"
    """Message content on spans (the GenAI semconv opt-in attributes): ``span_only`` and
    ``span_and_event`` put it on spans; ``no_content`` and ``event_only`` do not (no events are emitted)."""
    content_max_length: int = DEFAULT_CONTENT_MAX_LENGTH
    """Longest JSON text of one content attribute, in characters; longer ones are cut string by string,
    so the JSON stays valid. Never above the SDK's attribute length limit, which would cut the JSON."""
    durable_timeout_s: float = DEFAULT_DURABLE_TIMEOUT_S
    """Longest wait for a call's record to be durable before its terminal chunk is released anyway and its
    capture marked failed (contract D6)."""
    records_expected: bool = False
    """``OTEL_TRACES_EXPORTER`` names ``model_call_jsonl``: a middleware that finds no records' exporter
    on its tracer provider when a call comes says so (once) instead of recording nothing in silence."""
    api_key_rollout_pattern: ApiKeyRolloutPattern | None = None
    """Read the rollout id from the API key (off by default): a regular expression with a named group
    ``rollout`` that the whole ``Authorization: Bearer`` token, else the ``x-api-key`` value, must match;
    the group is the rollout id (only it is written anywhere, never the key). After the URL prefix and
    ``x-rollout-id``, before the session id and baggage (``docs/gateways.md``). Given as text (or an
    ``re.Pattern``), matched by RE2 in linear time; a pattern RE2 cannot compile, without the group, or
    whose group could be the whole key (no fixed text such as ``rk-`` outside it) raises
    :class:`~otel_capture._errors.ConfigurationError`. ``OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN``."""
    session_id_as_rollout: bool = False
    """Read the rollout id from the ``x-session-id`` header (off by default), after the API key, before
    baggage. ``OTEL_CAPTURE_SESSION_ID_AS_ROLLOUT``."""
    upstream_api_key: str | None = field(default=None, repr=False)
    """What goes on in place of a key that matched :attr:`api_key_rollout_pattern` (the same header:
    ``Authorization: Bearer <it>`` or ``x-api-key: <it>``); ``None``: the key as sent.
    ``OTEL_CAPTURE_UPSTREAM_API_KEY``. Never shown in a repr, a log or an error. A header value: one with a
    control character (CR, LF, NUL...) or a character outside latin-1 raises
    :class:`~otel_capture._errors.ConfigurationError`."""

    @property
    def content_on_spans(self) -> bool:
        return self.capture_content in ("span_only", "span_and_event")

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        service_name: str | None = None,
        max_body_bytes: int | None = None,
        keep_raw_stream: bool | None = None,
        capture_content: ContentCapture | bool | None = None,
        content_max_length: int | None = None,
        durable_timeout_s: float | None = None,
        api_key_rollout_pattern: str | re.Pattern[str] | None = None,
        session_id_as_rollout: bool | None = None,
        upstream_api_key: str | None = None,
    ) -> CaptureSettings:
        env = os.environ if environ is None else environ
        given_pattern = (
            None
            if api_key_rollout_pattern is None
            else key_rollout_pattern(api_key_rollout_pattern, "api_key_rollout_pattern")
        )
        if isinstance(capture_content, bool):
            capture_content = "span_only" if capture_content else "no_content"
        sdk_limit = _pick(
            None,
            env,
            (ENV_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, ENV_ATTRIBUTE_VALUE_LENGTH_LIMIT),
            _positive_int,
            None,
        )
        content_length = _pick(
            content_max_length, env, (ENV_CONTENT_MAX_LENGTH,), _positive_int, DEFAULT_CONTENT_MAX_LENGTH
        )
        if sdk_limit is not None and content_length > sdk_limit:
            content_length = sdk_limit  # the SDK would cut the JSON text in the middle
        return cls(
            service_name=_pick(
                service_name, env, (ENV_SERVICE_NAME, ENV_RESOURCE_ATTRIBUTES), _service_name, None
            ),
            max_body_bytes=_pick(
                max_body_bytes, env, (ENV_MAX_BODY_BYTES,), _positive_int, DEFAULT_MAX_BODY_BYTES
            ),
            keep_raw_stream=_pick(keep_raw_stream, env, (ENV_KEEP_RAW_STREAM,), _bool, False),
            capture_content=_pick(
                capture_content,
                env,
                (ENV_CAPTURE_CONTENT, ENV_GENAI_CAPTURE_CONTENT),
                _content_mode,
                "no_content",
            ),
            content_max_length=content_length,
            durable_timeout_s=_pick(
                durable_timeout_s, env, (ENV_DURABLE_TIMEOUT,), _seconds, DEFAULT_DURABLE_TIMEOUT_S
            ),
            records_expected=JSONL_EXPORTER
            in (n.strip() for n in env.get(ENV_TRACES_EXPORTER, "").split(",")),
            api_key_rollout_pattern=_pick(
                given_pattern, env, (ENV_API_KEY_ROLLOUT_PATTERN,), _rollout_pattern, None
            ),
            session_id_as_rollout=_pick(
                session_id_as_rollout, env, (ENV_SESSION_ID_AS_ROLLOUT,), _bool, False
            ),
            upstream_api_key=_pick(upstream_api_key, env, (ENV_UPSTREAM_API_KEY,), _header_value, None),
        )

    def __post_init__(self) -> None:
        # CaptureSettings(api_key_rollout_pattern="..." or re.compile(...)): compiled and checked as text is
        pattern: object = self.api_key_rollout_pattern
        if pattern is not None:
            object.__setattr__(
                self, "api_key_rollout_pattern", key_rollout_pattern(pattern, "api_key_rollout_pattern")
            )
        if self.upstream_api_key is not None:
            header_value("upstream_api_key", self.upstream_api_key)


def key_rollout_pattern(pattern: object, name: str) -> ApiKeyRolloutPattern:
    """``pattern`` (text, an ``re.Pattern`` or an already checked one) compiled for RE2 and checked
    (:class:`~otel_capture._correlation.ids.ApiKeyRolloutPattern`); else ``ConfigurationError`` naming
    ``name``, the variable or argument it came from."""

    if isinstance(pattern, ApiKeyRolloutPattern):
        return pattern
    if not isinstance(pattern, (str, re.Pattern)):
        raise ConfigurationError(name, f"a regular expression as text, not {type(pattern).__name__}")
    try:
        return ApiKeyRolloutPattern.compile(pattern)
    except ValueError as exc:
        shown = pattern if isinstance(pattern, str) else pattern.pattern
        raise ConfigurationError(name, f"{shown!r} refused: {exc}") from None


def header_value(name: str, value: str) -> str:
    """``value`` if it can go into an HTTP head as sent: latin-1 (what HTTP/1.1 carries; the proxy writes
    its heads as latin-1 bytes), and no control character but a tab (CR or LF would end the header
    and start another, NUL is refused by servers). Else ``ConfigurationError`` naming ``name``, never
    quoting the value (it is often a credential): only the position and code point of the first bad one."""
    for position, char in enumerate(value):
        code = ord(char)
        if code > 0xFF:
            reason = "outside latin-1, which an HTTP header cannot carry"
        elif (code < 0x20 and char != "\t") or code == 0x7F:
            reason = "a control character, which a header must not carry (CR or LF would start another)"
        else:
            continue
        raise ConfigurationError(
            name,
            f"character {position + 1} of the value (U+{code:04X}) is {reason}; "
            "it goes into a request header",
        )
    return value


@dataclass(frozen=True, slots=True)
class WriterSettings:
    """Where and how the ``model_call_jsonl`` exporter makes records durable."""

    directory: Path | None = None
    """Where records go; ``None`` means no records (the exporter logs it once)."""
    sync: SyncMode = "auto"
    """How a batch of lines is made durable: ``auto`` (chosen by the capture directory's filesystem) or
    ``fsync`` (always one per file: for a local filesystem shared with heavy unrelated writers, which
    ``syncfs`` would also flush) (contract D4). ``OTEL_CAPTURE_SYNC``."""
    allow_shared_directory: bool = False
    """Write into a world-writable directory, or one owned by another user (refused by default: others
    could plant links or FIFOs in it) (contract D26). ``OTEL_CAPTURE_ALLOW_SHARED_DIR``."""
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    """Longest wait for a file lock (a data file's ``flock``, which NeMo Gym's writers also take, or a
    rollout's stripe lock): a process that holds one longer fails that rollout's batch, never the writer
    (contract D21, D22). ``OTEL_CAPTURE_LOCK_TIMEOUT_S``."""

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        directory: str | os.PathLike[str] | None = None,
        sync: SyncMode | None = None,
        allow_shared_directory: bool | None = None,
        lock_timeout_s: float | None = None,
    ) -> WriterSettings:
        env = os.environ if environ is None else environ
        given = _to_path(os.fspath(directory)) if directory is not None else None
        return cls(
            directory=_pick(given, env, (ENV_CAPTURE_DIR,), _path, None),
            sync=_pick(sync, env, (ENV_SYNC,), _sync_mode, "auto"),
            allow_shared_directory=_pick(allow_shared_directory, env, (ENV_ALLOW_SHARED_DIR,), _bool, False),
            lock_timeout_s=_pick(
                lock_timeout_s, env, (ENV_LOCK_TIMEOUT,), _positive_float, DEFAULT_LOCK_TIMEOUT_S
            ),
        )


def allow_shared_dir_from_environ(environ: Mapping[str, str] | None = None) -> bool:
    """``OTEL_CAPTURE_ALLOW_SHARED_DIR``: the default of ``CaptureStore(allow_shared_directory=)``."""
    return _pick(None, os.environ if environ is None else environ, (ENV_ALLOW_SHARED_DIR,), _bool, False)


def lock_timeout_from_environ(environ: Mapping[str, str] | None = None) -> float:
    """``OTEL_CAPTURE_LOCK_TIMEOUT_S``: the default of ``CaptureStore(lock_timeout_s=)``."""
    env = os.environ if environ is None else environ
    return _pick(None, env, (ENV_LOCK_TIMEOUT,), _positive_float, DEFAULT_LOCK_TIMEOUT_S)


@dataclass(frozen=True, slots=True)
class CorrelationSettings:
    """Whether agent-side correlation is on (the gate of the gated helpers in ``_agent``)."""

    enabled: bool = False

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, *, enabled: bool | None = None
    ) -> CorrelationSettings:
        """``enabled`` if given; else ``OTEL_CAPTURE_CORRELATION`` if set to a boolean; else whether
        ``OTEL_EXPORTER_MODEL_CALL_JSONL_DIR`` is set (non-empty). A value that is not a boolean is logged
        with its name and ignored."""
        if enabled is not None:
            return cls(enabled=enabled)
        env = os.environ if environ is None else environ
        raw = env.get(ENV_CORRELATION)
        if raw is not None and raw.strip():
            try:
                return cls(enabled=_bool(ENV_CORRELATION, raw))
            except ValueError:
                notify(
                    _logger,
                    logging.WARNING,
                    "ignoring %s=%r (must be true or false); deciding by %s",
                    ENV_CORRELATION,
                    raw,
                    ENV_CAPTURE_DIR,
                )
        return cls(enabled=bool(env.get(ENV_CAPTURE_DIR, "").strip()))


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """How the capture proxy treats its upstream and its clients."""

    upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT
    """Seconds the proxy waits for the upstream's next byte (its headers, or the next chunk of a body),
    and to send it a request, before it gives up: ``504`` before the headers, a cut stream after."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body the proxy accepts; a larger one is answered ``413`` while it is read, so it
    never sits in memory. The captured copy has its own cap, :attr:`CaptureSettings.max_body_bytes`."""
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT
    """Seconds SIGTERM/SIGINT wait for in-flight calls; then they are cancelled (recorded ``cancelled``)."""
    max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS
    """Calls forwarded at once; one more is answered ``503`` with ``Retry-After`` (and recorded, when it is
    a captured model call, with that status): the proxy's memory is bounded by calls times what each holds."""
    sanitize_headers: tuple[str, ...] = SECRET_HEADERS
    """Header name patterns whose values the HTTP server span shows as ``[REDACTED]``: always
    :data:`SECRET_HEADERS`, plus ``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS``."""
    capture_request_headers: tuple[str, ...] = ()
    """Request header name patterns (full match, any case) put on the HTTP server span:
    ``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_REQUEST``."""
    capture_response_headers: tuple[str, ...] = ()
    """Response header name patterns put on the HTTP server span:
    ``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SERVER_RESPONSE``."""

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        upstream_timeout: float | None = None,
        max_request_bytes: int | None = None,
        shutdown_timeout: int | None = None,
        max_concurrent_calls: int | None = None,
    ) -> ProxySettings:
        env = os.environ if environ is None else environ
        headers = HeaderCaptureSettings.from_environ(env)
        return cls(
            upstream_timeout=_pick(
                upstream_timeout, env, (ENV_UPSTREAM_TIMEOUT,), _positive_float, DEFAULT_UPSTREAM_TIMEOUT
            ),
            max_request_bytes=_pick(
                max_request_bytes, env, (ENV_MAX_REQUEST_BYTES,), _positive_int, DEFAULT_MAX_REQUEST_BYTES
            ),
            shutdown_timeout=_pick(
                shutdown_timeout, env, (ENV_SHUTDOWN_TIMEOUT,), _positive_int, DEFAULT_SHUTDOWN_TIMEOUT
            ),
            max_concurrent_calls=_pick(
                max_concurrent_calls,
                env,
                (ENV_MAX_CONCURRENT_CALLS,),
                _positive_int,
                DEFAULT_MAX_CONCURRENT_CALLS,
            ),
            sanitize_headers=headers.sanitize_headers,
            capture_request_headers=headers.capture_request_headers,
            capture_response_headers=headers.capture_response_headers,
        )


@dataclass(frozen=True, slots=True)
class HeaderCaptureSettings:
    """The headers an HTTP server span shows (zero-code's; the proxy's come in :class:`ProxySettings`), as
    the instrumentation's ``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*`` variables ask; credential
    headers (:data:`SECRET_HEADERS`) always read ``[REDACTED]``."""

    capture_request_headers: tuple[str, ...] = ()
    capture_response_headers: tuple[str, ...] = ()
    sanitize_headers: tuple[str, ...] = SECRET_HEADERS

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> HeaderCaptureSettings:
        env = os.environ if environ is None else environ
        extra = _names(env.get(ENV_SANITIZE_HEADERS, ""))
        return cls(
            capture_request_headers=_names(env.get(ENV_CAPTURE_REQUEST_HEADERS, "")),
            capture_response_headers=_names(env.get(ENV_CAPTURE_RESPONSE_HEADERS, "")),
            sanitize_headers=SECRET_HEADERS + tuple(f for f in extra if f.lower() not in SECRET_HEADERS),
        )


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated list of header names or patterns, blanks dropped."""
    return tuple(f.strip() for f in value.split(",") if f.strip())


def upstream_from_environ(environ: Mapping[str, str] | None = None) -> str:
    """The proxy's upstream for ``uvicorn --factory`` workers: ``OTEL_CAPTURE_UPSTREAM``."""
    env = os.environ if environ is None else environ
    upstream = env.get(ENV_UPSTREAM, "").strip()
    if not upstream:
        raise RuntimeError(f"{ENV_UPSTREAM} is not set: it names the model server to forward to")
    return upstream_url(ENV_UPSTREAM, upstream)


def upstream_url(name: str, url: str) -> str:
    """``url`` if its parts can go into the heads the proxy sends upstream (``Host``, the request line,
    ``Authorization: Basic`` from ``user:password@``); else ``ConfigurationError`` naming ``name`` (the
    variable or flag). A control character is refused anywhere (the URL parser would drop a CR or LF
    without a word, and forward to some other path); the user and password must be latin-1, as Basic
    auth sends them. Quotes no part of the value: the URL may carry a password."""
    from yarl import URL

    for position, char in enumerate(url):
        if ord(char) < 0x20 or ord(char) == 0x7F:
            raise ConfigurationError(
                name,
                f"character {position + 1} of the URL (U+{ord(char):04X}) is a control character, "
                "which would be dropped or sent in the request line",
            )
    try:
        parsed = URL(url)
    except ValueError as exc:
        raise ConfigurationError(name, f"not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigurationError(
            name, "the upstream must be an absolute http:// or https:// URL, such as http://127.0.0.1:8000"
        )
    for part in (parsed.user, parsed.password):
        if part is not None:
            header_value(name + " (its user or password, sent as Basic auth)", part)
    return url


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the demo's assembled model and the test backends live: ``$OTEL_CAPTURE_CACHE``, else
    ``~/.cache/otel-capture``."""
    env = os.environ if environ is None else environ
    configured = env.get(ENV_CACHE, "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "otel-capture"


def _pick(
    given: _T | None,
    env: Mapping[str, str],
    names: tuple[str, ...],
    parse: Callable[[str, str], _T | None],
    default: _T,
) -> _T:
    """The constructor value, else the first variable in ``names`` that is set and yields a value (the
    parser gets the variable's name too: ``OTEL_RESOURCE_ATTRIBUTES`` may simply not carry a service
    name, which is no error), else ``default``."""
    if given is not None:
        return given
    for name in names:
        raw = env.get(name)
        if raw is None or not raw.strip():
            continue
        try:
            value = parse(name, raw)
        except ConfigurationError:
            raise  # not replaceable by a default: refused, naming the variable
        except ValueError as exc:
            notify(
                _logger, logging.WARNING, "ignoring %s=%r (%s); using the default %r", name, raw, exc, default
            )
            return default
        if value is not None:
            return value
    return default


def _to_path(raw: str) -> Path:
    return Path(raw.strip()).expanduser().absolute()


def _path(_name: str, raw: str) -> Path:
    return _to_path(raw)


def _service_name(name: str, raw: str) -> str | None:
    if name != ENV_RESOURCE_ATTRIBUTES:
        return raw.strip()
    for member in raw.split(","):
        key, sep, value = member.partition("=")
        if sep and key.strip() == "service.name" and value.strip():
            return unquote(value.strip())
    return None


def _rollout_pattern(name: str, raw: str) -> ApiKeyRolloutPattern:
    return key_rollout_pattern(raw.strip(), name)


def _header_value(name: str, raw: str) -> str:
    return header_value(name, raw.strip())


def _positive_int(_name: str, raw: str) -> int:
    value = int(raw.strip())
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _positive_float(_name: str, raw: str) -> float:
    value = float(raw.strip())
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a positive number of seconds")
    return value


def _seconds(_name: str, raw: str) -> float:
    value = float(raw.strip())
    if not 0 < value < float("inf"):
        raise ValueError("must be a positive number of seconds")
    return value


def _bool(_name: str, raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("must be true or false")


def _sync_mode(_name: str, raw: str) -> SyncMode:
    lowered = raw.strip().lower()
    if lowered == "auto":
        return "auto"
    if lowered == "fsync":
        return "fsync"
    raise ValueError("must be auto or fsync")


def _content_mode(_name: str, raw: str) -> ContentCapture:
    """The values opentelemetry-util-genai takes (case-insensitive), plus ``true``/``false``: the legacy
    switch of the older GenAI instrumentations, which meant "record content"."""
    lowered = raw.strip().lower()
    for mode in CONTENT_CAPTURE_MODES:
        if lowered == mode:
            return mode
    if lowered in _TRUE:
        return "span_only"
    if lowered in _FALSE:
        return "no_content"
    raise ValueError("must be one of " + ", ".join(CONTENT_CAPTURE_MODES) + ", true or false")
