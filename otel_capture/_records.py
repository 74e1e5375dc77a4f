"""``ModelCallRecord``: the read side of ``<dir>/<rollout_id>.capture.jsonl``, compatible with NeMo Gym 0.7.0.

A line on disk is Gym's exchange object (``latency_ms`` on disk is ``latency_total_ms`` in the record; token
counts, tool calls, reasoning and finish reason are derived at read time by :mod:`._derive`; ``call_index``
is never stored, it is the line's position among the file's non-blank lines).

Readers:

- :func:`read_model_call_records` is strict, like Gym's: the first damaged line raises
  :class:`CaptureReadError` naming the file and the line. Unlike Gym, a torn final line (no trailing
  newline: a writer died mid-append) is damage too, never parsed as a record.
- :func:`read_available_model_call_records` is tolerant: it returns every valid record and reports every
  damaged line, the torn tail and the incomplete marker, hiding nothing.

Validation is Gym's: a line is rejected exactly when Gym's pydantic model rejects it. For speed, a record
whose line fields already have their exact target types is built with ``model_construct``; anything else
goes through full ``model_validate``, so both paths give the same record or the same rejection.
Our own added keys (``schema_version``, ``trace_id``, ...) never make a line unreadable, since Gym reads such
lines: a value of the wrong type is read as ``None``.
"""

from __future__ import annotations

import gc
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, cast

import orjson
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from ._dialects.derive import derive_call_facts
from ._store.store import CaptureStore

__all__ = [
    "EXTRA_RECORD_FIELDS",
    "GYM_RECORD_FIELDS",
    "AvailableRecords",
    "CaptureReadError",
    "InvalidLine",
    "ModelCallRecord",
    "ModelServerRef",
    "aggregate_model_call_metrics",
    "aggregate_model_call_records",
    "build_model_call_record",
    "read_available_model_call_records",
    "read_model_call_records",
]

_PREVIEW_BYTES = 300
_FAILED_RESPONSE_STATUSES = frozenset({"failed", "error", "cancelled"})


class ModelServerRef(BaseModel):
    """Gym's reference to the model server that answered (``config_types.ModelServerRef``)."""

    type: Literal["responses_api_models"]
    name: str


class ModelCallRecord(BaseModel):
    """One captured model call. Fields up to ``latency_ttft_ms`` are NeMo Gym 0.7.0's, in its order."""

    model_call_id: str | None = None
    response_id: str | None = None
    client_session_id: str | None = None
    # Durable append order (position among non-blank lines), not the order in which calls started.
    call_index: int
    model_ref: ModelServerRef | None = None
    model: str | None = None
    dialect: str | None = None
    status_code: int | None = None
    response_status: str | None = None
    finish_reason: str | None = None
    upstream_attempted: bool | None = None
    response_source: Literal["upstream", "local"] | None = None
    upstream_status_code: int | None = None
    local_response_reason: str | None = None
    # Wall-clock bounds, UTC Unix seconds; durations are the monotonic latency fields below.
    started_at: float | None = None
    completed_at: float | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    tokens_reasoning: int | None = None
    tokens_total: int | None = None
    request: dict[str, Any] | None = None
    response: dict[str, Any] | None = None
    request_raw: str | None = None
    response_raw: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning_content: str | None = None
    cache_hit: bool | None = None
    cached_tokens: int | None = None
    cache_creation_tokens: int | None = None
    error_category: str | None = None
    latency_total_ms: float | None = None
    latency_ttft_ms: float | None = None

    # Ours, ignored by Gym. ``None`` when the line does not carry them (every line Gym writes).
    schema_version: int | None = None
    rollout_id: str | None = None
    trace_id: str | None = None
    span_id: str | None = None
    stream: bool | None = None
    stream_truncated: bool | None = None
    truncated: bool | None = None
    failure: dict[str, Any] | None = None


EXTRA_RECORD_FIELDS: tuple[str, ...] = (
    "schema_version",
    "rollout_id",
    "trace_id",
    "span_id",
    "stream",
    "stream_truncated",
    "truncated",
    "failure",
)
GYM_RECORD_FIELDS: tuple[str, ...] = tuple(
    name for name in ModelCallRecord.model_fields if name not in EXTRA_RECORD_FIELDS
)
_GYM_FIELDS_SET = frozenset(GYM_RECORD_FIELDS)
_NO_EXTRAS: dict[str, None] = dict.fromkeys(EXTRA_RECORD_FIELDS)

# Line fields checked on the fast path: a value of exactly these types is what validation would return.
_STR_FIELDS = ("model_call_id", "dialect", "local_response_reason", "error_category")
_INT_FIELDS = ("status_code", "upstream_status_code")
_FLOAT_FIELDS = ("started_at", "completed_at", "latency_total_ms", "latency_ttft_ms")
_EXTRA_EXACT_TYPES: dict[str, type] = {
    "schema_version": int,
    "rollout_id": str,
    "trace_id": str,
    "span_id": str,
    "stream": bool,
    "stream_truncated": bool,
    "truncated": bool,
    "failure": dict,
}
_EXTRA_ADAPTERS: dict[str, TypeAdapter[Any]] = {
    name: TypeAdapter(cast(Any, ModelCallRecord.model_fields[name].annotation))
    for name in EXTRA_RECORD_FIELDS
}


class CaptureReadError(ValueError):
    """A damaged line in a capture file, found by the strict reader."""

    def __init__(self, path: Path, line_number: int, reason: str) -> None:
        super().__init__(f"{path}:{line_number}: {reason}")
        self.path = path
        self.line_number = line_number
        self.reason = reason


class InvalidLine(NamedTuple):
    """A damaged line: 1-based physical line number, why it was refused, and its start (decoded)."""

    line_number: int
    reason: str
    raw: str


@dataclass(frozen=True)
class AvailableRecords:
    """What the tolerant reader found: valid records, damaged lines, a torn tail, the incomplete marker."""

    records: list[ModelCallRecord]
    invalid: list[InvalidLine] = field(default_factory=list)
    # The file ends with a line that has no newline: a crash mid-write. Reported, never parsed.
    torn_tail: bool = False
    # The ``<id>.capture.incomplete`` marker exists: at least one call of the rollout was not captured.
    incomplete: bool = False
    torn_tail_line: InvalidLine | None = None

    @property
    def damaged(self) -> int:
        """Damaged lines, the torn tail included."""
        return len(self.invalid) + int(self.torn_tail)


# --- building one record ------------------------------------------------------------------------------


def _line_values(line: dict[str, Any], call_index: int) -> dict[str, Any]:
    """Every record field, in field order: Gym's ``build_model_call_record`` arguments (not yet validated)
    followed by our added fields at ``None``."""
    raw_request = line.get("request")
    raw_response = line.get("response")
    facts = derive_call_facts(raw_response, raw_request)
    client_session_id = line.get("client_session_id")
    request_raw = line.get("request_raw")
    response_raw = line.get("response_raw")
    return {
        "model_call_id": line.get("model_call_id"),
        "response_id": facts["response_id"],
        "client_session_id": client_session_id if isinstance(client_session_id, str) else None,
        "call_index": call_index,
        "model_ref": line.get("model_ref"),
        "model": facts["model"],
        "dialect": line.get("dialect"),
        "status_code": line.get("status_code"),
        "response_status": facts["response_status"],
        "finish_reason": facts["finish_reason"],
        "upstream_attempted": line.get("upstream_attempted"),
        "response_source": line.get("response_source"),
        "upstream_status_code": line.get("upstream_status_code"),
        "local_response_reason": line.get("local_response_reason"),
        "started_at": line.get("started_at"),
        "completed_at": line.get("completed_at"),
        "tokens_in": facts["tokens_in"],
        "tokens_out": facts["tokens_out"],
        "tokens_reasoning": facts["tokens_reasoning"],
        "tokens_total": facts["tokens_total"],
        "request": raw_request if isinstance(raw_request, dict) else None,
        "response": raw_response if isinstance(raw_response, dict) else None,
        "request_raw": request_raw if isinstance(request_raw, str) else None,
        "response_raw": response_raw if isinstance(response_raw, str) else None,
        "tool_calls": facts["tool_calls"],
        "reasoning_content": facts["reasoning_content"],
        "cache_hit": facts["cache_hit"],
        "cached_tokens": facts["cached_tokens"],
        "cache_creation_tokens": facts["cache_creation_tokens"],
        "error_category": line.get("error_category"),
        "latency_total_ms": line.get("latency_ms"),
        "latency_ttft_ms": line.get("latency_ttft_ms"),
        **_NO_EXTRAS,
    }


def _already_valid(values: dict[str, Any]) -> bool:
    """True when every line-sourced value already has the exact type validation would give.

    Derived fields are valid by construction. On True, ``model_ref`` has been replaced by its model.
    """
    for name in _STR_FIELDS:
        value = values[name]
        if value is not None and type(value) is not str:
            return False
    for name in _INT_FIELDS:
        value = values[name]
        if value is not None and type(value) is not int:
            return False
    for name in _FLOAT_FIELDS:
        value = values[name]
        if value is not None and type(value) is not float:
            return False
    attempted = values["upstream_attempted"]
    if attempted is not None and type(attempted) is not bool:
        return False
    source = values["response_source"]
    if source is not None and (type(source) is not str or source not in ("upstream", "local")):
        return False
    if type(values["call_index"]) is not int:
        return False
    ref = values["model_ref"]
    if ref is not None:
        if type(ref) is not dict:
            return False
        ref_type, ref_name = ref.get("type"), ref.get("name")
        if type(ref_type) is not str or ref_type != "responses_api_models" or type(ref_name) is not str:
            return False
        values["model_ref"] = _construct_ref(ref_type, ref_name)
    return True


def _add_extras(line: dict[str, Any], values: dict[str, Any]) -> set[str]:
    """Copy our added keys that the line carries into ``values``; a wrongly typed one becomes ``None``."""
    present: set[str] = set()
    for name, exact_type in _EXTRA_EXACT_TYPES.items():
        if name not in line:
            continue
        value = line[name]
        present.add(name)
        if value is not None and type(value) is not exact_type:
            try:
                value = _EXTRA_ADAPTERS[name].validate_python(value)
            except ValidationError:
                value = None  # Gym reads this line; so must we. The bad value is not a record fact.
        values[name] = value
    return present


_object_setattr = object.__setattr__
_M = TypeVar("_M", bound=BaseModel)


def _raw_construct(cls: type[_M], values: dict[str, Any], fields_set: set[str]) -> _M:
    """``cls.model_construct(_fields_set=fields_set, **values)`` for a complete, field-ordered ``values``,
    without its per-field default lookup (which costs as much as validating a record).

    It sets exactly what ``model_construct`` sets for a model without private attributes, extras or
    ``model_post_init``; :func:`_raw_construct_matches_pydantic` checks that at import time.
    """
    model = cls.__new__(cls)
    _object_setattr(model, "__dict__", values)
    _object_setattr(model, "__pydantic_fields_set__", fields_set)
    _object_setattr(model, "__pydantic_extra__", None)
    _object_setattr(model, "__pydantic_private__", None)
    return model


def _raw_construct_matches_pydantic() -> bool:
    """Whether :func:`_raw_construct` builds what this pydantic version's ``model_construct`` builds."""
    values = _line_values({"dialect": "chat", "response": {"id": "r"}}, 0)
    ref = {"type": "responses_api_models", "name": "m"}
    pairs: list[tuple[BaseModel, BaseModel]] = [
        (
            _raw_construct(ModelCallRecord, dict(values), set(_GYM_FIELDS_SET)),
            ModelCallRecord.model_construct(_fields_set=set(_GYM_FIELDS_SET), **values),
        ),
        (
            _raw_construct(ModelServerRef, dict(ref), {"type", "name"}),
            ModelServerRef.model_construct(type=ref["type"], name=ref["name"]),
        ),
    ]
    slots = ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
    return all(
        getattr(ours, slot) == getattr(theirs, slot) and list(ours.__dict__) == list(theirs.__dict__)
        for ours, theirs in pairs
        for slot in slots
    )


def _construct(values: dict[str, Any], fields_set: set[str]) -> ModelCallRecord:
    if _FAST_CONSTRUCT:
        return _raw_construct(ModelCallRecord, values, fields_set)
    return ModelCallRecord.model_construct(_fields_set=fields_set, **values)


def _construct_ref(ref_type: str, ref_name: str) -> ModelServerRef:
    if _FAST_CONSTRUCT:
        return _raw_construct(ModelServerRef, {"type": ref_type, "name": ref_name}, {"type", "name"})
    return ModelServerRef.model_construct(type=ref_type, name=ref_name)


# On a pydantic whose internals moved, fall back to the public (slower) ``model_construct``.
_FAST_CONSTRUCT = _raw_construct_matches_pydantic()


def build_model_call_record(line: dict[str, Any], *, call_index: int) -> ModelCallRecord:
    """The record for one on-disk line, as Gym's ``build_model_call_record`` builds it (plus our keys).

    Raises :class:`pydantic.ValidationError` where Gym does, and whatever Gym's derivation raises on a
    response shape it cannot walk.
    """
    values = _line_values(line, call_index)
    fields_set = set(_GYM_FIELDS_SET)
    if not line.keys().isdisjoint(_EXTRA_EXACT_TYPES):
        fields_set |= _add_extras(line, values)
    if _already_valid(values):
        return _construct(values, fields_set)
    return ModelCallRecord.model_validate({name: values[name] for name in fields_set})


# --- reading a file -----------------------------------------------------------------------------------


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a file's records are built.

    Building 100,000 records allocates millions of container objects, none of them garbage; each full
    collection triggered on the way would walk the whole growing heap again (reading a 100,000-line file
    took about twice as long, counting the one collection that still follows). Reference counting still
    frees everything; the collector is re-enabled (if it was) on the way out.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _DamagedLine(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _validation_reason(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        loc = ".".join(str(part) for part in error["loc"])
        if loc == "latency_total_ms":
            loc = "latency_ms"  # name the key as it is on disk
        parts.append(f"{loc}: {error['msg']}")
    return "invalid record: " + "; ".join(parts)


def _record_from_line(stripped: bytes, call_index: int) -> ModelCallRecord:
    try:
        obj = orjson.loads(stripped)
    except orjson.JSONDecodeError as exc:
        raise _DamagedLine(f"invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise _DamagedLine(f"not a JSON object but {type(obj).__name__}")
    try:
        return build_model_call_record(obj, call_index=call_index)
    except ValidationError as exc:
        raise _DamagedLine(_validation_reason(exc)) from exc
    except Exception as exc:  # Gym counts any failure to build a record as a damaged line
        raise _DamagedLine(f"cannot derive record: {type(exc).__name__}: {exc}") from exc


def _scan(lines: Sequence[bytes]) -> Generator[tuple[int, bytes, ModelCallRecord | _DamagedLine], None, None]:
    """``(physical line number, stripped line, record or why it is damaged)`` for every non-blank line;
    ``call_index`` counts damaged lines too, as Gym's readers do. The collector is paused meanwhile."""
    index = 0
    with _gc_paused():
        for number, line in enumerate(lines, 1):
            stripped = line.strip()
            if not stripped:
                continue
            try:
                yield number, stripped, _record_from_line(stripped, index)
            except _DamagedLine as exc:
                yield number, stripped, exc
            index += 1


def _preview(line: bytes) -> str:
    if len(line) <= _PREVIEW_BYTES:
        return line.decode("utf-8", "replace")
    return line[:_PREVIEW_BYTES].decode("utf-8", "replace") + f"... ({len(line)} bytes)"


_TORN_REASON = "torn final line (no trailing newline): an append was cut short; not parsed"


def read_model_call_records(store: CaptureStore, rollout_id: str) -> list[ModelCallRecord]:
    """Every record of a rollout in append order; ``[]`` when there is no data file.

    Raises :class:`CaptureReadError` (a ``ValueError``) at the first damaged line or a torn final line,
    and ``ValueError`` for an invalid rollout id. Reads under ``flock(LOCK_SH)``.
    """
    raw = store.read_lines(rollout_id)
    if raw is None:
        return []
    records: list[ModelCallRecord] = []
    with closing(_scan(raw.lines)) as scan:  # closed at once, so the collector resumes even on a raise
        for number, _, record in scan:
            if isinstance(record, _DamagedLine):
                raise CaptureReadError(store.data_path(rollout_id), number, record.reason) from record.__cause__
            records.append(record)
    if raw.tail.strip():
        raise CaptureReadError(store.data_path(rollout_id), len(raw.lines) + 1, _TORN_REASON)
    return records


def read_available_model_call_records(store: CaptureStore, rollout_id: str) -> AvailableRecords:
    """Every valid record, and a report of what is not (damaged lines, torn tail, incomplete marker).

    ``call_index`` counts every non-blank line, damaged ones included, as Gym's tolerant reader does, so
    indices around a damaged line have a gap. Raises ``ValueError`` only for an invalid rollout id.
    """
    raw = store.read_lines(rollout_id)
    incomplete = store.is_incomplete(rollout_id)
    if raw is None:
        return AvailableRecords(records=[], incomplete=incomplete)
    records: list[ModelCallRecord] = []
    invalid: list[InvalidLine] = []
    for number, stripped, record in _scan(raw.lines):
        if isinstance(record, _DamagedLine):
            invalid.append(InvalidLine(number, record.reason, _preview(stripped)))
        else:
            records.append(record)
    torn_line = None
    if raw.tail.strip():
        torn_line = InvalidLine(len(raw.lines) + 1, _TORN_REASON, _preview(raw.tail.strip()))
    return AvailableRecords(
        records=records,
        invalid=invalid,
        torn_tail=torn_line is not None,
        incomplete=incomplete,
        torn_tail_line=torn_line,
    )


# --- aggregates ---------------------------------------------------------------------------------------


def _is_failed(record: ModelCallRecord) -> bool:
    """Gym's health-check notion of a failed call (``health/checks.py::_is_failed``)."""
    status = record.status_code
    return (
        (status is not None and status >= 400)
        or bool(record.error_category)
        or record.response_status in _FAILED_RESPONSE_STATUSES
    )


def aggregate_model_call_records(records: Sequence[ModelCallRecord]) -> dict[str, Any]:
    """Gym's aggregate (each value the sum over calls that have it, ``None`` if none do), then ours.

    Gym's keys: ``tokens_in``, ``tokens_out``, ``tokens_reasoning``, ``tokens_total``, ``cached_tokens``,
    ``latency_total_ms``, ``num_calls`` (failed calls included). Ours: ``num_errors`` (HTTP status >= 400,
    a non-empty ``error_category``, or a Responses status failed/error/cancelled: Gym's health-check rule),
    ``cache_creation_tokens`` (a sum) and ``latency_ttft_ms_mean`` (the mean over calls that have a TTFT).
    """

    def _sum(attr: str) -> Any:
        values = [value for call in records if (value := getattr(call, attr)) is not None]
        return sum(values) if values else None

    ttfts = [call.latency_ttft_ms for call in records if call.latency_ttft_ms is not None]
    return {
        "tokens_in": _sum("tokens_in"),
        "tokens_out": _sum("tokens_out"),
        "tokens_reasoning": _sum("tokens_reasoning"),
        "tokens_total": _sum("tokens_total"),
        "cached_tokens": _sum("cached_tokens"),
        "latency_total_ms": _sum("latency_total_ms"),
        "num_calls": len(records),
        "num_errors": sum(1 for call in records if _is_failed(call)),
        "cache_creation_tokens": _sum("cache_creation_tokens"),
        "latency_ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else None,
    }


def aggregate_model_call_metrics(store: CaptureStore, rollout_id: str) -> dict[str, Any]:
    """:func:`aggregate_model_call_records` over the strict reader, as Gym does: a damaged line raises
    :class:`CaptureReadError` rather than giving totals that silently miss calls."""
    return aggregate_model_call_records(read_model_call_records(store, rollout_id))
