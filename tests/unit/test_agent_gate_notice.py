"""A gated agent helper that is off because nothing turned it on says so, once per process (issue 33: the
README's attachment snippet, copied without the setting, sent its calls uncorrelated without a word)."""

from __future__ import annotations

import logging
import threading

import pytest

from otel_capture import base_url_for_run, rollout_context_for_run, rollout_id_from_run, url_path_for_run
from otel_capture._correlation import agent

RUN = {"_ng_task_index": 3, "_ng_rollout_index": 0, "_ng_attempt_index": 1}
LOGGER = "otel_capture._correlation.agent"


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a new process: the notice not given yet, neither gate variable set."""
    monkeypatch.setattr(agent, "_off_told", threading.Event())
    monkeypatch.delenv("OTEL_CAPTURE_CORRELATION", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_MODEL_CALL_JSONL_DIR", raising=False)


def _notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


@pytest.mark.usefixtures("fresh_process")
def test_a_helper_off_by_default_warns_once_naming_how_to_turn_it_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert base_url_for_run("http://proxy:1", RUN) == "http://proxy:1"  # unchanged: off
        assert url_path_for_run("/v1/responses", RUN) == "/v1/responses"
        assert rollout_id_from_run(RUN) is None
        with rollout_context_for_run(RUN) as rollout_id:
            assert rollout_id is None
    [notice] = _notices(caplog)
    assert notice.startswith("base_url_for_run: rollout correlation is off")
    assert "OTEL_CAPTURE_CORRELATION=true" in notice
    assert "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR" in notice
    assert "enabled=True" in notice


@pytest.mark.usefixtures("fresh_process")
def test_a_helper_turned_off_in_code_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert base_url_for_run("http://proxy:1", RUN, enabled=False) == "http://proxy:1"
    assert _notices(caplog) == []


@pytest.mark.usefixtures("fresh_process")
def test_a_helper_turned_on_says_nothing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert base_url_for_run("http://proxy:1", RUN, enabled=True) == "http://proxy:1/ng-rollout/3-0-a1"
        monkeypatch.setenv("OTEL_CAPTURE_CORRELATION", "true")
        assert base_url_for_run("http://proxy:1/v1", RUN) == "http://proxy:1/ng-rollout/3-0-a1/v1"
    assert _notices(caplog) == []
