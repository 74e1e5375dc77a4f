"""Rollout ids read back from the directory's own state (issue 30, item 2): a loss reserve's entries, the
fence journal, the in-flight markers. Each is checked against the front door's grammar before any file is
opened for it; a bad entry is reported once (the log of the writer that finds it, and ``check``) and set
aside, never adopted or marked again by a later writer; nothing is ever written outside the directory.

The reserves are planted as a writer that died would leave them (``.otel-capture/losses/*.losses``,
nobody holding their lock), in the format ``docs/durability.md`` describes (D13).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from support import submit

from otel_capture import CaptureStore
from otel_capture._store import JsonlWriter

RESERVE_BYTES = 64 * 1024
REASON = "OSError: ENOSPC No space left on device"
CLI = [sys.executable, "-m", "otel_capture._cli.main"]


def _plant_reserve(root: Path, rollout_ids: list[object], name: str = "999-deadbeef0000.losses") -> Path:
    """A dead writer's reserve: one pending entry per rollout id (``c-<n>`` each), zeros after them."""
    losses = root / ".otel-capture" / "losses"
    losses.mkdir(parents=True, exist_ok=True)
    entries = b"".join(
        b"!" + orjson.dumps({"rollout_id": rid, "calls": [f"c-{n}"], "reason": REASON, "at": 1.0}) + b"\n"
        for n, rid in enumerate(rollout_ids)
    )
    path = losses / name
    path.write_bytes(entries.ljust(RESERVE_BYTES, b"\0"))
    return path


def _check(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "check", str(root), *extra], capture_output=True, text=True, timeout=60)


def _marked(root: Path, rollout_id: str) -> list[str]:
    path = root / f"{rollout_id}.capture.incomplete"
    if not path.exists():
        return []
    return [orjson.loads(line)["model_call_id"] for line in path.read_bytes().splitlines() if line.strip()]


def _set_aside(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (root / ".otel-capture" / "losses").glob("*.set-aside")}


def _one_call(root: Path, rollout_id: str, mcid: str) -> None:
    writer = JsonlWriter(root)
    try:
        submit(writer, rollout_id, b'{"model_call_id":"%s"}\n' % mcid.encode(), mcid).result(60)
        assert writer.flush(60)
    finally:
        writer.close()


def test_reserve_entries_naming_bad_rollout_ids_are_set_aside_once_and_nothing_is_written_outside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "a" / "b" / "calls"  # its grandparent is tmp_path / "a"
    root.mkdir(parents=True)
    (root / "stuck.capture.incomplete").mkdir()  # a marker that can never be written: a directory
    bad = ["../../escape3", "../missing/escape4", "..", "", 7, "x/y", "-dash"]
    planted = _plant_reserve(root, ["r1", *bad, "stuck", "r2"])
    outside_before = sorted(p for p in tmp_path.rglob("*") if root not in (p, *p.parents))

    # before any writer: check names the good losses and the bad entries, and lists no bad id as a rollout
    before = _check(root)
    assert before.returncode == 1, before.stdout
    assert "r1: lost, not yet in the incomplete marker: c-0" in before.stdout
    assert "escape3" in before.stdout and "invalid rollout id" in before.stdout
    assert "../../escape3: lost" not in before.stdout
    assert "../../escape3" not in CaptureStore(root).rollout_ids()

    caplog.set_level(logging.WARNING, logger="otel_capture")
    _one_call(root, "other", "o1")  # its writer adopts the dead writer's reserve
    first_log = caplog.text
    caplog.clear()

    outside_after = sorted(p for p in tmp_path.rglob("*") if root not in (p, *p.parents))
    assert outside_after == outside_before  # nothing created outside the capture directory
    assert not list(tmp_path.rglob("escape3*")) and not list(tmp_path.rglob("escape4*"))
    assert _marked(root, "r1") == ["c-0"] and _marked(root, "r2") == [f"c-{len(bad) + 2}"]
    assert "escape3" in first_log and "set aside" in first_log  # said once, by the writer that found it
    assert not planted.exists()  # no longer a reserve any writer adopts
    assert not any(p.suffix == ".losses" for p in (root / ".otel-capture" / "losses").iterdir())

    after = _check(root)
    assert "escape3" in after.stdout and "set aside" in after.stdout
    assert "r1: lost" not in after.stdout and "r2: lost" not in after.stdout
    # the loss of "stuck" is named where it was set aside; its marker (a directory) is damage (D25)
    assert "stuck" in after.stdout and "c-" in after.stdout
    kept = _set_aside(root)
    assert kept  # the dead writer's reserve, renamed: its entries are named from there

    # a second writer neither adopts nor marks nor logs any of it again
    _one_call(root, "other", "o2")
    assert "escape3" not in caplog.text and "set aside" not in caplog.text
    assert _set_aside(root) == kept
    assert _marked(root, "r1") == ["c-0"] and _marked(root, "r2") == [f"c-{len(bad) + 2}"]
    assert sorted(p for p in tmp_path.rglob("*") if root not in (p, *p.parents)) == outside_before


def test_only_bad_entries_left_set_aside_do_not_fail_check_for_good(tmp_path: Path) -> None:
    root = tmp_path / "calls"
    root.mkdir()
    _plant_reserve(root, ["../../escape3"])
    assert _check(root).returncode == 1  # pending in an orphaned reserve: not yet looked at by a writer
    _one_call(root, "r", "c1")
    result = _check(root)
    assert result.returncode == 0, result.stdout  # set aside and named: no longer a pending loss
    assert "set aside" in result.stdout and "escape3" in result.stdout
    assert _check(root, "--strict").returncode == 1  # strict: anything set aside fails


def test_a_fence_journal_line_or_in_flight_marker_naming_a_bad_id_is_never_a_rollout(tmp_path: Path) -> None:
    root = tmp_path / "calls"
    store = CaptureStore(root)
    store.append_now("r", "c0", {"dialect": "chat"})
    store.begin_call("r", "c-begun")
    store.freeze_now("r")
    state = root / ".otel-capture"
    with (state / "fences.journal").open("ab") as journal:
        journal.write(orjson.dumps({"op": "freeze", "seq": 1000, "id": "../../escape5"}) + b"\n")
        journal.write(orjson.dumps({"op": "retire", "seq": 1001, "id": "../escape6"}) + b"\n")
    (state / "inflight" / "-bad.calls").write_bytes(b"+c9\n")
    (state / "inflight" / "..calls").write_bytes(b"+c8\n")

    fresh = CaptureStore(root)
    listed = fresh.list_rollouts()
    assert listed == {"r": "frozen"}
    result = subprocess.run([*CLI, "ls", str(root)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "escape" not in result.stdout and "-bad" not in result.stdout
    fresh.retire_now(list(fresh.list_rollouts("frozen")))  # what a trainer that lost track runs
    assert fresh.list_rollouts() == {"r": "retired"}
    assert not list(tmp_path.rglob("escape*"))
