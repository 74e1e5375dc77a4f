"""The store: durable files under one capture directory, and everything the rest of the package takes from
them. This is its face: outside ``_store/``, code imports from here, never from its modules.

- :class:`CaptureStore`: a directory's rollouts (read, freeze, retire, delete) and its file names
  (``CAPTURE_SUFFIX``, ``TOKENS_SUFFIX``, ``INCOMPLETE_SUFFIX``); :class:`InMemoryCaptureBackend`, the
  lifecycle without files (the conformance kit's reference);
- :class:`JsonlWriter`: the group-commit writer behind the ``model_call_jsonl`` exporter, its
  :class:`WriterStats` and ``LIBC_SYNCFS``;
- the readers (:mod:`.reading`): the records of a rollout, strict or tolerant, and Gym's aggregate;
- :func:`check_directory`: whether a capture directory is safe to use (others cannot write to it);
- the lifecycle's types and errors (:mod:`.types`).

Below it are only the record codec (:mod:`otel_capture._records`), the id grammar, the settings and the
sink's ``LoopWaiter``; the durability contract is at the top of :mod:`.writer`.
"""

from __future__ import annotations

from .fs import check_directory
from .memory import InMemoryCaptureBackend
from .reading import (
    AvailableRecords,
    aggregate_model_call_metrics,
    iter_model_call_records,
    read_available_model_call_records,
    read_model_call_records,
    scan_available_model_call_records,
)
from .store import CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX, CaptureStore
from .types import (
    CaptureFrozenError,
    CaptureRetiredError,
    CaptureSnapshot,
    CaptureStateError,
    DamagedEntryError,
    IncompleteCall,
    LockTimeoutError,
    RemovalResult,
    RolloutState,
    UnsafeDirectoryError,
    empty_result,
    validate_rollout_ids,
)
from .writer import LIBC_SYNCFS, JsonlWriter, WriterStats

__all__ = [
    "CAPTURE_SUFFIX",
    "INCOMPLETE_SUFFIX",
    "LIBC_SYNCFS",
    "TOKENS_SUFFIX",
    "AvailableRecords",
    "CaptureFrozenError",
    "CaptureRetiredError",
    "CaptureSnapshot",
    "CaptureStateError",
    "CaptureStore",
    "DamagedEntryError",
    "InMemoryCaptureBackend",
    "IncompleteCall",
    "JsonlWriter",
    "LockTimeoutError",
    "RemovalResult",
    "RolloutState",
    "UnsafeDirectoryError",
    "WriterStats",
    "aggregate_model_call_metrics",
    "check_directory",
    "empty_result",
    "iter_model_call_records",
    "read_available_model_call_records",
    "read_model_call_records",
    "scan_available_model_call_records",
    "validate_rollout_ids",
]
