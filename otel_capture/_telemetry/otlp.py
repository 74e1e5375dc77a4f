"""OTLP protobuf for the SDK's spans, written straight to bytes, behind the SDK's own OTLP exporters.

The SDK's encoder (``opentelemetry-exporter-otlp-proto-common``) builds one protobuf object per attribute,
per value, per span and per event in Python, then serializes them: about 3 µs per attribute, more than
the span itself costs, in the batch processor's thread, holding the GIL the event loop needs. This module
writes the same ``ExportTraceServiceRequest`` directly as protobuf's wire format (fields in number order,
proto3 defaults left out, as protobuf writes them): the bytes are the SDK encoder's, byte for byte
(``tests/unit/test_otlp_encoding.py`` decodes both with ``opentelemetry.proto`` and compares them).

A batch holding anything this encoder does not write (a mapping as an attribute value, an integer beyond
int64, a value type the SDK's validation would not have let through) goes to the SDK's encoder whole, so
its odd cases (what it logs, what it drops) stay the SDK's; so does a batch this encoder fails on (a span
object unlike the SDK's), told once in the log.

:func:`use_own_encoder` puts it behind an OTLP exporter the SDK built (by ``opentelemetry-instrument``'s
configurator, the proxy's provider, or the host's own code): the exporter object stays the same, with its
endpoint, headers, TLS, compression and timeout from the ``OTEL_EXPORTER_OTLP_*`` variables or its
constructor, its retries and its transport; only its class becomes a subclass whose encoding is this one.
Over HTTP, the subclass's ``export`` is the SDK's own function with this encoder bound where it calls
``encode_spans``; over gRPC, ``_translate_data`` returns the request parsed from these bytes (protobuf's C
parser: a few µs per batch), which gRPC serializes again.
"""

from __future__ import annotations

import logging
import struct
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.trace import SpanKind

_logger = logging.getLogger(__name__)

__all__ = ["encode_spans", "use_own_encoder"]

_DOUBLE = struct.Struct("<d").pack
_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_BYTE = [bytes((i,)) for i in range(128)]
_INT64 = 1 << 63
# Span.kind: the SDK's enum to OTLP's (SPAN_KIND_INTERNAL = 1 ...)
_KIND = {
    SpanKind.INTERNAL: b"\x30\x01",
    SpanKind.SERVER: b"\x30\x02",
    SpanKind.CLIENT: b"\x30\x03",
    SpanKind.PRODUCER: b"\x30\x04",
    SpanKind.CONSUMER: b"\x30\x05",
}
# SpanFlags: the parent's (or a link's) is_remote is known; it is remote
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_KEY_CACHE_MAX = 4096  # distinct attribute keys, and key-value pairs, kept encoded
_PAIR_TEXT_MAX = 128  # the longest string value kept encoded with its key


class _Unsupported(Exception):
    """A value this encoder does not write: the batch goes to the SDK's encoder."""


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _BYTE[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    n = len(payload)
    return tag + (_BYTE[n] if n < 0x80 else _varint(n)) + payload


_keys: dict[str, bytes] = {}


def _key(key: str) -> bytes:
    """``KeyValue.key`` (field 1), cached per key."""
    encoded = _keys.get(key)
    if encoded is None:
        if len(_keys) >= _KEY_CACHE_MAX:
            _keys.clear()
        encoded = _keys[key] = _field(b"\x0a", key.encode()) if key else b""
    return encoded


def _value(value: Any) -> bytes:
    """An ``AnyValue``'s fields (a oneof: its one field is written even when it is 0, "" or False)."""
    kind = value.__class__
    if kind is str:
        return _field(b"\x0a", value.encode())
    if kind is int:
        if not -_INT64 <= value < _INT64:
            raise _Unsupported("an integer beyond int64")
        return b"\x18" + _varint(value if value >= 0 else value + (1 << 64))
    if kind is float:
        return b"\x21" + _DOUBLE(value)
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is tuple or kind is list:
        return _field(b"\x2a", b"".join([_field(b"\x0a", _value(v)) for v in value]))
    if value is None:
        return b""
    if kind is bytes:
        return _field(b"\x3a", value)
    raise _Unsupported(f"an attribute value of type {kind.__name__}")


_pairs: dict[tuple[bytes, str, type, object], bytes] = {}


def _attributes(attributes: Mapping[str, object] | None, tag: bytes) -> bytes:
    """Repeated ``KeyValue`` under ``tag``. The SDK's attributes are a read-only view of its
    ``BoundedAttributes``, whose ``copy()`` is a plain dict: iterated without a Python call per key.

    Most of a model call's attributes are the same from call to call (the operation, the provider, the
    model, the request's parameters, the server, the status), so an attribute whose value is a short
    string, an int, a bool or a non-zero float is kept encoded, by its tag, key, type and value (the type,
    since ``True == 1 == 1.0``; not a zero float, since ``0.0 == -0.0`` and their bytes differ; not a long
    string, such as opt-in message content), up to :data:`_KEY_CACHE_MAX` pairs (then the cache starts
    again: about 1 MB at most)."""
    if not attributes:
        return b""
    items: Mapping[str, Any] = (
        attributes.copy() if isinstance(attributes, types.MappingProxyType) else attributes
    )
    out: list[bytes] = []
    append = out.append
    pairs = _pairs
    for key, value in items.items():
        kind = value.__class__
        pair = None
        if (
            (kind is str and len(value) <= _PAIR_TEXT_MAX)
            or kind is int
            or kind is bool
            or (kind is float and value)
        ):
            pair = (tag, key, kind, value)
            encoded = pairs.get(pair)
            if encoded is not None:
                append(encoded)
                continue
        encoded = _field(tag, _key(key) + _field(b"\x12", _value(value)))
        if pair is not None:
            if len(pairs) >= _KEY_CACHE_MAX:
                pairs.clear()
            pairs[pair] = encoded
        append(encoded)
    return b"".join(out)


def _uint32(tag: bytes, n: int) -> bytes:
    return tag + _varint(n) if n else b""


def _string(tag: bytes, text: str | None) -> bytes:
    return _field(tag, text.encode()) if text else b""


def _flags(context: Any) -> bytes:
    """``flags`` (fixed32), as the SDK's encoder sets them from the parent's or link's context."""
    remote = context is not None and context.is_remote
    return _FIXED32(_HAS_IS_REMOTE | _IS_REMOTE if remote else _HAS_IS_REMOTE)


def _trace_state(state: Any) -> str | None:
    return None if state is None else ",".join([f"{k}={v}" for k, v in state.items()])


def _span(span: Any) -> bytes:
    """One ``Span`` message (without its field tag)."""
    context = span.get_span_context()
    parent = span.parent
    parts = [
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + context.span_id.to_bytes(8, "big"),
        _string(b"\x1a", _trace_state(context.trace_state)),
        b"" if not parent else b"\x22\x08" + parent.span_id.to_bytes(8, "big"),
        _string(b"\x2a", span.name),
        _KIND[span.kind],
    ]
    start, end = span.start_time, span.end_time
    if start:
        parts.append(b"\x39" + _FIXED64(start))
    if end:
        parts.append(b"\x41" + _FIXED64(end))
    parts.append(_attributes(span.attributes, b"\x4a"))
    parts.append(_uint32(b"\x50", span.dropped_attributes))
    for event in span.events:
        timestamp = event.timestamp
        parts.append(
            _field(
                b"\x5a",
                (b"\x09" + _FIXED64(timestamp) if timestamp else b"")
                + _string(b"\x12", event.name)
                + _attributes(event.attributes, b"\x1a")
                + _uint32(b"\x20", event.dropped_attributes),
            )
        )
    parts.append(_uint32(b"\x60", span.dropped_events))
    for link in span.links:
        linked = link.context
        parts.append(
            _field(
                b"\x6a",
                b"\x0a\x10"
                + linked.trace_id.to_bytes(16, "big")
                + b"\x12\x08"
                + linked.span_id.to_bytes(8, "big")
                + _attributes(link.attributes, b"\x22")
                + _uint32(b"\x28", link.dropped_attributes)
                + b"\x35"
                + _flags(linked),
            )
        )
    parts.append(_uint32(b"\x70", span.dropped_links))
    status = span.status
    if status is not None:
        parts.append(
            _field(b"\x7a", _string(b"\x12", status.description) + _uint32(b"\x18", status.status_code.value))
        )
    parts.append(b"\x85\x01" + _flags(parent))
    return b"".join(parts)


def _scope(scope: Any) -> bytes:
    """``ScopeSpans.scope`` (always set, empty for a span without one, as the SDK's encoder does)."""
    if scope is None:
        return b"\x0a\x00"
    return _field(
        b"\x0a",
        _string(b"\x0a", scope.name)
        + _string(b"\x12", scope.version)
        + _attributes(scope.attributes, b"\x1a"),
    )


def encode_spans(spans: Sequence[Any]) -> bytes:
    """The ``ExportTraceServiceRequest`` of ``spans`` (the SDK's ``ReadableSpan``), serialized: grouped by
    resource, then by instrumentation scope, in the order each first appears, as the SDK's encoder groups
    them. Raises :class:`_Unsupported` for what only the SDK's encoder writes."""
    # (resource, scope) objects -> their group; equal objects share one group, as in the SDK's dicts
    by_identity: dict[tuple[int, int], list[bytes]] = {}
    groups: dict[Any, dict[Any, list[bytes]]] = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope or None
        pair = (id(resource), id(scope))
        encoded = by_identity.get(pair)
        if encoded is None:
            encoded = by_identity[pair] = groups.setdefault(resource, {}).setdefault(scope, [])
        encoded.append(_field(b"\x12", _span(span)))
    out = []
    for resource, scopes in groups.items():
        body = [_field(b"\x0a", _attributes(resource.attributes, b"\x0a"))]
        for scope, encoded in scopes.items():
            scope_spans = _scope(scope) + b"".join(encoded)
            body.append(_field(b"\x12", scope_spans + _string(b"\x1a", scope.schema_url if scope else None)))
        body.append(_string(b"\x1a", resource.schema_url))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)


def _own_or_sdk(sdk_encode: Callable[[Sequence[Any]], Any]) -> Callable[[Sequence[Any]], Any]:
    """An ``encode_spans`` for an SDK exporter: this encoder's request, as an object with the two methods
    the exporters call on the message the SDK's encoder returns; for a batch this encoder does not write,
    the SDK's own message (``sdk_encode``: the encoder the exporter's module imported)."""

    def encode(spans: Sequence[Any]) -> Any:
        try:
            return _Encoded(encode_spans(spans))
        except _Unsupported:
            return sdk_encode(spans)
        except Exception:  # a span unlike the SDK's: never worse than the SDK's encoder
            if not _told:
                _told.append(True)
                _logger.warning(
                    "otel-capture's OTLP encoder failed; the SDK's encodes instead", exc_info=True
                )
            return sdk_encode(spans)

    return encode


_told: list[bool] = []  # the failure above is logged once


class _Encoded:
    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self, **_options: object) -> bytes:
        return self.data

    SerializePartialToString = SerializeToString


def _grpc_translate(sdk_encode: Callable[[Sequence[Any]], Any], request: Any) -> Callable[..., Any]:
    """``_translate_data`` of the gRPC exporter: a real ``ExportTraceServiceRequest`` (``request``, the
    class its module imported; the stub's serializer takes nothing else), parsed from this encoder's bytes
    by protobuf's C parser."""
    encode = _own_or_sdk(sdk_encode)

    def translate(self: object, data: Sequence[Any]) -> Any:
        encoded = encode(data)
        return request.FromString(encoded.data) if isinstance(encoded, _Encoded) else encoded

    return translate


_HTTP = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "OTLPSpanExporter")
_GRPC = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter")
# the SDK's exporter class -> its subclass with this encoder (None: its shape is not the one known)
_subclasses: dict[type, type | None] = {}


def _rebound(function: Callable[..., Any]) -> Callable[..., Any]:
    """The SDK's ``function`` with this encoder where it calls its module's ``encode_spans``."""
    rebound = types.FunctionType(
        function.__code__,
        {**function.__globals__, "encode_spans": _own_or_sdk(function.__globals__["encode_spans"])},
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    return rebound


def _subclass(sdk_class: type) -> type | None:
    """The subclass of one of the SDK's OTLP span exporters that encodes with this module; ``None`` when
    the installed SDK's exporter does not encode where it is known to (see ``_sdk_private``)."""
    from .._sdk_private import grpc_request_class, http_encoding_methods

    where = (sdk_class.__module__, sdk_class.__qualname__)
    namespace: dict[str, Any] = {"__module__": __name__, "__doc__": sdk_class.__doc__}
    if where == _HTTP:
        methods = http_encoding_methods(sdk_class)
        if not methods:
            return None
        for name in methods:
            namespace[name] = _rebound(getattr(sdk_class, name))
    elif where == _GRPC:
        request = grpc_request_class(sdk_class)
        if request is None:
            return None
        module = sys.modules[sdk_class.__module__]
        namespace["_translate_data"] = _grpc_translate(module.encode_spans, request)
    else:
        return None
    return type(sdk_class.__name__, (sdk_class,), namespace)


def use_own_encoder(exporter: object) -> bool:
    """Make one of the SDK's OTLP span exporters (HTTP or gRPC, exactly its class, not a subclass someone
    wrote) encode with this module; True when it does now. Its configuration and transport are untouched."""
    kind = type(exporter)
    if kind in _own:
        return True
    if kind not in _subclasses:
        _subclasses[kind] = (
            _subclass(kind) if (kind.__module__, kind.__qualname__) in (_HTTP, _GRPC) else None
        )
        if _subclasses[kind] is not None:
            _own.add(_subclasses[kind])  # type: ignore[arg-type]  # not None, tested above
    subclass = _subclasses[kind]
    if subclass is None:
        return False
    exporter.__class__ = subclass
    return True


_own: set[type] = set()
