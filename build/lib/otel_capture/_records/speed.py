"""Two speed tricks of the readers, each checked or undone when it would change a result.

- :func:`construct_record` builds a record whose values are already valid without pydantic's per-field
  default lookup (which costs as much as validating it). It sets exactly what ``model_construct`` sets;
  an import-time check falls back to the public ``model_construct`` on a pydantic whose internals moved.
- :func:`gc_paused` pauses the cyclic garbage collector while a file's records are built.

``bench/bench_reader.py`` measures the reader against plain per-line validation.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pydantic import BaseModel

from .schema import ModelCallRecord, ModelServerRef

__all__ = ["construct_record", "construct_ref", "gc_paused"]

_logger = logging.getLogger(__name__)

_object_setattr = object.__setattr__
_M = TypeVar("_M", bound=BaseModel)


def _raw_construct(cls: type[_M], values: dict[str, Any], fields_set: set[str]) -> _M:
    """``cls.model_construct(_fields_set=fields_set, **values)`` for a complete, field-ordered ``values``.

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
    values: dict[str, Any] = dict.fromkeys(ModelCallRecord.model_fields)
    values.update(call_index=0, dialect="chat", response_id="r", tool_calls=[])
    fields_set = {"call_index", "dialect", "response_id"}
    ref = {"type": "responses_api_models", "name": "m"}
    pairs: list[tuple[BaseModel, BaseModel]] = [
        (
            _raw_construct(ModelCallRecord, dict(values), set(fields_set)),
            ModelCallRecord.model_construct(_fields_set=set(fields_set), **values),
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


# On a pydantic whose internals moved, fall back to the public (slower) ``model_construct``.
FAST_CONSTRUCT = _raw_construct_matches_pydantic()
if not FAST_CONSTRUCT:
    _logger.debug("pydantic's model_construct changed; records are built with model_construct")


def construct_record(values: dict[str, Any], fields_set: set[str]) -> ModelCallRecord:
    """A record from complete, field-ordered values that already have their exact field types."""
    if FAST_CONSTRUCT:
        return _raw_construct(ModelCallRecord, values, fields_set)
    return ModelCallRecord.model_construct(_fields_set=fields_set, **values)


def construct_ref(ref_type: str, ref_name: str) -> ModelServerRef:
    """A :class:`ModelServerRef` from values already checked."""
    if FAST_CONSTRUCT:
        return _raw_construct(ModelServerRef, {"type": ref_type, "name": ref_name}, {"type", "name"})
    return ModelServerRef.model_construct(type=ref_type, name=ref_name)


@contextmanager
def gc_paused() -> Iterator[None]:
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
