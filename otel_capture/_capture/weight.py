"""The weight (policy) version of a call, from the two sides that can say it (``docs/attachment.md``,
"Weight versions"):

* the caller's: the ``x-weight-version`` header, else the W3C baggage entry ``weight.version``
  (:func:`caller_weight_version`); the header is removed before the request goes on
  (:func:`without_weight_version_header`), as ``x-rollout-id`` is;
* the engine's as this capture layer observed it (:mod:`.engine`), else from its answer
  (:func:`engine_weight_version`): SGLang's native ``meta_info.weight_version``,
  its OpenAI-compatible ``metadata.weight_version`` (non-streamed answers only: its stream chunks carry no
  ``metadata``), ``metadata.model_version``, and a top-level ``weight_version`` (where a vLLM build that
  reports one is expected to put it; released vLLM reports none).

The version the trainer declared for the directory is the store's (:mod:`otel_capture._store.weight`).
Pure functions: no I/O.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import unquote

from .. import _attributes as A
from .._asgi import Scope
from .._store import usable_weight_version

_logger = logging.getLogger(__name__)

WEIGHT_VERSION_HEADER = "x-weight-version"
BAGGAGE_WEIGHT_VERSION_KEY = "weight.version"
_HEADER = WEIGHT_VERSION_HEADER.encode()
_VERSION_KEYS = frozenset(("meta_info", "metadata", "weight_version"))  # where an answer reports its version
_usable = usable_weight_version  # the store's one rule of a usable version (1-200 printable characters)


def caller_weight_version(headers: dict[str, list[bytes]]) -> str | None:
    """The version the caller sent: the ``x-weight-version`` header, else baggage ``weight.version``.
    A value that is empty, longer than 200 characters or not printable is ignored with a warning (the
    call is served and recorded with the declared version instead); so are repeated headers that differ."""
    values = headers.get(WEIGHT_VERSION_HEADER)
    if values:
        distinct = {v.decode("utf-8", "surrogateescape").strip() for v in values}  # undecodable: unprintable
        found = _usable(distinct.pop()) if len(distinct) == 1 else None
        if found is None:
            _logger.warning("ignoring an unusable %s header %r", WEIGHT_VERSION_HEADER, values[0][:64])
        return found
    for raw in headers.get("baggage", ()):
        for member in raw.decode("utf-8", "surrogateescape").split(","):
            key, sep, value = member.partition("=")
            if sep and key.strip() == BAGGAGE_WEIGHT_VERSION_KEY:
                found = _usable(unquote(value.split(";", 1)[0]))
                if found is None:
                    _logger.warning(
                        "ignoring an unusable baggage %s %r", BAGGAGE_WEIGHT_VERSION_KEY, value[:64]
                    )
                return found
    return None


def without_weight_version_header(scope: Scope) -> Scope:
    """``scope`` with the ``x-weight-version`` header removed (a copy; the same scope when it has none),
    so that it is not forwarded upstream."""
    headers = scope.get("headers", ())
    if not any(key.lower() == _HEADER for key, _ in headers):
        return scope
    return dict(scope, headers=[(key, value) for key, value in headers if key.lower() != _HEADER])


def usable_version(value: Any) -> str | None:
    """``value`` as a version's text (an ``int`` or ``float`` as its decimal form), or ``None`` when it is
    not one (another type, empty, longer than 200 characters, not printable)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float, str)):
        return _usable(str(value))
    return None


def engine_weight_version(response: dict[str, Any] | None) -> str | None:
    """The weight version the engine reported in its answer, as text, or ``None``."""
    if not response or _VERSION_KEYS.isdisjoint(response):  # most answers: none of the keys read below
        return None
    for container in ("meta_info", "metadata"):
        section = response.get(container)
        if isinstance(section, dict):
            for key in ("weight_version", "model_version"):
                found = usable_version(section.get(key))
                if found is not None:
                    return found
    return usable_version(response.get("weight_version"))


def span_weight_attributes(
    caller: str | None, started_at: float, completed_at: float | None, sink: object
) -> dict[str, Any]:
    """The span's weight versions: the caller's, else the one declared for the directory as this process's
    writer last read it (``sink.weight_versions``; no I/O here, so a declaration is seen from the writer's
    next batch on, while the record's own values are read in the batch that writes it)."""
    view = getattr(sink, "weight_versions", None)
    declared = view.at(started_at) if view is not None else None
    admitted = caller if caller is not None else declared
    attributes: dict[str, Any] = {}
    if admitted is not None:
        attributes[A.WEIGHT_VERSION] = admitted
    at_end = view.at(completed_at) if view is not None else None
    if at_end is not None and at_end != declared:  # the weights changed while the call ran
        attributes[A.WEIGHT_VERSION_AT_END] = at_end
    return attributes


def record_weight_fields(engine_fields: dict[str, Any], caller: str | None) -> dict[str, Any]:
    """The record's weight fields a call's line carries beside the caller's ``weight_version``: the
    engine's as observed (:meth:`.engine.EngineWeights.fields`), and ``weight_version_sources``
    naming ``caller`` for the caller's version. The declared version is stamped by the writer, in the batch
    that writes the line; a ``weight_version`` whose source is not named is that one
    (:attr:`~otel_capture._records.schema.ModelCallRecord.weight_version_source`)."""
    if caller is None:
        return engine_fields
    fields = dict(engine_fields)
    fields["weight_version_sources"] = {
        **fields.get("weight_version_sources", {}),
        "weight_version": "caller",
    }
    return fields


def engine_span_attributes(fields: dict[str, Any]) -> dict[str, Any]:
    """The span's attributes for the engine's versions in a record's weight fields."""
    attributes: dict[str, Any] = {}
    for key, name in (
        ("engine_weight_version", A.ENGINE_WEIGHT_VERSION),
        ("engine_weight_version_at_end", A.ENGINE_WEIGHT_VERSION_AT_END),
        ("engine_weight_versions", A.ENGINE_WEIGHT_VERSIONS),
    ):
        if key in fields:
            attributes[name] = fields[key]
    return attributes
