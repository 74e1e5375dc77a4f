"""The capture-lifecycle conformance kit: prove that a backend follows ``docs/lifecycle.md`` (contract L18).

::

    from . import CaptureStore
    from .conformance import InMemoryCaptureBackend, run_conformance

    report = run_conformance(lambda: CaptureStore("/data/calls"))
    assert report.ok, report

``factory`` returns a *fresh client* over one shared backend each time it is called (checks write through
one client and read through another, as a trainer and a model server do). Every check runs, whatever the
others did, and the report lists every failed check with what it saw. Each check works on its own rollout
id (``<prefix>-<check>``) that it deletes first and last, so the kit can run again and again against the
same persistent backend.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._errors import CheckFailed
from ._store import (
    VERBS,
    CaptureBackend,
    CaptureFrozenError,
    CaptureRetiredError,
    InMemoryCaptureBackend,
    RemovalResult,
)

_logger = logging.getLogger(__name__)

__all__ = ["CaptureBackend", "CheckResult", "ConformanceReport", "InMemoryCaptureBackend", "run_conformance"]


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class ConformanceReport:
    results: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        return all(result.passed for result in self.results)

    @property
    def passed(self) -> list[str]:
        return [result.name for result in self.results if result.passed]

    @property
    def failed(self) -> list[CheckResult]:
        return [result for result in self.results if not result.passed]

    def __str__(self) -> str:
        lines = [f"{len(self.passed)}/{len(self.results)} lifecycle checks passed"]
        lines += [f"FAILED {result.name}: {result.detail}" for result in self.failed]
        return "\n".join(lines)


Factory = Callable[[], CaptureBackend]


def _expect(condition: bool, detail: str) -> None:
    if not condition:
        raise CheckFailed(detail)


def _raises(kind: type[BaseException], action: str, fn: Callable[[], Any]) -> None:
    """``fn`` must raise exactly ``kind`` (a subclass of it passes; a parent class does not)."""
    try:
        fn()
    except kind:
        return
    except Exception as exc:
        raise CheckFailed(f"{action} raised {type(exc).__name__}, not {kind.__name__}") from exc
    raise CheckFailed(f"{action} was accepted; it must raise {kind.__name__}")


def _raises_exactly(kind: type[BaseException], action: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:
        if type(exc) is not kind:
            raise CheckFailed(f"{action} raised {type(exc).__name__}, not {kind.__name__}") from exc
        return
    raise CheckFailed(f"{action} was accepted; it must raise {kind.__name__}")


def _write(client: CaptureBackend, rid: str, n: int, *, tokens: bool = True) -> list[str]:
    ids = []
    for i in range(n):
        mcid = f"call-{i}-{uuid.uuid4().hex[:8]}"
        client.append_now(rid, mcid, {"i": i}, {"prompt_token_ids": [1, 2, i]} if tokens else None)
        ids.append(mcid)
    return ids


# --- the checks ---------------------------------------------------------------------------------------


def _offers_every_verb(factory: Factory, rid: str) -> None:
    """The client has every verb of :class:`CaptureBackend` (the protocol both backends declare)."""
    client = factory()
    missing = [verb for verb in VERBS if not callable(getattr(client, verb, None))]
    _expect(not missing and isinstance(client, CaptureBackend), f"the backend lacks {', '.join(missing)}")


def _write_then_freeze(factory: Factory, rid: str) -> None:
    ids = _write(factory(), rid, 2)
    _expect(factory().rollout_state(rid) == "live", "a written rollout is not live")
    snap = factory().freeze_now(rid)
    _expect([r.model_call_id for r in snap.records] == ids, f"records {snap.records!r} != calls {ids}")
    _expect(
        [r.call_index for r in snap.records] == list(range(len(ids))),
        f"call_index {[r.call_index for r in snap.records]} is not the append order",
    )
    _expect(len(snap.tokens) == 2, f"expected 2 token lines, got {len(snap.tokens)}")
    _expect(not snap.incomplete, f"a clean rollout froze incomplete: {snap.incomplete_calls}")
    _expect(
        bool(snap.snapshot_id) and snap.version == 4,
        f"snapshot id {snap.snapshot_id!r}, version {snap.version}",
    )
    again = factory().freeze_now(rid)
    _expect((again.snapshot_id, again.version) == (snap.snapshot_id, snap.version), "a repeat freeze differs")
    _expect(factory().rollout_state(rid) == "frozen", "a frozen rollout is not reported frozen")


def _freeze_fences_writes(factory: Factory, rid: str) -> None:
    _write(factory(), rid, 1)
    snap = factory().freeze_now(rid)
    _raises_exactly(CaptureFrozenError, "a write after freeze", lambda: factory().append_now(rid, "late", {}))
    _raises_exactly(
        CaptureFrozenError, "a begin_call after freeze", lambda: factory().begin_call(rid, "late")
    )
    again = factory().freeze_now(rid)
    _expect(again.version == snap.version and len(again.records) == 1, "a refused write changed the snapshot")


def _mark_incomplete_after_freeze(factory: Factory, rid: str) -> None:
    _write(factory(), rid, 1)
    snap = factory().freeze_now(rid)
    factory().mark_incomplete(rid, "lost-call", "upstream died")
    again = factory().freeze_now(rid)
    _expect(again.incomplete, "a mark after freeze is not seen by a fresh client")
    _expect(
        any(c.model_call_id == "lost-call" for c in again.incomplete_calls), "the mark's call is not named"
    )
    _expect(again.version != snap.version, "a mark after freeze did not change the version")
    _expect(
        not factory().drop_now(rid, snapshot_id=snap.snapshot_id, version=snap.version), "a stale drop won"
    )
    _expect(
        factory().drop_now(rid, snapshot_id=again.snapshot_id, version=again.version), "the exact drop lost"
    )


def _conditional_drop(factory: Factory, rid: str) -> None:
    _write(factory(), rid, 1)
    _expect(not factory().drop_now(rid, snapshot_id="nope", version=0), "drop of a live rollout succeeded")
    snap = factory().freeze_now(rid)
    _expect(
        not factory().drop_now(rid, snapshot_id="other", version=snap.version), "a wrong snapshot id dropped"
    )
    _expect(
        not factory().drop_now(rid, snapshot_id=snap.snapshot_id, version=snap.version + 1),
        "a wrong version dropped",
    )
    _expect(len(factory().freeze_now(rid).records) == 1, "a refused drop lost the evidence")
    _expect(
        factory().drop_now(rid, snapshot_id=snap.snapshot_id, version=snap.version), "the exact drop failed"
    )
    _expect(factory().rollout_state(rid) == "retired", "a dropped rollout is not retired")
    _expect(
        factory().drop_now(rid, snapshot_id=snap.snapshot_id, version=snap.version), "a repeated drop failed"
    )
    _raises(CaptureRetiredError, "a write after drop", lambda: factory().append_now(rid, "late", {}))


def _begin_call_masks_freeze(factory: Factory, rid: str) -> None:
    factory().begin_call(rid, "in-flight")
    done = _write(factory(), rid, 1)
    factory().begin_call(rid, "recorded")
    factory().append_now(rid, "recorded", {})
    snap = factory().freeze_now(rid)
    _expect(snap.incomplete, "a call in flight at freeze did not make the snapshot incomplete")
    named = [c.model_call_id for c in snap.incomplete_calls]
    _expect(named == ["in-flight"], f"incomplete calls {named}, expected only the one in flight ({done})")


def _unconditional_retirement(factory: Factory, rid: str) -> None:
    _write(factory(), rid, 2)
    result = factory().retire_now([rid])
    _expect(result["removed"] == [rid] and result["absent"] == [], f"retire of a live rollout said {result}")
    _expect(factory().rollout_state(rid) == "retired", "a retired rollout is not reported retired")
    _raises_exactly(
        CaptureRetiredError, "a late write after retirement", lambda: factory().append_now(rid, "x", {})
    )
    _raises_exactly(
        CaptureRetiredError, "a late begin_call after retirement", lambda: factory().begin_call(rid, "x")
    )
    _raises_exactly(
        CaptureRetiredError,
        "a late mark_incomplete after retirement",
        lambda: factory().mark_incomplete(rid, "x", "r"),
    )
    try:
        snap = factory().freeze_now(rid)
    except CaptureRetiredError:
        pass
    except Exception as exc:
        raise CheckFailed(f"freeze after retirement raised {type(exc).__name__}: {exc}") from exc
    else:
        _expect(not snap.records and not snap.tokens, "freeze after retirement returned records")
    again = factory().retire_now([rid])
    _expect(again["removed"] == [] and again["absent"] == [rid], f"a repeated retire said {again}")


def _retire_frozen_and_absent(factory: Factory, rid: str) -> None:
    frozen, absent = rid, rid + "-never"
    factory().delete_now([absent])
    _write(factory(), frozen, 1)
    snap = factory().freeze_now(frozen)
    result = factory().retire_now([frozen, absent, frozen])
    _expect(result["removed"] == [frozen] and result["absent"] == [absent], f"retire said {result}")
    for r in (frozen, absent):
        _expect(factory().rollout_state(r) == "retired", f"{r} is not retired")
    _expect(
        factory().drop_now(frozen, snapshot_id=snap.snapshot_id, version=snap.version),
        "drop of the consumed snapshot after a retire is not True",
    )
    _raises(
        CaptureRetiredError,
        "a write to a never-seen retired rollout",
        lambda: factory().append_now(absent, "x", {}),
    )
    factory().delete_now([absent])


def _delete_clears_retirement(factory: Factory, rid: str) -> None:
    _write(factory(), rid, 2)
    factory().retire_now([rid])
    result = factory().delete_now([rid])
    _expect(result["removed"] == [rid], f"delete of a fenced rollout said {result}")
    _expect(factory().rollout_state(rid) == "absent", "a deleted rollout is not absent")
    ids = _write(factory(), rid, 1)
    snap = factory().freeze_now(rid)
    _expect([r.model_call_id for r in snap.records] == ids, "a reused id did not start from empty")
    _expect(factory().delete_now([rid])["removed"] == [rid], "delete of a frozen rollout did not remove it")
    _expect(
        factory().delete_now([rid]) == {"removed": [], "absent": [rid], "failed": {}}, "a repeated delete"
    )


def _delete_fences_in_flight_calls(factory: Factory, rid: str) -> None:
    factory().begin_call(rid, "old-attempt")
    factory().delete_now([rid])
    _raises(
        CaptureRetiredError,
        "a write of a call begun before delete",
        lambda: factory().append_now(rid, "old-attempt", {}),
    )
    _expect(factory().rollout_state(rid) == "absent", "a late write after delete made the rollout live")


def _batch_validation(factory: Factory, rid: str) -> None:
    _write(factory(), rid, 1)
    client = factory()
    operations: list[tuple[str, Callable[[Any], RemovalResult]]] = [
        ("retire_now", client.retire_now),
        ("delete_now", client.delete_now),
    ]
    for name, op in operations:
        _raises(TypeError, f"{name} of a bare string", functools.partial(op, rid))
        _raises(ValueError, f"{name} of a batch with a bad id", functools.partial(op, [rid, "../bad"]))
        _expect(factory().rollout_state(rid) == "live", f"a refused {name} batch changed a valid id")
        _expect(op([]) == {"removed": [], "absent": [], "failed": {}}, f"{name} of an empty batch")
    _raises(ValueError, "freeze of a bad id", lambda: client.freeze_now("../bad"))


def _list_rollouts(factory: Factory, rid: str) -> None:
    live, frozen, retired = rid + "-l", rid + "-f", rid + "-r"
    factory().delete_now([live, frozen, retired])
    for r in (live, frozen, retired):
        _write(factory(), r, 1)
    factory().freeze_now(frozen)
    factory().retire_now([retired])
    listing = factory().list_rollouts()
    seen = {r: listing.get(r) for r in (live, frozen, retired)}
    _expect(seen == {live: "live", frozen: "frozen", retired: "retired"}, f"list_rollouts said {seen}")
    _expect(
        retired in factory().list_rollouts("retired") and live not in factory().list_rollouts("retired"),
        "filter",
    )
    factory().delete_now([live, frozen, retired])
    _expect(not {live, frozen, retired} & set(factory().list_rollouts()), "deleted rollouts are still listed")


def _async_forms(factory: Factory, rid: str) -> None:
    _write(factory(), rid, 1)

    async def run() -> None:
        client = factory()
        snap = await client.freeze(rid)
        _expect(len(snap.records) == 1, "async freeze lost a record")
        _expect(
            await client.drop(rid, snapshot_id=snap.snapshot_id, version=snap.version), "async drop failed"
        )
        again = await client.retire([rid])
        _expect(again["absent"] == [rid], f"async retire said {again}")
        deleted = await client.delete([rid])
        _expect(deleted["removed"] == [rid], f"async delete said {deleted}")

    asyncio.run(run())


CHECKS: tuple[tuple[str, Callable[[Factory, str], None]], ...] = (
    ("offers_every_verb", _offers_every_verb),
    ("write_then_freeze", _write_then_freeze),
    ("freeze_fences_writes", _freeze_fences_writes),
    ("mark_incomplete_after_freeze", _mark_incomplete_after_freeze),
    ("conditional_drop", _conditional_drop),
    ("begin_call_masks_freeze", _begin_call_masks_freeze),
    ("unconditional_retirement", _unconditional_retirement),
    ("retire_frozen_and_absent", _retire_frozen_and_absent),
    ("delete_clears_retirement", _delete_clears_retirement),
    ("delete_fences_in_flight_calls", _delete_fences_in_flight_calls),
    ("batch_validation", _batch_validation),
    ("list_rollouts", _list_rollouts),
    ("async_forms", _async_forms),
)


def run_conformance(factory: Factory, *, prefix: str = "conformance") -> ConformanceReport:
    """Run every check against the backend ``factory`` opens; never stops at the first failure.

    Call it from synchronous code (the async check runs its own event loop)."""
    results = []
    for name, check in CHECKS:
        rid = f"{prefix}-{name.replace('_', '-')}"
        try:
            factory().delete_now([rid])
            check(factory, rid)
        except CheckFailed as exc:
            results.append(CheckResult(name, False, str(exc)))
        except Exception as exc:  # any error of the backend fails the check, never the kit
            results.append(CheckResult(name, False, f"unexpected {type(exc).__name__}: {exc}"))
        else:
            results.append(CheckResult(name, True))
        finally:
            try:
                factory().delete_now([rid])
            except Exception:  # the check's own result already says what is wrong
                _logger.debug("conformance clean-up of %s failed", rid, exc_info=True)
    return ConformanceReport(tuple(results))
