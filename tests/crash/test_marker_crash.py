"""A writer SIGKILLed while it keeps in-flight markers (contract D19): a kept marker whose calls have all
ended says nothing is in flight, to every reader; one whose call never ended says that call is."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from support import run_child

from otel_capture import CaptureStore
from otel_capture._store.dirstate import STATE_DIR

CHILD = Path(__file__).with_name("_marker_child.py")


def test_markers_a_killed_writer_kept_say_exactly_which_calls_are_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "calls"
    child = run_child(CHILD, str(root))
    assert child.returncode == -signal.SIGKILL, f"the child was not killed: {child.returncode} {child.stderr}"
    inflight = root / STATE_DIR / "inflight"
    assert sorted(os.listdir(inflight)) == ["ended.calls", "open.calls"]  # both kept when it died
    store = CaptureStore(root)
    assert store.calls_in_flight("ended") == {}
    assert list(store.calls_in_flight("open")) == ["c1"]
    assert store.list_rollouts() == {"ended": "live", "open": "live"}
    ended = store.freeze_now("ended")
    assert [r.model_call_id for r in ended.records] == ["c1"] and not ended.incomplete
    still = store.freeze_now("open")
    assert still.records == () and [c.model_call_id for c in still.incomplete_calls] == ["c1"]
