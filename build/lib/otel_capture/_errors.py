"""``CaptureError``: the root of every error otel-capture raises on purpose, so ``except CaptureError``
catches them all. Each one also keeps the built-in base it always had, so older ``except`` clauses (and
``errno`` checks) keep working::

    CaptureError
    ├── InvalidRolloutIdError (ValueError)    a rollout id that breaks the grammar
    ├── CaptureReadError (ValueError)         a damaged line, found by the strict reader
    ├── CaptureFrozenError (RuntimeError)     the rollout is frozen: no more records
    │   └── CaptureRetiredError               the rollout is retired: its records are gone
    ├── CaptureStateError (ValueError)        a rollout's lifecycle state is damaged
    ├── DamagedEntryError (OSError)           a path of the store is not what the store made
    ├── LockTimeoutError (OSError)            a lock stayed held for the whole lock timeout
    ├── UnsafeDirectoryError (PermissionError) a capture directory others could write to
    └── CheckFailed (AssertionError)          a conformance check's rule was broken

Capture itself never raises into a model call: these come from the store's API, the readers, the
collector's helpers and the conformance kit.
"""

from __future__ import annotations

__all__ = ["CaptureError"]


class CaptureError(Exception):
    """The root of otel-capture's own errors (the tree is in :mod:`otel_capture._errors`)."""
