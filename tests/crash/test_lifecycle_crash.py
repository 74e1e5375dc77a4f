"""Real child processes SIGKILLed at each point of a retire (and delete) batch: no rollout is ever left
without both its records and its fence, and running the same batch again finishes it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from support import run_child

from otel_capture import CaptureStore
from otel_capture._store.dirstate import STATE_DIR
from otel_capture._store.names import RECORD_SUFFIXES

CHILD = Path(__file__).with_name("_lifecycle_child.py")
IDS = [f"r{i}" for i in range(8)]

RETIRE_POINTS = [
    "retire_fencing",
    "journal_written",
    "journal_synced",
    "retire_fenced",
    "retire_removed_one#1",
    "retire_removed_one#5",
    "retire_synced",
]
DELETE_POINTS = ["delete_removed_one#1", "delete_removed_one#4", "journal_written", "journal_synced"]


def _prepare(root: Path) -> CaptureStore:
    store = CaptureStore(root)
    for i, rid in enumerate(IDS):
        store.append_now(rid, f"{rid}-c1", {"i": i}, {"prompt_token_ids": [i]})
        if i % 3 == 0:
            store.mark_incomplete(rid, f"{rid}-c2", "upstream died")
    store.freeze_now(IDS[1])
    store.retire_now([IDS[2]])  # already retired: its fence predates the batch
    return store


def _run_child(root: Path, operation: str, point: str) -> None:
    child = run_child(CHILD, str(root), operation, point, *IDS)
    assert child.returncode == -signal.SIGKILL, (
        f"the child never reached {point}: {child.returncode} {child.stderr}"
    )


def _has_records(store: CaptureStore, rid: str) -> bool:
    return any((store.root / (rid + suffix)).exists() for suffix in RECORD_SUFFIXES)


@pytest.mark.parametrize("point", RETIRE_POINTS)
def test_a_retire_killed_at_any_point_leaves_records_or_fence_and_a_retry_finishes(
    tmp_path: Path, point: str
) -> None:
    root = tmp_path / "calls"
    _prepare(root)
    _run_child(root, "retire_now", point)
    store = CaptureStore(root)  # what a restarted owner sees
    for rid in IDS:
        state = store.rollout_state(rid)
        assert _has_records(store, rid) or state == "retired", (rid, state)
        if not _has_records(store, rid) and rid != IDS[2]:
            assert state == "retired"
    again = store.retire_now(IDS)
    assert again["failed"] == {} and sorted(again["removed"] + again["absent"]) == sorted(IDS)
    assert store.list_rollouts() == dict.fromkeys(IDS, "retired")
    assert sorted(os.listdir(root)) == [STATE_DIR]


@pytest.mark.parametrize("point", DELETE_POINTS)
def test_a_delete_killed_at_any_point_never_brings_old_records_back_and_a_retry_finishes(
    tmp_path: Path, point: str
) -> None:
    root = tmp_path / "calls"
    _prepare(root)
    before = {rid: CaptureStore(root).rollout_state(rid) for rid in IDS}
    _run_child(root, "delete_now", point)
    store = CaptureStore(root)
    for rid in IDS:
        state = store.rollout_state(rid)
        if _has_records(store, rid):
            assert state == before[rid]  # untouched yet: its fence (if any) still guards it
        else:
            assert state in ("absent", before[rid]), (rid, state)
    again = store.delete_now(IDS)
    assert again["failed"] == {}
    assert store.list_rollouts() == {}
    assert sorted(os.listdir(root)) == [STATE_DIR]
