"""The conformance kit: both shipped backends pass, again and again; broken backends fail the right checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from otel_capture import CaptureRetiredError, CaptureStore
from otel_capture.conformance import CHECKS, InMemoryCaptureBackend, run_conformance


def test_the_file_store_passes_every_check_and_the_kit_reruns_on_the_same_directory(tmp_path: Path) -> None:
    for _ in range(2):
        report = run_conformance(lambda: CaptureStore(tmp_path))
        assert report.ok, str(report)
        assert len(report.passed) == len(CHECKS) >= 12
    assert CaptureStore(tmp_path).list_rollouts() == {}  # it cleans up after itself


def test_the_memory_backend_passes_every_check_and_reruns() -> None:
    backend = InMemoryCaptureBackend()
    assert run_conformance(lambda: backend).ok
    report = run_conformance(lambda: backend)
    assert report.ok, str(report)


class LateMarkAccepted(InMemoryCaptureBackend):
    """Accepts a mark_incomplete after retire (silently)."""

    def mark_incomplete(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        if self.rollout_state(rollout_id) == "retired":
            return
        super().mark_incomplete(rollout_id, model_call_id, reason)


class UntypedLateWrite(InMemoryCaptureBackend):
    """Refuses late writes with a plain RuntimeError."""

    def append_now(self, rollout_id: str, model_call_id: str, record: Any, tokens: Any = None) -> None:
        try:
            super().append_now(rollout_id, model_call_id, record, tokens)
        except CaptureRetiredError as exc:
            raise RuntimeError(str(exc)) from None


class FreezeFailsAfterRetire(InMemoryCaptureBackend):
    def freeze_now(self, rollout_id: str) -> Any:
        if self.rollout_state(rollout_id) == "retired":
            raise ConnectionError("backend unreachable")
        return super().freeze_now(rollout_id)


class Amnesiac(InMemoryCaptureBackend):
    """Acknowledges writes without keeping them."""

    def append_now(self, rollout_id: str, model_call_id: str, record: Any, tokens: Any = None) -> None:
        self.rollout_state(rollout_id)


def _failed(backend: InMemoryCaptureBackend) -> dict[str, str]:
    return {result.name: result.detail for result in run_conformance(lambda: backend).failed}


def test_a_backend_accepting_a_late_mark_after_retire_fails_unconditional_retirement() -> None:
    failed = _failed(LateMarkAccepted())
    assert list(failed) == ["unconditional_retirement"]
    assert "mark_incomplete after retirement was accepted" in failed["unconditional_retirement"]


def test_a_backend_with_an_untyped_late_write_error_fails_every_check_that_writes_late() -> None:
    failed = _failed(UntypedLateWrite())
    assert "unconditional_retirement" in failed
    assert "raised RuntimeError, not CaptureRetiredError" in failed["unconditional_retirement"]
    assert set(failed) == {
        "unconditional_retirement",
        "conditional_drop",
        "retire_frozen_and_absent",
        "delete_fences_in_flight_calls",
    }


def test_a_backend_whose_freeze_fails_after_retire_is_not_taken_for_an_empty_rollout() -> None:
    failed = _failed(FreezeFailsAfterRetire())
    assert list(failed) == ["unconditional_retirement"]
    assert "ConnectionError" in failed["unconditional_retirement"]


def test_every_failed_check_is_reported_not_only_the_first() -> None:
    report = run_conformance(lambda: Amnesiac())
    assert len(report.failed) >= 5 and not report.ok
    assert str(report).count("FAILED") == len(report.failed)
