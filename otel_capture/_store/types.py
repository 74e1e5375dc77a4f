"""The capture lifecycle's vocabulary, shared by every backend: the rollout states (contract L1), a
removal's result, a snapshot (the read model a collector builds its attachment from). The typed
refusals (contract L2) are in :mod:`otel_capture._errors`, with the whole exception tree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from .._records import InvalidLine, ModelCallRecord
from .._rollout_id import validate_rollout_id

RolloutState = Literal["absent", "live", "frozen", "retired"]
ROLLOUT_STATES: tuple[RolloutState, ...] = ("absent", "live", "frozen", "retired")


class RemovalResult(TypedDict):
    """What ``retire``/``delete`` did, per rollout id, in first-occurrence order.

    ``removed``: ids that had something to remove (records; for ``delete`` also a fence).
    ``absent``: every other id (already retired, never seen, frozen-and-empty).
    ``failed``: ids this batch could not finish, with the reason; every other id is done. Retrying the
    same batch is safe and finishes them.
    """

    removed: list[str]
    absent: list[str]
    failed: dict[str, str]


@dataclass(frozen=True)
class IncompleteCall:
    """Why a snapshot is incomplete: one call (``model_call_id`` may be ``""``) and the reason."""

    model_call_id: str
    reason: str


@dataclass(frozen=True)
class CaptureSnapshot:
    """A frozen rollout, as the consumer sees it.

    ``records`` are the model-call lines (``<id>.capture.jsonl``) read as the readers read them, and
    ``tokens`` the token lines (``<id>.tokens.jsonl``), parsed, in append order. A file store's snapshot
    keeps them as the files' bytes and parses each one when it is asked for: read-only sequences that
    compare equal to a tuple of the values, costing about the files' size (contract L19). ``version`` counts every durable line of the rollout (records, token lines, incomplete marks); ``drop`` succeeds only with this
    exact ``snapshot_id`` and ``version``, so a mark after the freeze (which changes ``version``) makes a
    stale drop fail.

    It is also the read model a collector builds its attachment from, as data, read once under the
    freeze's lock: ``damaged_lines`` and ``torn_tail`` of the data file (as the tolerant reader reports
    them), ``in_flight`` (the calls the freeze found begun and not recorded), ``lost_calls`` (what the
    incomplete marker and the writers' loss reserves name), ``marked`` (the marker exists, whatever it is,
    or a reserve holds a loss: NeMo Gym's "incomplete") and ``unreadable`` (why the data file could not be
    read at all, else ``None``). ``incomplete_calls`` says all of it again in prose, for people.
    """

    rollout_id: str
    records: Sequence[ModelCallRecord]
    tokens: Sequence[dict[str, Any]]
    incomplete: bool
    snapshot_id: str
    version: int
    incomplete_calls: tuple[IncompleteCall, ...] = field(default=())
    damaged_lines: tuple[InvalidLine, ...] = ()
    torn_tail: InvalidLine | None = None
    in_flight: tuple[str, ...] = ()
    lost_calls: tuple[IncompleteCall, ...] = ()
    marked: bool = False
    unreadable: str | None = None


def validate_rollout_ids(rollout_ids: Iterable[str]) -> list[str]:
    """The batch, validated whole and de-duplicated (first occurrence kept), before anything changes.

    A bare ``str`` (or ``bytes``) is a ``TypeError``, not a batch of one-character ids; so is anything
    that is not iterable. An invalid id is an :class:`~otel_capture.InvalidRolloutIdError` (``ValueError``).
    """
    if isinstance(rollout_ids, (str, bytes)):
        raise TypeError(f"expected an iterable of rollout ids, got the string {rollout_ids!r}; pass a list")
    try:
        items = list(rollout_ids)
    except TypeError:
        raise TypeError(f"expected an iterable of rollout ids, got {type(rollout_ids).__name__}") from None
    return list(dict.fromkeys(validate_rollout_id(rid) for rid in items))


def empty_result() -> RemovalResult:
    return {"removed": [], "absent": [], "failed": {}}
