"""Where a request goes: :func:`correlate` (its rollout id from the URL prefix, the ``x-rollout-id`` header,
the API key or ``x-session-id`` when configured, or baggage; the route the app sees, its dialect, whether this layer captures it;
an id that breaks the grammar, never refused), and
the HTTP server span's name. Pure functions of the ASGI scope, shared by the capture middleware,
the lean server span and the proxy."""

from __future__ import annotations

import logging
import re
from typing import Any, NamedTuple
from urllib.parse import unquote

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from .. import _attributes as A
from .._asgi import Scope
from .._dialects import DIALECT_PATHS, Dialect
from .._notices import notify
from .._rollout_id import ROLLOUT_ID_RULE, is_valid_rollout_id
from .._settings import ENV_API_KEY_ROLLOUT_PATTERN
from .ids import (
    CAPTURED_HEADER,
    CAPTURED_VALUE,
    NO_RULES,
    ROLLOUT_ID_HEADER,
    ROLLOUT_PATH_PREFIX,
    SESSION_ID_HEADER,
    RolloutRules,
    match_api_key,
    rollout_id_from_baggage,
    rollout_id_from_header,
    split_rollout_prefix,
)

_logger = logging.getLogger(__name__)

SCOPE_CAPTURED = "otel_capture.captured"  # set on a scope a capture middleware captures: others pass it
SCOPE_ROLLOUT_ID = "otel_capture.rollout_id"  # from a URL prefix stripped by an outer capture middleware
SCOPE_ROLLOUT_SOURCE = "otel_capture.rollout_source"  # where that id came from: "url_prefix" or "header"
# The raw path without the /ng-rollout/<id> part (the path and raw_path keep it, as the ASGI spec wants with
# the prefix in root_path): what a forwarding app (the proxy) sends on.
SCOPE_UNPREFIXED_RAW_PATH = "otel_capture.unprefixed_raw_path"
_ROLLOUT_ID_HEADER = ROLLOUT_ID_HEADER.encode()
_CAPTURED_MARK = (CAPTURED_HEADER.encode(), CAPTURED_VALUE.encode())
_PREFIX_TEXT = "/" + ROLLOUT_PATH_PREFIX + "/"  # root_path + this + the id: the prefix, decoded
_PREFIX_IN_TEXT = re.compile("/" + ROLLOUT_PATH_PREFIX + "/[^/\\s]*")  # in a span name or a decoded path


class Correlation(NamedTuple):
    """What a request is, for capture: the scope the app sees (the prefix moved into ``root_path``, the
    header removed), its rollout id and where it came from, its dialect, and whether a capture layer in
    front of this one records it already. :attr:`captured` says whether this layer records it. Immutable;
    a named tuple rather than a frozen dataclass, whose ``__init__`` (one ``object.__setattr__`` per field)
    cost about 2 us on every request."""

    scope: Scope
    rollout_id: str | None
    source: str  # url_prefix, header, api_key, session_id or baggage (meaningless without a rollout id)
    prefixed: bool  # the id came from a prefix this layer read (the server span is renamed)
    dialect: Dialect | None
    headers: dict[str, list[bytes]]  # by lower-case name; read only for a model call ({} otherwise)
    captured_upstream: bool = False  # the request carries x-otel-capture: captured
    baggage_id: str | None = None  # the baggage's rollout.id, valid or not (the span notes a disagreement)
    invalid_baggage_id: str | None = None  # a baggage rollout.id that breaks the grammar: ignored, logged
    invalid_api_key_id: bool = False  # a key matched the pattern, its group breaks the grammar (never shown)
    invalid_session_id: str | None = None  # an x-session-id read as rollout id that breaks the grammar
    # An id in the URL prefix or the x-rollout-id header that breaks the grammar (or two prefixes): where it
    # was (INVALID_IN_*) and what it was (hostile: only ever logged escaped and cut, never a file name).
    # The call is served, not recorded: no later carrier is read for it.
    invalid_id: tuple[str, str] | None = None

    @property
    def captured(self) -> bool:
        """A model call with a rollout id that no layer in front records: this layer records it."""
        return self.dialect is not None and self.rollout_id is not None and not self.captured_upstream

    def scope_for_capture(self, *, mark: bool) -> Scope:
        """The scope handed to the app for a captured call: a copy marked captured (a capture middleware
        below passes it through), with ``x-otel-capture: captured`` added when ``mark`` (this layer records
        to a sink, so a capture layer behind it, in another process, records nothing)."""
        scope = dict(self.scope)
        scope[SCOPE_CAPTURED] = True
        if mark:
            scope["headers"] = [*scope.get("headers", ()), _CAPTURED_MARK]
        return scope


DOUBLE_PREFIX_RULE = "a request carries at most one /ng-rollout/<id>/ prefix"
INVALID_IN_PREFIX = "the /ng-rollout/<id>/ prefix"
INVALID_IN_HEADER = f"the {ROLLOUT_ID_HEADER} header"
INVALID_DOUBLE_PREFIX = "more than one /ng-rollout/<id>/ prefix"


def correlate(scope: Scope, rules: RolloutRules = NO_RULES) -> Correlation:
    """The one decision of what an HTTP request is for capture (:class:`Correlation`); capture never
    fails a call. The carriers in order (``docs/gateways.md``): the
    ``/ng-rollout/<id>/`` URL prefix (or the id an outer capture middleware read from one), the
    ``x-rollout-id`` header, then as ``rules`` say the API key (``Authorization: Bearer`` or ``x-api-key``
    through a pattern) and the ``x-session-id`` header, then the W3C ``baggage`` entry ``rollout.id``. The
    last three are read for model calls only, and a bad one is ignored (logged), not refused: they carry
    other things for other systems (a credential, a session), and a refusal would quote a credential.
    A key that matched the pattern is replaced by ``rules.upstream_api_key`` when one is set, on every
    request (a ``GET /v1/models`` with a per-rollout key goes upstream too).

    The prefix moves into ``root_path`` (``path`` keeps the full path, as the ASGI spec and Starlette want),
    so the app routes the rest and the URLs it builds (redirects, ``url_for``) keep the prefix. An id in
    the prefix or the header that breaks the grammar, or a second prefix (which id is meant is anyone's
    guess), is routed the same way (every prefix stripped, the header removed) and noted in
    :attr:`Correlation.invalid_id`: the call is served and not recorded.
    """
    rollout_id: str | None = scope.get(SCOPE_ROLLOUT_ID)
    source: str = scope.get(SCOPE_ROLLOUT_SOURCE, "url_prefix")
    changes: dict[str, Any] = {}
    root_path: str = scope.get("root_path", "")
    # Split on the raw path: in the decoded one, /ng-rollout/a%2Fb/... would look like id "a".
    raw_root, raw_route = split_root(scope, root_path)
    prefix_ids, raw_rest = _split_prefixes(raw_route)
    invalid_id: tuple[str, str] | None = None
    if prefix_ids:
        # decoded, as the server decoded the path: the app routes path minus root_path
        changes["root_path"] = root_path + _PREFIX_TEXT + _PREFIX_TEXT.join(prefix_ids)
        changes[SCOPE_UNPREFIXED_RAW_PATH] = (raw_root + raw_rest).encode("latin-1")
        if len(prefix_ids) > 1:
            # /ng-rollout/a/ng-rollout/b/...: which id is meant is anyone's guess; served, not recorded
            invalid_id = (INVALID_DOUBLE_PREFIX, "/".join(prefix_ids))
        elif not is_valid_rollout_id(prefix_ids[0]):
            invalid_id = (INVALID_IN_PREFIX, prefix_ids[0])
        else:
            rollout_id, source = prefix_ids[0], "url_prefix"
    # by lower-case name, read once: the x-rollout-id header here, and for a model call every other carrier
    headers = _by_name(scope.get("headers", ()))
    header_values = headers.pop(ROLLOUT_ID_HEADER, None)
    header_id = rollout_id_from_header(header_values) if header_values else None
    if header_id is not None:
        changes["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != _ROLLOUT_ID_HEADER]
        if not is_valid_rollout_id(header_id):
            invalid_id = invalid_id or (INVALID_IN_HEADER, header_id)
        elif rollout_id is None and invalid_id is None:
            rollout_id, source = header_id, "header"
    if changes:
        scope = dict(scope, **changes)
        if rollout_id is not None:  # for a capture middleware below this one (a mounted sub-app)
            scope[SCOPE_ROLLOUT_ID], scope[SCOPE_ROLLOUT_SOURCE] = rollout_id, source
    key = match_api_key(scope.get("headers", ()), rules) if rules.api_key_pattern is not None else None
    if key is not None and key.headers is not None:
        scope = dict(scope, headers=key.headers)  # the per-rollout key does not go upstream
        headers = headers_by_name(scope)
    prefixed = bool(prefix_ids)
    if rollout_id is not None:
        invalid_id = None  # a valid id won (the prefix over the header): the header's is simply not read
    dialect = dialect_of(scope)
    if dialect is None:  # not a model call: nothing more to read
        return Correlation(scope, rollout_id, source, prefixed, None, {}, invalid_id=invalid_id)
    marks = headers.get(CAPTURED_HEADER)
    if marks and CAPTURED_VALUE in (v.decode("latin-1").strip() for v in marks):
        return Correlation(scope, rollout_id, source, prefixed, dialect, headers, captured_upstream=True)
    if invalid_id is not None:  # the caller meant an id: no later carrier (a key, baggage) stands in for it
        return Correlation(scope, None, source, prefixed, dialect, headers, invalid_id=invalid_id)
    invalid_key = False
    invalid_session = None
    if rollout_id is None and key is not None:
        if key.rollout_id is not None:
            rollout_id, source = key.rollout_id, "api_key"
        else:
            invalid_key = True
    if rollout_id is None and rules.session_id and (session := session_id(headers)) is not None:
        if is_valid_rollout_id(session):
            rollout_id, source = session, "session_id"
        else:
            invalid_session = session
    baggage = headers.get("baggage")
    baggage_id = rollout_id_from_baggage(baggage) if baggage else None
    invalid_baggage_id = None
    if rollout_id is None and baggage_id is not None:
        if is_valid_rollout_id(baggage_id):
            rollout_id, source = baggage_id, "baggage"
        else:
            invalid_baggage_id = baggage_id
    return Correlation(
        scope,
        rollout_id,
        source,
        prefixed,
        dialect,
        headers,
        baggage_id=baggage_id,
        invalid_baggage_id=invalid_baggage_id,
        invalid_api_key_id=invalid_key,
        invalid_session_id=invalid_session,
    )


def warn_ignored_carriers(found: Correlation) -> None:
    """Log each carrier :func:`correlate` ignored because its id breaks the grammar (never the key)."""
    if found.invalid_baggage_id is not None:
        # Baggage is ambient context from any upstream system: a bad value must not fail the call.
        notify(
            _logger,
            logging.WARNING,
            "not capturing a call with invalid baggage rollout.id %r",
            found.invalid_baggage_id[:64],
        )
    if found.invalid_api_key_id:  # the key is a credential: neither it nor its group is shown
        notify(
            _logger,
            logging.WARNING,
            "an API key matched %s but its rollout group breaks the rollout id grammar (%s): not read",
            ENV_API_KEY_ROLLOUT_PATTERN,
            ROLLOUT_ID_RULE,
        )
    if found.invalid_session_id is not None:
        notify(
            _logger,
            logging.WARNING,
            "not reading the %s header %r as the rollout id: %s",
            SESSION_ID_HEADER,
            found.invalid_session_id[:64],
            ROLLOUT_ID_RULE,
        )


def invalid_id_notice(dialect: str, where: str, value: str) -> tuple[str, str, str, str, str]:
    """The warning for a model call whose id in ``where`` breaks the grammar (or that has two prefixes):
    ``(format, *args)``. The id may be hostile: cut to 64 characters and escaped (``%r``), never whole."""
    return (
        "a %s model call has %s %r: not a rollout id (%s); it is served and not recorded (counted as "
        "invalid_id: otel-capture check); see docs/gateways.md",
        dialect,
        where,
        value[:64],
        ROLLOUT_ID_RULE if where != INVALID_DOUBLE_PREFIX else DOUBLE_PREFIX_RULE,
    )


def split_root(scope: Scope, root_path: str) -> tuple[str, str]:
    """The raw path cut into the part ``root_path`` stands for and the rest (the raw route path)."""
    raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    path: str = scope["path"]
    if (
        not root_path
        or not path.startswith(root_path)
        or path[len(root_path) : len(root_path) + 1] not in ("", "/")
    ):
        return "", raw_path
    cut = 0
    for _ in range(root_path.rstrip("/").count("/")):  # one raw segment per decoded one
        cut = raw_path.find("/", cut + 1)
        if cut < 0:
            return raw_path, ""
    return raw_path[:cut], raw_path[cut:]


def unprefixed_raw_path(scope: Scope) -> bytes:
    """The raw path to forward: without the ``/ng-rollout/<id>`` part the capture middleware read."""
    raw: bytes = scope.get(SCOPE_UNPREFIXED_RAW_PATH) or scope.get("raw_path") or scope["path"].encode()
    return raw


def route_path(scope: Scope) -> str:
    """The path the app routes: ``path`` without ``root_path`` (Starlette's ``get_route_path``)."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path + "/"):
        path = path[len(root_path) :]  # a mounted app's route path, as Starlette routes it
    return path


def dialect_of(scope: Scope) -> Dialect | None:
    return _dialect_of_route(scope.get("method"), route_path(scope))


def _dialect_of_route(method: object, path: str) -> Dialect | None:
    if method != "POST":
        return None
    if len(path) > 1 and path.endswith("/"):
        path = path[:-1]
    found = DIALECT_PATHS.get(path)  # as listed (SGLang's /generate, vLLM's /inference/v1/generate)
    if found is None and not path.startswith("/v1/"):
        # servers (llama.cpp) and gateways serve /chat/completions etc. without /v1 too
        found = DIALECT_PATHS.get("/v1" + path)
    return found


def server_span_details(scope: Scope) -> tuple[str, dict[str, Any]]:
    """The HTTP server span's name and attributes for ``OpenTelemetryMiddleware(default_span_details=...)``:
    ``METHOD path`` without the ``/ng-rollout/<id>`` part (one name per route, not one per rollout), and
    ``http.route`` for a model call's path (``url.path`` keeps the real path)."""
    method = str(scope.get("method", "")).strip() or "HTTP"
    path: str = scope.get("path", "")
    if scope.get("type") != "http":
        return path or method, {}
    root_path: str = scope.get("root_path", "")
    raw_root, raw_route = split_root(scope, root_path)
    prefix_ids, raw_rest = _split_prefixes(raw_route)  # split raw: an id may hold %2F or a space
    if prefix_ids:  # every prefix, as correlate strips them (a bad id is no part of the name either)
        route = (root_path if raw_root else "") + (unquote(raw_rest) if "%" in raw_rest else raw_rest)
    else:
        route = _PREFIX_IN_TEXT.sub("", path, count=1)
    route = route or "/"
    attributes: dict[str, Any] = {}
    if _dialect_of_route(scope.get("method"), route) is not None:
        attributes[A.HTTP_ROUTE] = route
    return f"{method} {route}", attributes


def name_server_span(scope: Scope, dialect: Dialect | None) -> None:
    """Take the rollout id out of the current HTTP server span's name (an outer instrumentation named it by
    the prefixed path, or only by its method because no route matched it)."""
    span = trace.get_current_span()
    if not span.is_recording():  # first: a non-recording span has no name (getattr would raise inside)
        return
    name = getattr(span, "name", None)
    if getattr(span, "kind", None) != SpanKind.SERVER or not isinstance(name, str):
        return
    method = str(scope.get("method", ""))
    route = route_path(scope)
    if _PREFIX_IN_TEXT.search(name):
        span.update_name(_PREFIX_IN_TEXT.sub("", name, count=1))
    elif dialect is not None and name == method:
        span.update_name(f"{method} {route}")
        span.set_attribute(A.HTTP_ROUTE, route)


def headers_by_name(scope: Scope) -> dict[str, list[bytes]]:
    return _by_name(scope.get("headers", ()))


def _by_name(raw: Any) -> dict[str, list[bytes]]:
    headers: dict[str, list[bytes]] = {}
    for key, value in raw:
        name = key.decode("latin-1").lower()
        values = headers.get(name)
        if values is None:
            headers[name] = [value]
        else:
            values.append(value)
    return headers


def server_attributes(scope: Scope, headers: dict[str, list[bytes]]) -> dict[str, Any]:
    """``server.address``/``server.port`` as the client addressed the server (its ``Host`` header, as the
    HTTP semconv does), else the socket the server listens on."""
    host = headers.get("host")
    if host:
        name, sep, port = host[0].decode("latin-1").strip().rpartition(":")
        if not sep or "]" in port:  # no port, or a bare IPv6 literal
            name, port = host[0].decode("latin-1").strip(), ""
        name = name.strip("[]")
        if name:
            attributes: dict[str, Any] = {A.SERVER_ADDRESS: name}
            if port.isdigit():
                attributes[A.SERVER_PORT] = int(port)
            elif scope.get("scheme") in ("http", "https"):
                attributes[A.SERVER_PORT] = 443 if scope["scheme"] == "https" else 80
            return attributes
    server = scope.get("server")
    if server and server[0]:
        attributes = {A.SERVER_ADDRESS: server[0]}
        if server[1] is not None:
            attributes[A.SERVER_PORT] = server[1]
        return attributes
    return {}


def session_id(headers: dict[str, list[bytes]]) -> str | None:
    raw = headers.get("x-session-id")
    if not raw:
        return None
    values = {v.decode("latin-1").strip() for v in raw} - {""}
    return values.pop() if len(values) == 1 else None


def first_header(headers: Any, name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


def response_headers(headers: Any) -> tuple[str, str, int | None]:
    """``(content type, content encoding, content length)`` of a response's headers in one pass: the
    first of each (``""``, ``""``, ``None`` when absent), as :func:`first_header` and
    :func:`content_length` read them."""
    content_type = content_encoding = length = None
    for key, value in headers:
        name = key.lower()
        if name == b"content-type":
            if content_type is None:
                content_type = bytes(value).decode("latin-1")
        elif name == b"content-encoding":
            if content_encoding is None:
                content_encoding = bytes(value).decode("latin-1")
        elif name == b"content-length" and length is None:
            length = bytes(value).decode("latin-1")
    if length is not None:
        length = length.strip()
    return (
        content_type or "",
        content_encoding or "",
        int(length) if length is not None and length.isdigit() else None,
    )


def content_length(headers: Any) -> int | None:
    value = first_header(headers, b"content-length").strip()
    return int(value) if value.isdigit() else None


def _split_prefixes(raw_route: str) -> tuple[list[str], str]:
    """The ids of the ``/ng-rollout/<id>/`` prefixes that open the raw route (decoded, unvalidated: one
    normally; ``%6Eg-rollout`` is the same segment to the app that decodes it) and the raw rest."""
    ids: list[str] = []
    rest = raw_route
    while True:
        if "%" not in rest and not rest.startswith(_PREFIX_TEXT):
            return ids, rest  # no prefix, plain or percent-encoded: the usual end, without the calls
        split = split_rollout_prefix(rest)
        if split is None and "%" in rest:
            end = rest.find("/", 1)
            head = rest if end < 0 else rest[:end]
            if unquote(head) == "/" + ROLLOUT_PATH_PREFIX:
                split = split_rollout_prefix("/" + ROLLOUT_PATH_PREFIX + rest[len(head) :])
        if split is None:
            return ids, rest
        prefix_id, rest = split
        ids.append(prefix_id)
