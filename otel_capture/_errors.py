"""``CaptureError``: the root of every error class otel-capture defines, so ``except CaptureError``
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
    ├── WriterClosedError (RuntimeError)      a call reached the writer after it was closed
    ├── CheckFailed (AssertionError)          a conformance check's rule was broken
    ├── ConfigurationError (ValueError)       a setting refused at start (it names the variable)
    └── DamagedLine (ValueError)              why one line is not a record (the line decoder's answer,
                                              caught by every reader; never raised to a caller)

Capture itself never raises into a model call: these come from the store's API, the readers, the
collector's helpers, the conformance kit, and the settings (at start, never on a call). Every class of the
tree is defined here and the modules that raise them import them from here; ``otel_capture`` exports the
root and the ones its store and readers raise. Private control-flow signals that never leave the module
that raises them (the middleware's durability wait, the proxy's read timeout and its too-large upstream
head) stay beside that code. A wrong argument is Python's own ``TypeError`` or ``ValueError``, and a failed
system call its ``OSError``, as in the standard library: not a ``CaptureError``.
"""

from __future__ import annotations

import errno
from pathlib import Path

__all__ = [
    "CaptureError",
    "CaptureFrozenError",
    "CaptureReadError",
    "CaptureRetiredError",
    "CaptureStateError",
    "CheckFailed",
    "ConfigurationError",
    "DamagedEntryError",
    "DamagedLine",
    "InvalidRolloutIdError",
    "LockTimeoutError",
    "UnsafeDirectoryError",
    "WriterClosedError",
    "damaged_line",
]


class CaptureError(Exception):
    """The root of otel-capture's own errors (the tree is in :mod:`otel_capture._errors`)."""


def damaged_line(number: int, reason: str | None = None) -> str:
    """The one wording of a damaged line, for every reader, the freeze and ``check``:
    ``damaged line N: why`` (N the physical line number, 1-based)."""
    return f"damaged line {number}: {reason}" if reason else f"damaged line {number}"


class InvalidRolloutIdError(CaptureError, ValueError):
    """A rollout id that breaks the rollout id grammar (``otel_capture._correlation``)."""

    def __init__(self, rollout_id: object, rule: str) -> None:
        super().__init__(f"invalid rollout id {rollout_id!r}: {rule}")
        self.rollout_id = rollout_id


class CaptureReadError(CaptureError, ValueError):
    """A damaged line in a capture file, found by the strict reader: ``<path>: damaged line N: why``."""

    def __init__(self, path: Path, line_number: int, reason: str) -> None:
        super().__init__(f"{path}: {damaged_line(line_number, reason)}")
        self.path = path
        self.line_number = line_number
        self.reason = reason


class DamagedLine(CaptureError, ValueError):
    """Why one line is not a record (what :func:`decode_record_line` raises)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CaptureFrozenError(CaptureError, RuntimeError):
    """The rollout is frozen: it takes no more records (``mark_incomplete`` is still accepted)."""


class CaptureRetiredError(CaptureFrozenError):
    """The rollout is retired: its records are gone and its fence refuses everything but ``delete``."""


class CaptureStateError(CaptureError, ValueError):
    """A rollout's lifecycle state is damaged (for example a damaged fence journal line naming it).

    Only that rollout is affected; ``retire`` or ``delete`` of it writes a fresh event that supersedes
    the damage."""


class DamagedEntryError(CaptureError, OSError):
    """A path of the store is not what the store made: a symbolic link, a FIFO, a directory, or a data file
    with several hard links. It is never followed, written through or waited on (``docs/durability.md``,
    "A hostile directory"); the rollout's capture fails with this reason, and the response is untouched.

    ``label`` is the path inside the capture directory, ``what`` what was found there."""

    def __init__(self, label: str, what: str, consequence: str = "never followed or written through") -> None:
        super().__init__(f"{label}: {what}: {consequence}")
        self.label = label
        self.what = what


class LockTimeoutError(CaptureError, OSError):
    """A ``flock`` the store waited for stayed held for the whole lock timeout (``lock_timeout_s``,
    ``OTEL_CAPTURE_LOCK_TIMEOUT_S``): another process holds the file's lock and does not let go. The
    writer fails that rollout's batch with this reason; a freeze, retire or delete raises it.

    ``label`` is the path inside the capture directory, ``waited`` the seconds waited in all. An
    ``OSError`` with ``errno.ETIMEDOUT``, deliberately not a ``TimeoutError``: a writer's future fails with
    it, and ``except TimeoutError`` around ``future.result(timeout)`` must keep meaning "not resolved yet"
    (``concurrent.futures.TimeoutError`` is ``TimeoutError``)."""

    def __init__(self, label: str, waited: float, holder: str = "another process") -> None:
        super().__init__(errno.ETIMEDOUT, f"{label} locked by {holder} for more than {waited:g} s")
        self.label = label
        self.waited = waited


class UnsafeDirectoryError(CaptureError, PermissionError):
    """The capture directory is world-writable or owned by another user, so others could plant links in it.

    Refused unless opted in: ``allow_shared_directory=True`` (``OTEL_CAPTURE_ALLOW_SHARED_DIR=1``)."""


class WriterClosedError(CaptureError, RuntimeError):
    """The call reached the writer after it was closed: its line is not written (the rollout is marked)."""


class CheckFailed(CaptureError, AssertionError):
    """One check's rule was broken."""


class ConfigurationError(CaptureError, ValueError):
    """A setting refused when the settings are built (before the proxy listens or the middleware serves):
    ``NAME: why``, where ``NAME`` is the variable (``OTEL_CAPTURE_...``) or the argument it came from.

    Raised for the settings that are never safe to replace by a default: one that would change what an
    upstream receives (a header value) or what is written as a rollout id (the API key's pattern). The
    message never quotes a secret's value."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason
