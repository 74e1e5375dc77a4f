"""The few notices that must reach the user although the host silenced logging (vLLM sets the root logger
to ERROR): logged as usual where logging lets them through, written to stderr where only the root's level
holds them back, and silent where the user set a level for otel_capture's own loggers."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from otel_capture._notices import notify
from otel_capture._settings import CaptureSettings

LOGGER = logging.getLogger("otel_capture._capture.middleware")


@pytest.fixture
def root_at_error() -> Iterator[None]:
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # what vLLM's import does
    yield
    root.setLevel(level)


def test_a_warning_reaches_stderr_when_the_root_logger_is_at_error(
    root_at_error: None, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    notify(LOGGER, logging.WARNING, "a %s model call has no rollout id", "chat")
    assert (
        capsys.readouterr().err
        == "WARNING otel_capture._capture.middleware: a chat model call has no rollout id\n"
    )
    assert caplog.records == []  # not through the host's logging, which would drop it


def test_a_bad_setting_is_seen_with_the_root_logger_at_error(
    root_at_error: None, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = CaptureSettings.from_environ({"OTEL_CAPTURE_MAX_BODY_BYTES": "lots"})
    assert settings == CaptureSettings.from_environ({})  # ignored: the default
    err = capsys.readouterr().err
    assert "WARNING otel_capture._settings: ignoring OTEL_CAPTURE_MAX_BODY_BYTES='lots'" in err


def test_a_capture_failure_with_its_traceback(
    root_at_error: None, capsys: pytest.CaptureFixture[str]
) -> None:
    logging.getLogger().setLevel(logging.CRITICAL)
    try:
        raise OSError("disk gone")
    except OSError:
        notify(LOGGER, logging.ERROR, "model-call capture failed", exc_info=True)
    err = capsys.readouterr().err
    assert err.startswith("ERROR otel_capture._capture.middleware: model-call capture failed\nTraceback")
    assert "OSError: disk gone" in err


def test_where_logging_lets_it_through_it_is_logged_once(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        notify(LOGGER, logging.WARNING, "seen %d", 1)
    assert [r.getMessage() for r in caplog.records] == ["seen 1"]
    assert "seen 1" not in capsys.readouterr().err


def test_a_level_the_user_set_for_otel_capture_is_obeyed(
    root_at_error: None, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = logging.getLogger("otel_capture")
    ours.setLevel(logging.ERROR)
    try:
        notify(LOGGER, logging.WARNING, "hidden on purpose")
    finally:
        ours.setLevel(logging.NOTSET)
    assert capsys.readouterr().err == ""
