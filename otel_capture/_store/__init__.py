"""The store: durable files under one capture directory, and everything the rest of the package takes from
them. This is its face: outside ``_store/``, code imports from here, never from its modules.

- :class:`CaptureBackend`: the lifecycle's verbs, spelled once (:mod:`.backend`), which both backends
  declare and the conformance kit checks;
- :class:`CaptureStore`: a directory's rollouts (read, freeze, retire, delete) and its file names
  (``CAPTURE_SUFFIX``, ``TOKENS_SUFFIX``, ``INCOMPLETE_SUFFIX``); :class:`InMemoryCaptureBackend`, the
  lifecycle without files (the conformance kit's reference);
- :class:`JsonlWriter`: the group-commit writer behind the ``model_call_jsonl`` exporter, its
  :class:`WriterStats` and ``LIBC_SYNCFS``;
- the readers (:mod:`.reading`): the records of a rollout, strict or tolerant, and Gym's aggregate;
- :func:`check_directory`: whether a capture directory is safe to use (others cannot write to it);
  :func:`pending_losses` (:func:`read_reserves`, :func:`held_in_memory`): calls a writer could not record
  and could not yet mark on disk (:mod:`.losses`);
  :func:`choose_sync`: how its writer makes a batch durable, chosen by its filesystem (:mod:`.fstype`);
- the lifecycle's types and errors (:mod:`.types`), ``ROLLOUT_STATES`` among them;
- :class:`LoopWaiter`, a call's completion signal (the writer resolves it), :class:`DeclaredVersions`
  and :func:`usable_weight_version` (weight versions), and the uncorrelated counts
  (:class:`UncorrelatedCounter`, :func:`counter_for`, :func:`read_uncorrelated`).

Below it are only the record codec (:mod:`otel_capture._records`), the id grammar, the errors and the
settings: importing the store loads no tracing SDK. Its rooms are listed in ``docs/architecture.md``;
the contract it keeps is ``docs/durability.md`` and ``docs/lifecycle.md``, cited where each clause is kept.
"""

from __future__ import annotations

from .._errors import (
    CaptureFrozenError,
    CaptureRetiredError,
    CaptureStateError,
    DamagedEntryError,
    LockTimeoutError,
    UnsafeDirectoryError,
)
from .backend import VERBS, CaptureBackend
from .fs import check_directory
from .fstype import SyncChoice, choose_sync
from .losses import Loss, Reserves, held_in_memory, pending_losses, read_reserves
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
    ROLLOUT_STATES,
    CaptureSnapshot,
    IncompleteCall,
    RemovalResult,
    RolloutState,
    empty_result,
    validate_rollout_ids,
)
from .uncorrelated import (
    INVALID_ID,
    INVALID_ID_WORDS,
    LATE_WORDS,
    NO_ID,
    NO_ID_WORDS,
    UncorrelatedCounter,
    counter_for,
    read_uncorrelated,
)
from .weight import DeclaredVersions, usable_weight_version
from .writer import LIBC_SYNCFS, JsonlWriter, WriterStats
from .writer_items import LoopWaiter

__all__ = [
    "CAPTURE_SUFFIX",
    "INCOMPLETE_SUFFIX",
    "INVALID_ID",
    "INVALID_ID_WORDS",
    "LATE_WORDS",
    "LIBC_SYNCFS",
    "NO_ID",
    "NO_ID_WORDS",
    "ROLLOUT_STATES",
    "TOKENS_SUFFIX",
    "VERBS",
    "AvailableRecords",
    "CaptureBackend",
    "CaptureFrozenError",
    "CaptureRetiredError",
    "CaptureSnapshot",
    "CaptureStateError",
    "CaptureStore",
    "DamagedEntryError",
    "DeclaredVersions",
    "InMemoryCaptureBackend",
    "IncompleteCall",
    "JsonlWriter",
    "LockTimeoutError",
    "LoopWaiter",
    "Loss",
    "RemovalResult",
    "Reserves",
    "RolloutState",
    "SyncChoice",
    "UncorrelatedCounter",
    "UnsafeDirectoryError",
    "WriterStats",
    "aggregate_model_call_metrics",
    "check_directory",
    "choose_sync",
    "counter_for",
    "empty_result",
    "held_in_memory",
    "iter_model_call_records",
    "pending_losses",
    "read_available_model_call_records",
    "read_model_call_records",
    "read_reserves",
    "read_uncorrelated",
    "scan_available_model_call_records",
    "usable_weight_version",
    "validate_rollout_ids",
]
