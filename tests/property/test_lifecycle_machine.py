"""Random sequences of lifecycle operations against the file store and the in-memory backend at once,
each compared with a plain model of the lifecycle (docs/lifecycle.md) after every step."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from otel_capture import CaptureFrozenError, CaptureRetiredError, CaptureStore
from otel_capture.conformance import InMemoryCaptureBackend

IDS = ("a", "b", "c")
ids = st.sampled_from(IDS)
batches = st.lists(ids, max_size=4)


@dataclass
class Rollout:
    """The model: what a rollout holds and which fence guards it."""

    records: list[str] = field(default_factory=list)
    tokens: int = 0
    marks: list[str] = field(default_factory=list)
    begun: dict[str, int] = field(default_factory=dict)  # call -> epoch when it began
    fence: str | None = None  # "frozen" | "retired"
    epoch: int = 0  # advanced by every freeze, retire (that writes a fence), delete
    freeze_gen: int = 0
    frozen_inflight: tuple[str, ...] = ()
    retired_as: tuple[int, int] | None = None  # (freeze_gen, version) when retired from frozen

    @property
    def version(self) -> int:
        return len(self.records) + self.tokens + len(self.marks)

    def pending(self) -> set[str]:
        return {call for call, epoch in self.begun.items() if epoch >= self.epoch}

    def state(self) -> str:
        if self.fence is not None:
            return self.fence
        return "live" if self.version or self.pending() else "absent"


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="lifecycle-")
        self.backends: list[Any] = [CaptureStore(self.tmp), InMemoryCaptureBackend()]
        self.model = {rid: Rollout() for rid in IDS}
        self.calls = itertools.count()
        self.snapshots: dict[str, list[tuple[int, int, str]]] = {
            rid: [] for rid in IDS
        }  # gen, version, sid per backend

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _all(self, action: Any, expected_error: type[BaseException] | None) -> list[Any]:
        results = []
        for backend in self.backends:
            try:
                results.append(action(backend))
            except (CaptureFrozenError, ValueError) as exc:
                assert expected_error is not None and type(exc) is expected_error, (backend, exc)
                results.append(None)
            else:
                assert expected_error is None, (backend, "accepted", expected_error)
        return results

    @staticmethod
    def _refusal(m: Rollout, *, frozen_ok: bool = False) -> type[BaseException] | None:
        if m.fence == "retired":
            return CaptureRetiredError
        if m.fence == "frozen" and not frozen_ok:
            return CaptureFrozenError
        return None

    @rule(rid=ids, with_tokens=st.booleans())
    def write(self, rid: str, with_tokens: bool) -> None:
        m, call = self.model[rid], f"w{next(self.calls)}"
        tokens = {"prompt_token_ids": [1]} if with_tokens else None
        error = self._refusal(m)
        self._all(lambda b: b.append_now(rid, call, {"x": 1}, tokens), error)
        if error is None:
            m.records.append(call)
            m.tokens += with_tokens

    @rule(rid=ids)
    def begin(self, rid: str) -> None:
        m, call = self.model[rid], f"b{next(self.calls)}"
        error = self._refusal(m)
        self._all(lambda b: b.begin_call(rid, call), error)
        if error is None:
            m.begun[call] = m.epoch

    @rule(rid=ids, data=st.data())
    def finish(self, rid: str, data: st.DataObject) -> None:
        m = self.model[rid]
        if not m.begun:
            return
        call = data.draw(st.sampled_from(sorted(m.begun)))
        error = self._refusal(m)
        if error is None and m.begun[call] < m.epoch:
            error = CaptureRetiredError  # began before a freeze, retire or delete: late
        self._all(lambda b: b.append_now(rid, call, {"x": 2}), error)
        del m.begun[call]
        if error is None:
            m.records.append(call)

    @rule(rid=ids)
    def mark(self, rid: str) -> None:
        m = self.model[rid]
        call = min(m.begun) if m.begun else f"m{next(self.calls)}"
        error = self._refusal(m, frozen_ok=True)
        self._all(lambda b: b.mark_incomplete(rid, call, "lost"), error)
        if error is None:
            m.marks.append(call)
            m.begun.pop(call, None)

    @rule(rid=ids)
    def freeze(self, rid: str) -> None:
        m = self.model[rid]
        error = self._refusal(m, frozen_ok=True)
        if error is None and m.fence is None:
            m.frozen_inflight = tuple(sorted(m.pending()))
            m.fence, m.epoch, m.freeze_gen = "frozen", m.epoch + 1, m.freeze_gen + 1
        snaps = self._all(lambda b: b.freeze_now(rid), error)
        if error is not None:
            return
        self.snapshots[rid] = []
        for snap in snaps:
            assert [r.model_call_id for r in snap.records] == m.records
            assert len(snap.tokens) == m.tokens and snap.version == m.version
            assert snap.incomplete == bool(m.marks or m.frozen_inflight)
            named = sorted(c.model_call_id for c in snap.incomplete_calls)
            assert named == sorted(m.marks + list(m.frozen_inflight))
            self.snapshots[rid].append((m.freeze_gen, snap.version, snap.snapshot_id))

    @rule(rid=ids, stale=st.integers(0, 1))
    def drop(self, rid: str, stale: int) -> None:
        m = self.model[rid]
        if not self.snapshots[rid]:
            return
        gen, version = self.snapshots[rid][0][:2]
        version += stale
        if m.fence == "frozen":
            expected = gen == m.freeze_gen and version == m.version
        elif m.fence == "retired":
            expected = m.retired_as == (gen, version)
        else:
            expected = False
        for backend, (_, _, sid) in zip(self.backends, self.snapshots[rid], strict=False):
            assert backend.drop_now(rid, snapshot_id=sid, version=version) is expected
        if expected and m.fence == "frozen":
            self._retire_model(m)

    def _retire_model(self, m: Rollout) -> bool:
        had = bool(m.version)
        if m.fence != "retired":
            m.retired_as = (m.freeze_gen, m.version) if m.fence == "frozen" else None
            m.fence, m.epoch = "retired", m.epoch + 1
        m.records, m.tokens, m.marks = [], 0, []
        return had

    @rule(batch=batches)
    def retire(self, batch: list[str]) -> None:
        unique = list(dict.fromkeys(batch))
        removed = [rid for rid in unique if self._retire_model(self.model[rid])]
        expected = {"removed": removed, "absent": [r for r in unique if r not in removed], "failed": {}}
        for backend in self.backends:
            assert backend.retire_now(batch) == expected

    @rule(batch=batches)
    def delete(self, batch: list[str]) -> None:
        unique = list(dict.fromkeys(batch))
        removed = []
        for rid in unique:
            m = self.model[rid]
            if m.version or m.fence is not None:
                removed.append(rid)
            m.records, m.tokens, m.marks, m.fence, m.epoch = [], 0, [], None, m.epoch + 1
        expected = {"removed": removed, "absent": [r for r in unique if r not in removed], "failed": {}}
        for backend in self.backends:
            assert backend.delete_now(batch) == expected

    @invariant()
    def states_agree(self) -> None:
        expected = {rid: m.state() for rid, m in self.model.items() if m.state() != "absent"}
        for backend in self.backends:
            assert backend.list_rollouts() == expected, backend
            for rid, m in self.model.items():
                assert backend.rollout_state(rid) == m.state()


LifecycleMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestLifecycleMachine = LifecycleMachine.TestCase
