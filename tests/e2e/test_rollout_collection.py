"""The rollout-collection example end to end: the real tiny model, the capture proxy, the official OpenAI
SDK, a retry, rollout records with their calls attached, the captures retired."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from otel_capture import CaptureStore, maybe_rollout_id_from_run_body, read_model_call_records
from otel_capture.demo.tiny_model import TinyModel

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rollout_collection" / "collect.py"
TASKS = REPO / "examples" / "rollout_collection" / "tasks.jsonl"


def _collect(
    tiny_model: TinyModel, out: Path, capture_dir: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, str(EXAMPLE), "--upstream", tiny_model.base_url, "--out", str(out)]
    command += ["--capture-dir", str(capture_dir), "--max-tokens", "8", *extra]
    return subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": python_path},
    )


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_rollout_record_carries_exactly_its_own_calls(tiny_model: TinyModel, tmp_path: Path) -> None:
    out, capture_dir = tmp_path / "rollouts.jsonl", tmp_path / "calls"
    run = _collect(tiny_model, out, capture_dir)
    assert run.returncode == 0, run.stdout + run.stderr

    records = _records(out)
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    flaky = [i for i, task in enumerate(tasks) if task.get("environment_failures")]
    assert flaky == [2]  # the dataset's task whose first attempt crashes after one model call
    ids = [record["ng_model_call_capture"]["rollout_id"] for record in records]
    assert ids == ["0-0", "1-0", "3-0", "2-0-a1"]

    seen_calls: set[str] = set()
    for record in records:
        capture = record["ng_model_call_capture"]
        rollout_id = capture["rollout_id"]
        assert rollout_id == maybe_rollout_id_from_run_body(record)
        assert "gaps" not in capture, capture.get("gaps")
        calls = capture["calls"]
        # exactly the calls the agent made, in its order: the response ids it saw are the captured ones
        assert [call["response_id"] for call in calls] == [
            step["response_id"] for step in record["trajectory"]
        ]
        assert [call["dialect"] for call in calls] == ["chat", "responses"]
        assert [call["call_index"] for call in calls] == [0, 1]
        for call in calls:
            assert call["rollout_id"] == rollout_id  # the line's own record of where it was captured
            assert call["status_code"] == 200 and call["error_category"] is None
            assert call["tokens_out"] is not None and call["tokens_out"] > 0
            assert not {"request", "response", "request_raw", "response_raw"} & set(call)
        assert capture["metrics"]["num_calls"] == 2
        assert capture["metrics"]["tokens_out"] == sum(call["tokens_out"] for call in calls)
        ids_here = {call["model_call_id"] for call in calls}
        assert not ids_here & seen_calls
        seen_calls |= ids_here
        # the record's own fields are the task's and the agent's, untouched by the attachment
        task = tasks[record["_ng_task_index"]]
        assert {key: record[key] for key in task} == task
        assert record["reward"] in (0.0, 1.0)
    assert records[-1]["_ng_attempt_index"] == 1

    # Attached captures are retired; the failed first attempt of task 2 keeps its one call, which no
    # record carries.
    store = CaptureStore(capture_dir)
    assert store.rollout_ids() == ["2-0"]
    [failed_call] = read_model_call_records(store, "2-0")
    assert failed_call.dialect == "chat" and failed_call.model_call_id not in seen_calls
    assert "failed attempts (captures kept" in run.stdout and "2-0" in run.stdout

    # each attached rollout's verdict is printed with it, and their counts last
    verdicts = {
        r["ng_model_call_capture"]["rollout_id"]: r["ng_model_call_capture"]["health"] for r in records
    }
    for rollout_id, health in verdicts.items():
        assert health["verdict"] in ("healthy", "unhealthy")
        assert f"  {rollout_id}: 2 calls attached, {health['verdict']}" in run.stdout
    healthy = sum(h["verdict"] == "healthy" for h in verdicts.values())
    assert (
        f"Rollout health: 4 checked, {healthy} healthy, {4 - healthy} unhealthy, 0 unobserved" in run.stdout
    )


def test_a_rerun_clears_the_previous_attempts_captures(tiny_model: TinyModel, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"question": "Name a colour.", "expected": "blue", "environment_failures": 1}\n')
    capture_dir = tmp_path / "calls"
    first = _collect(
        tiny_model, tmp_path / "first.jsonl", capture_dir, "--tasks", str(tasks), "--max-attempts", "1"
    )
    assert first.returncode == 1, first.stdout + first.stderr  # the task never got a second attempt
    assert "no record after 1 attempts: 0-0" in first.stderr
    store = CaptureStore(capture_dir)
    [first_call] = read_model_call_records(store, "0-0")

    second = _collect(
        tiny_model, tmp_path / "second.jsonl", capture_dir, "--tasks", str(tasks), "--max-attempts", "1"
    )
    assert second.returncode == 1, second.stdout + second.stderr
    # cleared before dispatch: 0-0 holds the second run's call only, not both runs' calls
    [second_call] = read_model_call_records(store, "0-0")
    assert second_call.model_call_id != first_call.model_call_id
    assert (tmp_path / "second.jsonl").read_text() == ""
