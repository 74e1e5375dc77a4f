"""Collector side: clear a rollout's captures before dispatch, attach its calls to its record after.

The flow of a collector (NeMo Gym's ``rollout_collection``):

1. stamp each row to dispatch (``_ng_attempt_index`` on a retry), then
   :func:`clear_model_call_captures` for the rows' rollout ids, so a reused id starts empty;
2. dispatch; the agent's calls are captured under the rollout id (``/ng-rollout/<id>/`` or baggage);
3. :func:`attach_model_call_capture` on each result record: it waits (up to ``wait_s``) until no call of
   the rollout is in flight in any directory, freezes the rollout in every directory, and adds
   ``ng_model_call_capture = {"rollout_id", "metrics", "calls", "gaps"?, "health"}`` built from exactly those
   snapshots, changing nothing else; with ``drop=True`` it then drops exactly those snapshots (never a
   plain retire: a directory that changed after its snapshot is not dropped, and says so in a gap);
4. write the records durably (with ``drop=False``: then drop the snapshots, :class:`FrozenCapture`).

A call still in flight when the wait ends is frozen out: its line, when it comes, is dropped by the fence
(the proxy counts it in ``late_write_dropped``) and the attachment names it in a gap. So is a call that
arrives after the freeze. A call begun in another process less than the writer's marker delay before the
freeze has no in-flight marker yet: nothing names it, and its line is dropped by the fence (contract D19).

**Several directories** (one per node) are read together. When a rollout's records come from one
directory, ``call_index`` is exactly NeMo Gym's (the line's position in its file, damaged lines counted).
When they come from several, each directory's append order is kept and the directories are interleaved by
``completed_at`` (a record's line is appended when the call completes, so this is the merged append
order), and ``call_index`` is renumbered ``0..n-1`` over the merged list; ``model_call_id`` stays the
key to a call in the store.

**Gaps** say what the attachment cannot vouch for, each ``{"code", "detail"?}``. NeMo Gym's codes:

- ``model_call_capture_no_records``: no data file and no incomplete marker in any directory, or only
  empty data files (no valid and no damaged line);
- ``model_call_capture_records_unreadable``, ``detail: "count=<n>"``: damaged lines, the torn final
  line included (NeMo Gym would try to parse it and count it);
- ``model_call_capture_incomplete``: an incomplete marker exists, or a writer's loss reserve holds a loss
  the marker does not have yet (the filesystem was full): a call was not captured. ``detail`` names the
  calls and why, as ``<model_call_id>: <reason>`` joined by ``; `` (the first 20, then how many more);
- ``model_call_capture_unreadable``: reading a directory failed (``detail``: the directory and error),
  or the rollout is retired there (``detail: "<dir>: retired (its records were removed)"``: attached
  after its captures were retired, its calls are unknown, not zero).

Ours, added where they tell more (NeMo Gym's readers ignore unknown codes):

- ``model_call_capture_in_flight``, ``detail: "<model_call_id>: began by <UTC time>, still in flight after
  <wait_s> s (<dir>)"`` (one per call; also ``model_call_capture_incomplete``): the call had not ended when
  the wait did. The time bounds its start from above: the earlier of when its in-flight marker was written
  (the marker delay and at most one writer batch after it began (contract D19); the marker holds only
  the call's id and that time) and when the wait first saw it in flight;
- ``model_call_capture_not_dropped``, ``detail: "<dir>: <why>"`` (``drop=True`` only): that directory's
  snapshot was not dropped (it changed after the freeze, say a call marked incomplete since); the rollout
  stays frozen there, its records kept: retire it once the attachment is safe;

- ``model_call_capture_torn_tail``, ``detail: "<data file>:<line number>"`` (one per directory that has
  one): the data file ends in a line without its newline, a writer died mid-append. It is reported, never parsed, and also
  counted in ``model_call_capture_records_unreadable``, so NeMo Gym's health checks treat it as NeMo Gym
  would.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeAlias

from ._correlation import maybe_rollout_id_from_run_body, validate_rollout_id
from ._health import RolloutEvidence, judge_rollout
from ._records import ModelCallRecord, aggregate_model_call_records
from ._store import (
    AvailableRecords,
    CaptureRetiredError,
    CaptureSnapshot,
    CaptureStore,
    RemovalResult,
    empty_result,
    read_available_model_call_records,
    validate_rollout_ids,
)

_logger = logging.getLogger(__name__)

ATTACHMENT_KEY = "ng_model_call_capture"
PAYLOAD_FIELDS = frozenset({"request", "response", "request_raw", "response_raw"})

GAP_NO_RECORDS = "model_call_capture_no_records"
GAP_RECORDS_UNREADABLE = "model_call_capture_records_unreadable"
GAP_INCOMPLETE = "model_call_capture_incomplete"
GAP_UNREADABLE = "model_call_capture_unreadable"
GAP_TORN_TAIL = "model_call_capture_torn_tail"
GAP_IN_FLIGHT = "model_call_capture_in_flight"
GAP_NOT_DROPPED = "model_call_capture_not_dropped"
DEFAULT_WAIT_S = 5.0
_POLL_S = (0.005, 0.1)  # the wait looks again after 5 ms, doubling up to 100 ms
_NAMED = 20  # calls an incomplete gap names

StoreLike: TypeAlias = "CaptureStore | str | os.PathLike[str]"
"""A capture directory: a :class:`CaptureStore` or its path."""
Stores: TypeAlias = "StoreLike | Iterable[StoreLike]"
"""One capture directory, or several (one per node), read together."""


def _as_store(item: StoreLike) -> CaptureStore:
    if isinstance(item, CaptureStore):
        return item
    if isinstance(item, (str, os.PathLike)):
        return CaptureStore(item)
    raise TypeError(f"expected a CaptureStore or a directory path, not {type(item).__name__}")


def as_stores(stores: Stores) -> list[CaptureStore]:
    """One store, a directory path, or an iterable of them, as a list of stores; a directory given twice
    (the same absolute path) is read once."""
    items: Iterable[StoreLike]
    items = [stores] if isinstance(stores, (CaptureStore, str, os.PathLike)) else stores
    result: list[CaptureStore] = []
    seen: set[str] = set()
    for item in items:
        store = _as_store(item)
        key = os.path.abspath(store.root)
        if key not in seen:
            seen.add(key)
            result.append(store)
    if not result:
        raise ValueError("no capture directory given")
    return result


# --- clearing before dispatch ---------------------------------------------------------------------------


def clear_model_call_captures(stores: Stores, rollout_ids: Iterable[str]) -> RemovalResult:
    """Delete every capture of these exact rollout(-attempt) ids in every directory, before dispatch.

    Call it after the retry attempt has been stamped (``-a<n>`` ids), so a previous attempt's records
    stay where they are. Each directory's :meth:`~otel_capture.CaptureStore.delete_now` removes records,
    markers and fences, so a retired id can be used again, and a straggling call of an earlier use of the
    id is still dropped as late. Never creates a directory.

    Returns ``{"removed", "absent", "failed"}`` over all directories: ``removed`` if any directory held a
    capture of the id; ``failed`` (id → ``"<dir>: reason"``) if any directory could not finish it: do not
    dispatch such an id (its old records may remain); calling again with the same ids finishes it. Raises
    ``TypeError`` for a bare string and ``ValueError`` for a bad id, before touching anything.
    """
    ids = validate_rollout_ids(rollout_ids)
    result = empty_result()
    removed: set[str] = set()
    for store in as_stores(stores):
        outcome = store.delete_now(ids)
        removed.update(outcome["removed"])
        for rollout_id, reason in outcome["failed"].items():
            result["failed"].setdefault(rollout_id, f"{store.root}: {reason}")
    for rollout_id in ids:
        if rollout_id in result["failed"]:
            continue
        result["removed" if rollout_id in removed else "absent"].append(rollout_id)
    return result


# --- attaching after the rollout ------------------------------------------------------------------------


@dataclass(frozen=True)
class _DirectoryRead:
    store: CaptureStore
    path: str  # the rollout's data file in this directory
    available: AvailableRecords | None  # None: the read failed
    error: str | None = None
    lost: tuple[str, ...] = ()  # "<model_call_id>: <reason>" of each call the marker (or a reserve) names
    in_flight: tuple[str, ...] = ()  # gap details of the calls a freeze found in flight
    # the same calls as data, for the verdict (:mod:`._health`): (model_call_id, reason), and the ids
    lost_calls: tuple[tuple[str, str], ...] = ()
    in_flight_ids: tuple[str, ...] = ()


def _read_directory(store: CaptureStore, rollout_id: str) -> _DirectoryRead:
    path = str(store.data_path(rollout_id))
    try:
        available = read_available_model_call_records(store, rollout_id)
        # Nothing here: never written, or retired (its records removed after an earlier attachment). A
        # retired rollout's calls are unknown, not zero.
        nothing = not (available.records or available.damaged or available.incomplete)
        if nothing and store.rollout_state(rollout_id) == "retired":
            return _DirectoryRead(store, path, None, f"{store.root}: retired (its records were removed)")
        lost: tuple[str, ...] = ()
        lost_calls: tuple[tuple[str, str], ...] = ()
        if available.incomplete:
            lost_calls = tuple((c.model_call_id, c.reason) for c in store.incomplete_calls(rollout_id))
            lost = tuple(f"{mcid or '?'}: {reason}" for mcid, reason in lost_calls)
    except Exception as exc:  # an unreadable directory is a gap in the attachment, never a crash
        _logger.warning(
            "cannot read the captures of rollout %s in %s: %s", rollout_id, store.root, exc, exc_info=True
        )
        return _DirectoryRead(store, path, None, f"{store.root}: {type(exc).__name__}: {exc}")
    return _DirectoryRead(store, path, available, lost=lost, lost_calls=lost_calls)


def _merge_key_sequence(records: Sequence[ModelCallRecord]) -> Iterator[tuple[float, ModelCallRecord]]:
    """Each record with the time its line was appended, about: its ``completed_at``, or the previous
    record's when it has none, so a record without one keeps its place in its file."""
    last = float("-inf")
    for record in records:
        if record.completed_at is not None:
            last = record.completed_at
        yield last, record


def _merged_records(reads: Sequence[_DirectoryRead]) -> list[ModelCallRecord]:
    sources = [read.available.records for read in reads if read.available and read.available.records]
    if len(sources) <= 1:
        return list(sources[0]) if sources else []
    # heapq.merge compares only the heads, so each file's own order is kept, and ties go to the
    # directory given first.
    merged = heapq.merge(*(_merge_key_sequence(records) for records in sources), key=lambda pair: pair[0])
    return [record.model_copy(update={"call_index": index}) for index, (_, record) in enumerate(merged)]


def _gaps(reads: Sequence[_DirectoryRead]) -> list[dict[str, str]]:
    readable = [read.available for read in reads if read.available is not None]
    gaps: list[dict[str, str]] = []
    damaged = sum(available.damaged for available in readable)
    incomplete = any(available.incomplete for available in readable)
    found_anything = any(available.records or available.damaged for available in readable)
    in_flight = any(read.in_flight for read in reads)
    if not (found_anything or incomplete or in_flight) and all(read.available is not None for read in reads):
        gaps.append({"code": GAP_NO_RECORDS})
    if damaged:
        gaps.append({"code": GAP_RECORDS_UNREADABLE, "detail": f"count={damaged}"})
    for read in reads:
        torn = read.available.torn_tail_line if read.available is not None else None
        if torn is not None:
            gaps.append({"code": GAP_TORN_TAIL, "detail": f"{read.path}:{torn.line_number}"})
    if incomplete or in_flight:
        lost = [entry for read in reads for entry in read.lost]
        gap = {"code": GAP_INCOMPLETE}
        if lost:
            more = f"; and {len(lost) - _NAMED} more" if len(lost) > _NAMED else ""
            gap["detail"] = "; ".join(lost[:_NAMED]) + more
        gaps.append(gap)
    for read in reads:
        gaps.extend({"code": GAP_IN_FLIGHT, "detail": detail} for detail in read.in_flight)
    for read in reads:
        if read.available is None:
            gaps.append({"code": GAP_UNREADABLE, "detail": read.error or "read failed"})
    return gaps


def _attachment(rollout_id: str, reads: Sequence[_DirectoryRead], include_payloads: bool) -> dict[str, Any]:
    records = _merged_records(reads)
    exclude = None if include_payloads else set(PAYLOAD_FIELDS)
    attachment: dict[str, Any] = {
        "rollout_id": rollout_id,
        "metrics": aggregate_model_call_records(records),
        "calls": [record.model_dump(mode="json", exclude=exclude) for record in records],
    }
    gaps = _gaps(reads)
    if gaps:
        attachment["gaps"] = gaps
    evidence = RolloutEvidence(
        rollout_id,
        records,
        [call for read in reads for call in read.lost_calls],
        list(dict.fromkeys(mcid for read in reads for mcid in read.in_flight_ids)),
    )
    attachment["health"] = judge_rollout(evidence)
    return attachment


def build_model_call_capture(
    stores: Stores, rollout_id: str, *, include_payloads: bool = False
) -> dict[str, Any]:
    """The ``ng_model_call_capture`` value for one rollout, read from every directory.

    ``{"rollout_id", "metrics", "calls", "gaps"?, "health"}``: ``metrics`` is
    :func:`~otel_capture._records.aggregate.aggregate_model_call_records` (NeMo Gym's keys with its values, then
    ours); each call is its ``ModelCallRecord`` without the payloads (``request``, ``response``,
    ``request_raw``, ``response_raw``) unless ``include_payloads``: NeMo Gym's keys, then ours (``None``
    on lines NeMo Gym wrote). ``gaps`` only when there is one. Raises ``ValueError`` for a bad id only.
    """
    validate_rollout_id(rollout_id)
    reads = [_read_directory(store, rollout_id) for store in as_stores(stores)]
    return _attachment(rollout_id, reads, include_payloads)


# --- attaching from a snapshot ----------------------------------------------------------------------------


@dataclass
class FrozenCapture:
    """A rollout frozen in every directory and its attachment, built from exactly those snapshots.

    :meth:`drop` retires exactly those snapshots (a directory whose rollout changed since is left frozen
    and reported). ``snapshots`` pairs each directory with its snapshot; a directory that does not exist
    or could not be frozen has none."""

    rollout_id: str
    attachment: dict[str, Any]
    snapshots: list[tuple[CaptureStore, CaptureSnapshot]] = field(default_factory=list)

    def drop(self) -> dict[str, str]:
        """Drop each directory's snapshot; ``{directory: why}`` for those not dropped (empty: all were)."""
        failed: dict[str, str] = {}
        for store, snapshot in self.snapshots:
            try:
                dropped = store.drop_now(
                    self.rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version
                )
            except Exception as exc:  # reported, never raised: the attachment is made already
                failed[str(store.root)] = f"{type(exc).__name__}: {exc}"
                continue
            if not dropped:
                failed[str(store.root)] = "the rollout changed after its snapshot (not dropped; still frozen)"
        return failed


def _wait_until_quiet(stores: Sequence[CaptureStore], rollout_id: str, wait_s: float) -> dict[str, float]:
    """Wait until no call of the rollout is in flight in any of ``stores`` or ``wait_s`` has passed; for
    each call seen in flight, the earliest time it is known to have been running (its marker's time, or
    when this wait first saw it): an upper bound of its start."""
    deadline = time.monotonic() + max(wait_s, 0.0)
    delay = _POLL_S[0]
    seen: dict[str, float] = {}
    while True:
        busy = False
        for store in stores:
            try:
                calls = store.calls_in_flight(rollout_id)
            except Exception as exc:  # the freeze that follows reports what it can
                _logger.warning(
                    "cannot list the calls in flight of %s in %s: %s", rollout_id, store.root, exc
                )
                continue
            for mcid, since in calls.items():
                busy = True
                known = [t for t in (since, seen.get(mcid)) if t is not None]
                seen[mcid] = min(known) if known else time.time()
        if not busy or time.monotonic() >= deadline:
            return seen
        time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
        delay = min(delay * 2, _POLL_S[1])


def _in_flight_detail(mcid: str, since: float | None, wait_s: float, store: CaptureStore) -> str:
    began = "began at an unknown time"
    if since is not None:
        began = "began by " + datetime.fromtimestamp(since, timezone.utc).isoformat(timespec="milliseconds")
    return f"{mcid}: {began}, still in flight after {wait_s:g} s ({store.root})"


def _freeze_directory(
    store: CaptureStore, rollout_id: str, seen: dict[str, float], wait_s: float
) -> tuple[_DirectoryRead, CaptureSnapshot | None]:
    if not os.path.isdir(store.root) and not store.calls_in_flight(rollout_id):
        # never created by a writer, and no call of this process on its way to it: nothing here, none made
        return _DirectoryRead(store, str(store.data_path(rollout_id)), AvailableRecords(records=[])), None
    try:
        snapshot = store.freeze_now(rollout_id)
    except CaptureRetiredError:
        return _read_directory(store, rollout_id), None  # retired: its records are gone, its calls unknown
    except Exception as exc:  # an unfreezable directory is a gap, never a crash
        _logger.warning("cannot freeze rollout %s in %s: %s", rollout_id, store.root, exc, exc_info=True)
        return _DirectoryRead(store, str(store.data_path(rollout_id)), None, f"{store.root}: {exc}"), None
    return _snapshot_read(store, snapshot, seen, wait_s), snapshot


def _snapshot_read(
    store: CaptureStore, snapshot: CaptureSnapshot, seen: dict[str, float], wait_s: float
) -> _DirectoryRead:
    """What one directory's snapshot says, as the attachment needs it: the snapshot is the read model (its
    records, damaged lines, torn tail, calls in flight and lost calls, read once by the freeze)."""
    path = str(store.data_path(snapshot.rollout_id))
    if snapshot.unreadable is not None:
        return _DirectoryRead(store, path, None, f"{store.root}: {snapshot.unreadable}")
    available = AvailableRecords(
        records=list(snapshot.records),
        invalid=list(snapshot.damaged_lines),
        torn_tail=snapshot.torn_tail is not None,
        incomplete=snapshot.marked,
        torn_tail_line=snapshot.torn_tail,
    )
    lost: tuple[str, ...] = ()
    lost_calls: tuple[tuple[str, str], ...] = ()
    if snapshot.marked:
        lost_calls = tuple((call.model_call_id, call.reason) for call in snapshot.lost_calls)
        lost = tuple(f"{mcid or '?'}: {reason}" for mcid, reason in lost_calls)
    in_flight = tuple(_in_flight_detail(mcid, seen.get(mcid), wait_s, store) for mcid in snapshot.in_flight)
    return _DirectoryRead(
        store,
        path,
        available,
        lost=lost,
        in_flight=in_flight,
        lost_calls=lost_calls,
        in_flight_ids=tuple(snapshot.in_flight),
    )


def freeze_model_call_capture(
    stores: Stores,
    rollout_id: str,
    *,
    wait_s: float = DEFAULT_WAIT_S,
    include_payloads: bool = False,
) -> FrozenCapture:
    """Wait up to ``wait_s`` seconds until no call of the rollout is in flight in any directory, freeze it
    in every directory that exists (none is created), and build its ``ng_model_call_capture`` from exactly
    those snapshots (calls still in flight become gaps naming them). Nothing is dropped: call
    :meth:`FrozenCapture.drop` once the attachment is safe. Raises ``ValueError`` for a bad id only."""
    validate_rollout_id(rollout_id)
    targets = as_stores(stores)
    seen = _wait_until_quiet(targets, rollout_id, wait_s)
    reads: list[_DirectoryRead] = []
    frozen = FrozenCapture(rollout_id, {})
    for store in targets:
        read, snapshot = _freeze_directory(store, rollout_id, seen, wait_s)
        reads.append(read)
        if snapshot is not None:
            frozen.snapshots.append((store, snapshot))
    frozen.attachment = _attachment(rollout_id, reads, include_payloads)
    return frozen


def attach_model_call_capture(
    record: MutableMapping[str, Any],
    stores: Stores,
    *,
    rollout_id: str | None = None,
    include_payloads: bool = False,
    wait_s: float = DEFAULT_WAIT_S,
    drop: bool = False,
) -> dict[str, Any]:
    """Add ``ng_model_call_capture`` to a rollout record, from a snapshot; return what was added.

    Waits up to ``wait_s`` seconds until no call of the rollout is in flight in any directory, freezes it
    in each, and attaches exactly those snapshots (:func:`freeze_model_call_capture`): a call still in
    flight is a gap naming it, a call arriving later is refused by the fence. With ``drop`` the snapshots
    are then dropped (exactly them, never a plain retire); a directory that changed since is left frozen
    and named in a ``model_call_capture_not_dropped`` gap. ``drop`` frees the captures before the record is
    written: a collector that must never lose a call to a crash passes ``drop=False`` and drops the
    snapshots of :func:`freeze_model_call_capture` once its records are durable.

    The rollout id is ``rollout_id`` if given, else the one the record names (NeMo Gym's rules:
    ``_ng_rollout_id``, else ``{_ng_task_index}-{_ng_rollout_index}``, ``-a{n}`` for attempts > 0),
    whatever the agent-side gate says: the collector attaches because it captured.

    Additive: no existing key of ``record`` changes. A record that already has ``ng_model_call_capture``
    is refused with ``ValueError``, as are a bad id and a record that names no rollout. Reading problems
    never raise: they become gaps (module docstring).
    """
    if ATTACHMENT_KEY in record:
        raise ValueError(f"the record already has {ATTACHMENT_KEY!r}; attachment never replaces it")
    if rollout_id is None:
        rollout_id = maybe_rollout_id_from_run_body(record)
        if rollout_id is None:
            raise ValueError(
                "the record names no rollout (no _ng_rollout_id, _ng_task_index or _ng_rollout_index);"
                " pass rollout_id="
            )
    frozen = freeze_model_call_capture(stores, rollout_id, wait_s=wait_s, include_payloads=include_payloads)
    attachment = frozen.attachment
    if drop:
        for directory, why in frozen.drop().items():
            _logger.warning("rollout %s in %s: %s", rollout_id, directory, why)
            attachment.setdefault("gaps", []).append(
                {"code": GAP_NOT_DROPPED, "detail": f"{directory}: {why}"}
            )
    record[ATTACHMENT_KEY] = attachment
    return attachment
