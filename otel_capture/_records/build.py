"""One on-disk line to one :class:`~.schema.ModelCallRecord`, as NeMo Gym's ``build_model_call_record``.

``latency_ms`` on disk is ``latency_total_ms`` in the record; token counts, tool calls, reasoning and the
finish reason are derived from the bodies (:mod:`otel_capture._dialects.derive`); ``call_index`` is the
caller's. Validation is Gym's: a line is rejected exactly when Gym's pydantic model rejects it. A record
whose values already have their exact target types skips validation (:mod:`.speed`); anything else goes
through ``model_validate``, so both give the same record or the same rejection. Our added keys never
make a line unreadable (Gym reads such lines): a value of the wrong type is read as ``None``.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from pydantic import TypeAdapter, ValidationError

from .._dialects.derive import derive_call_facts
from .schema import EXTRA_RECORD_FIELDS, EXTRA_RECORD_TYPES, GYM_RECORD_FIELDS, ModelCallRecord
from .speed import construct_record, construct_ref

__all__ = ["build_model_call_record"]

_logger = logging.getLogger(__name__)

_GYM_FIELDS_SET = frozenset(GYM_RECORD_FIELDS)
_NO_EXTRAS: dict[str, None] = dict.fromkeys(EXTRA_RECORD_FIELDS)

# Line fields checked on the fast path: a value of exactly these types is what validation would return.
_STR_FIELDS = ("model_call_id", "dialect", "local_response_reason", "error_category")
_INT_FIELDS = ("status_code", "upstream_status_code")
_FLOAT_FIELDS = ("started_at", "completed_at", "latency_total_ms", "latency_ttft_ms")
_EXTRA_ADAPTERS: dict[str, TypeAdapter[Any]] = {
    name: TypeAdapter(cast(Any, ModelCallRecord.model_fields[name].annotation))
    for name in EXTRA_RECORD_FIELDS
}


def _line_values(line: dict[str, Any], call_index: int) -> dict[str, Any]:
    """Every record field, in field order: Gym's ``build_model_call_record`` arguments (not yet validated)
    followed by our added fields at ``None``."""
    raw_request = line.get("request")
    raw_response = line.get("response")
    facts = derive_call_facts(raw_response, raw_request, line.get("dialect"))
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
    Plain loops: this runs once per line read.
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
        values["model_ref"] = construct_ref(ref_type, ref_name)
    return True


def _add_extras(line: dict[str, Any], values: dict[str, Any]) -> set[str]:
    """Copy our added keys that the line carries into ``values``; a wrongly typed one becomes ``None``."""
    present: set[str] = set()
    for name, exact_type in EXTRA_RECORD_TYPES.items():
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


def build_model_call_record(line: dict[str, Any], *, call_index: int) -> ModelCallRecord:
    """The record for one on-disk line, as Gym's ``build_model_call_record`` builds it (plus our keys).

    Raises :class:`pydantic.ValidationError` where Gym does, and whatever Gym's derivation raises on a
    response shape it cannot walk.
    """
    values = _line_values(line, call_index)
    fields_set = set(_GYM_FIELDS_SET)
    if not line.keys().isdisjoint(EXTRA_RECORD_TYPES):
        fields_set |= _add_extras(line, values)
    if _already_valid(values):
        return construct_record(values, fields_set)
    return ModelCallRecord.model_validate({name: values[name] for name in fields_set})
