"""The in-memory reference backend of the capture lifecycle: the rules of docs/lifecycle.md and nothing else.

It is what :func:`otel_capture.conformance.run_conformance` compares other backends with, and a backend
for tests. Not durable and not shared between processes; thread-safe within one.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from .._errors import CaptureFrozenError, CaptureRetiredError
from .._records import InvalidLine, damaged_line, parse_record_line
from .._records.codec import preview
from .._rollout_id import validate_rollout_id
from .backend import CaptureBackend
from .inflight import INFLIGHT_REASON
from .types import (
    ROLLOUT_STATES,
    CaptureSnapshot,
    IncompleteCall,
    RemovalResult,
    RolloutState,
    empty_result,
    validate_rollout_ids,
)


@dataclass
class _Fence:
    kind: str
    seq: int
    snapshot_id: str | None = None
    version: int | None = None
    inflight: tuple[str, ...] = ()


@dataclass
class _Rollout:
    records: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[dict[str, Any]] = field(default_factory=list)
    incomplete: list[IncompleteCall] = field(default_factory=list)
    begun: dict[str, int] = field(default_factory=dict)  # model_call_id -> epoch at begin_call
    fence: _Fence | None = None
    last_seq: int = 0

    def has_records(self) -> bool:
        return bool(self.records or self.tokens or self.incomplete)

    def version(self) -> int:
        return len(self.records) + len(self.tokens) + len(self.incomplete)

    def pending(self) -> set[str]:
        """Begun, admitted at the current epoch, not yet recorded or marked."""
        return {m for m, epoch in self.begun.items() if epoch >= self.last_seq}


class InMemoryCaptureBackend(CaptureBackend):
    """The lifecycle in memory. Every client of one backend is the backend itself (``factory = lambda:
    backend``), so cross-client visibility is trivially true here; a real backend must earn it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._rollouts: dict[str, _Rollout] = {}
        self._seq = 0

    def _get(self, rid: str) -> _Rollout:
        return self._rollouts.setdefault(rid, _Rollout())

    def _event(self, rollout: _Rollout) -> int:
        self._seq += 1
        rollout.last_seq = self._seq
        return self._seq

    @staticmethod
    def _refuse(rid: str, fence: _Fence) -> CaptureFrozenError:
        if fence.kind == "retired":
            return CaptureRetiredError(f"rollout {rid} is retired")
        return CaptureFrozenError(f"rollout {rid} is frozen")

    # -- writes ------------------------------------------------------------------------------------------

    def append_now(
        self,
        rollout_id: str,
        model_call_id: str,
        record: dict[str, Any],
        tokens: dict[str, Any] | None = None,
    ) -> None:
        rid = validate_rollout_id(rollout_id)
        with self._lock:
            rollout = self._get(rid)
            epoch = rollout.begun.pop(model_call_id, None)
            if rollout.fence is not None:
                raise self._refuse(rid, rollout.fence)
            if epoch is not None and epoch < rollout.last_seq:
                raise CaptureRetiredError(
                    f"rollout {rid} was retired or deleted while the call was in flight"
                )
            rollout.records.append({"model_call_id": model_call_id, **record})
            if tokens is not None:
                rollout.tokens.append({"model_call_id": model_call_id, **tokens})

    def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        rid = validate_rollout_id(rollout_id)
        with self._lock:
            rollout = self._get(rid)
            if rollout.fence is not None:
                raise self._refuse(rid, rollout.fence)
            rollout.begun[model_call_id] = rollout.last_seq

    def mark_incomplete(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        rid = validate_rollout_id(rollout_id)
        with self._lock:
            rollout = self._get(rid)
            if rollout.fence is not None and rollout.fence.kind == "retired":
                raise self._refuse(rid, rollout.fence)
            rollout.incomplete.append(IncompleteCall(model_call_id, reason))
            rollout.begun.pop(model_call_id, None)

    # -- queries -----------------------------------------------------------------------------------------

    def rollout_state(self, rollout_id: str) -> RolloutState:
        rid = validate_rollout_id(rollout_id)
        with self._lock:
            rollout = self._rollouts.get(rid)
            if rollout is None:
                return "absent"
            if rollout.fence is not None:
                return "retired" if rollout.fence.kind == "retired" else "frozen"
            return "live" if rollout.has_records() or rollout.pending() else "absent"

    def list_rollouts(self, state: RolloutState | None = None) -> dict[str, RolloutState]:
        if state is not None and state not in ROLLOUT_STATES:
            raise ValueError(f"unknown state {state!r}; one of {', '.join(ROLLOUT_STATES)}")
        with self._lock:
            found = {rid: self.rollout_state(rid) for rid in sorted(self._rollouts)}
        return {rid: s for rid, s in found.items() if s != "absent" and (state is None or s == state)}

    # -- freeze and drop ---------------------------------------------------------------------------------

    def freeze_now(self, rollout_id: str) -> CaptureSnapshot:
        rid = validate_rollout_id(rollout_id)
        with self._lock:
            rollout = self._get(rid)
            fence = rollout.fence
            if fence is not None and fence.kind == "retired":
                raise self._refuse(rid, fence)
            if fence is None:
                recorded = {r["model_call_id"] for r in rollout.records} | {
                    c.model_call_id for c in rollout.incomplete
                }
                inflight = tuple(sorted(rollout.pending() - recorded))
                seq = self._event(rollout)
                fence = rollout.fence = _Fence("frozen", seq, uuid.uuid4().hex, inflight=inflight)
            calls = list(rollout.incomplete) + [IncompleteCall(m, INFLIGHT_REASON) for m in fence.inflight]
            # read back as CaptureStore reads its file: the readers' records, a damaged one reported
            records = [parse_record_line(orjson.dumps(r), i) for i, r in enumerate(rollout.records)]
            calls += [
                IncompleteCall(line["model_call_id"], damaged_line(i + 1))
                for i, (line, record) in enumerate(zip(rollout.records, records, strict=True))
                if record is None
            ]
            return CaptureSnapshot(
                rollout_id=rid,
                records=tuple(r for r in records if r is not None),
                tokens=tuple(dict(t) for t in rollout.tokens),
                incomplete=bool(calls),
                snapshot_id=fence.snapshot_id or "",
                version=rollout.version(),
                incomplete_calls=tuple(calls),
                damaged_lines=tuple(
                    InvalidLine(i + 1, "not a record", preview(orjson.dumps(line)))
                    for i, (line, record) in enumerate(zip(rollout.records, records, strict=True))
                    if record is None
                ),
                in_flight=fence.inflight,
                lost_calls=tuple(rollout.incomplete),
                marked=bool(rollout.incomplete),
            )

    def drop_now(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        rid = validate_rollout_id(rollout_id)
        with self._lock:
            rollout = self._get(rid)
            fence = rollout.fence
            if fence is None:
                return False
            if fence.kind == "retired":
                return fence.snapshot_id == snapshot_id and fence.version == version
            if fence.snapshot_id != snapshot_id or rollout.version() != version:
                return False
            self._retire_one(rid)
            return True

    # -- retire and delete -------------------------------------------------------------------------------

    def _retire_one(self, rid: str) -> bool:
        rollout = self._get(rid)
        had = rollout.has_records()
        fence = rollout.fence
        if fence is None or fence.kind != "retired":
            snapshot_id = fence.snapshot_id if fence is not None else None
            version = rollout.version() if fence is not None else None
            rollout.fence = _Fence("retired", self._event(rollout), snapshot_id, version)
        rollout.records, rollout.tokens, rollout.incomplete = [], [], []
        return had

    def retire_now(self, rollout_ids: Iterable[str]) -> RemovalResult:
        ids = validate_rollout_ids(rollout_ids)
        result = empty_result()
        with self._lock:
            for rid in ids:
                result["removed" if self._retire_one(rid) else "absent"].append(rid)
        return result

    def delete_now(self, rollout_ids: Iterable[str]) -> RemovalResult:
        ids = validate_rollout_ids(rollout_ids)
        result = empty_result()
        with self._lock:
            for rid in ids:
                rollout = self._get(rid)
                had = rollout.has_records() or rollout.fence is not None
                rollout.records, rollout.tokens, rollout.incomplete = [], [], []
                rollout.fence = None
                self._event(rollout)
                result["removed" if had else "absent"].append(rid)
        return result

    # -- async forms (nothing here blocks) ---------------------------------------------------------------

    async def freeze(self, rollout_id: str) -> CaptureSnapshot:
        await asyncio.sleep(0)
        return self.freeze_now(rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        await asyncio.sleep(0)
        return self.drop_now(rollout_id, snapshot_id=snapshot_id, version=version)

    async def retire(self, rollout_ids: Iterable[str]) -> RemovalResult:
        ids = validate_rollout_ids(rollout_ids)
        await asyncio.sleep(0)
        return self.retire_now(ids)

    async def delete(self, rollout_ids: Iterable[str]) -> RemovalResult:
        ids = validate_rollout_ids(rollout_ids)
        await asyncio.sleep(0)
        return self.delete_now(ids)
