"""Agent-side helpers: NeMo Gym's id rules (checked against the one grammar), the gate, the URL prefix."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from otel_capture import (
    CorrelationSettings,
    InvalidRolloutIdError,
    base_url_for_run,
    capture_correlation_enabled,
    current_rollout_id,
    maybe_rollout_id_from_run_body,
    resolve_model_base_url,
    rollout_context_for_run,
    rollout_id_from_run,
    url_path_for_request,
    url_path_for_run,
)

RUN = {"_ng_task_index": 3, "_ng_rollout_index": 1, "responses_create_params": {"input": "hi"}}


# --- ids: NeMo Gym's examples, then ours -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"_ng_task_index": 0, "_ng_rollout_index": 0}, "0-0"),
        ({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 1}, "0-0-a1"),
        ({"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": 0}, "0-0"),
        ({"_ng_task_index": 7, "_ng_rollout_index": 2, "_ng_attempt_index": "3"}, "7-2-a3"),
        ({"_ng_rollout_id": "run42.task-3", "_ng_attempt_index": 2}, "run42.task-3-a2"),
        # the explicit id wins over the indices
        ({"_ng_rollout_id": "mine", "_ng_task_index": 0, "_ng_rollout_index": 0}, "mine"),
        ({"_ng_rollout_id": None, "_ng_task_index": 4, "_ng_rollout_index": 5}, "4-5"),
    ],
)
def test_rollout_id_rules(body: dict[str, Any], expected: str) -> None:
    assert maybe_rollout_id_from_run_body(body) == expected
    assert rollout_id_from_run(body, enabled=True) == expected


@pytest.mark.parametrize(
    "body",
    [{}, {"_ng_task_index": 0}, {"_ng_rollout_index": 0}, {"_ng_attempt_index": 1}, {"input": "x"}],
)
def test_no_rollout_named(body: dict[str, Any]) -> None:
    assert maybe_rollout_id_from_run_body(body) is None
    assert url_path_for_run("/v1/responses", body, enabled=True) == "/v1/responses"
    assert base_url_for_run("http://h:1", body, enabled=True) == "http://h:1"


@pytest.mark.parametrize(
    "body",
    [
        {"_ng_rollout_id": ".hidden"},
        {"_ng_rollout_id": "a/b"},
        {"_ng_rollout_id": ""},
        {"_ng_rollout_id": 5},
        {"_ng_rollout_id": "x" * 201},
        # the -a<n> suffix pushes a 199-character id past the 200-character limit
        {"_ng_rollout_id": "x" * 199, "_ng_attempt_index": 1},
        # derived ids follow the grammar too (NeMo Gym does not check them)
        {"_ng_task_index": "a b", "_ng_rollout_index": 0},
        {"_ng_task_index": -1, "_ng_rollout_index": 0},
        {"_ng_task_index": "../x", "_ng_rollout_index": 0},
    ],
)
def test_invalid_ids_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRolloutIdError):
        maybe_rollout_id_from_run_body(body)
    with pytest.raises(ValueError, match="invalid rollout id"):
        url_path_for_run("/v1/responses", body, enabled=True)


def test_attempt_index_that_is_not_an_integer_is_refused() -> None:
    with pytest.raises(ValueError, match="_ng_attempt_index"):
        maybe_rollout_id_from_run_body(
            {"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_attempt_index": "x"}
        )


def test_longest_valid_id_with_its_attempt_suffix() -> None:
    body = {"_ng_rollout_id": "x" * 197, "_ng_attempt_index": 9}
    assert maybe_rollout_id_from_run_body(body) == "x" * 197 + "-a9"


class _StrictRun(BaseModel):
    capture_rollout_id: str | None = None


class _ExtraRun(BaseModel):
    model_config = ConfigDict(extra="allow")


def test_pydantic_run_bodies() -> None:
    assert maybe_rollout_id_from_run_body(_StrictRun(capture_rollout_id="r-1")) == "r-1"
    assert maybe_rollout_id_from_run_body(_StrictRun()) is None
    extra = _ExtraRun.model_validate({"_ng_task_index": 2, "_ng_rollout_index": 0, "_ng_attempt_index": 1})
    assert maybe_rollout_id_from_run_body(extra) == "2-0-a1"


# --- the gate --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "enabled"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": "/data/calls"}, True),
        ({"OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": "  "}, False),
        ({"OTEL_CAPTURE_CORRELATION": "true"}, True),
        ({"OTEL_CAPTURE_CORRELATION": "1"}, True),
        ({"OTEL_CAPTURE_CORRELATION": "false", "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": "/d"}, False),
        ({"OTEL_CAPTURE_CORRELATION": "off", "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": "/d"}, False),
        ({"OTEL_CAPTURE_CORRELATION": "yes"}, True),
    ],
)
def test_gate_from_the_environment(environ: dict[str, str], enabled: bool) -> None:
    assert CorrelationSettings.from_environ(environ).enabled is enabled


def test_gate_argument_wins_over_the_environment() -> None:
    on = {"OTEL_CAPTURE_CORRELATION": "true"}
    assert CorrelationSettings.from_environ(on, enabled=False).enabled is False
    assert CorrelationSettings.from_environ({}, enabled=True).enabled is True


def test_bad_gate_value_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_capture._correlation.agent"):
        settings = CorrelationSettings.from_environ(
            {"OTEL_CAPTURE_CORRELATION": "maybe", "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": "/d"}
        )
    assert settings.enabled is True  # decided by the capture directory, as if the variable were unset
    assert "OTEL_CAPTURE_CORRELATION" in caplog.text and "maybe" in caplog.text
    assert CorrelationSettings.from_environ({"OTEL_CAPTURE_CORRELATION": "maybe"}).enabled is False


def test_helpers_read_the_gate_from_the_environment_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_CAPTURE_CORRELATION", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_MODEL_CALL_JSONL_DIR", raising=False)
    assert not capture_correlation_enabled()
    assert rollout_id_from_run(RUN) is None
    monkeypatch.setenv("OTEL_CAPTURE_CORRELATION", "1")
    assert capture_correlation_enabled()
    assert rollout_id_from_run(RUN) == "3-1"
    assert url_path_for_run("/v1/chat/completions", RUN) == "/ng-rollout/3-1/v1/chat/completions"


def test_gated_helpers_when_off() -> None:
    # Off, the body is not even looked at: an id that would be refused is not an error.
    bad = {"_ng_rollout_id": "a/b"}
    assert rollout_id_from_run(bad, enabled=False) is None
    assert url_path_for_run("/v1/responses", bad, enabled=False) == "/v1/responses"
    assert base_url_for_run("http://h:1/", bad, enabled=False) == "http://h:1/"
    with rollout_context_for_run(bad, enabled=False) as rollout_id:
        assert rollout_id is None
        assert current_rollout_id() is None


def test_gated_helpers_when_on() -> None:
    assert rollout_id_from_run(RUN, enabled=True) == "3-1"
    assert url_path_for_run("/v1/responses", RUN, enabled=True) == "/ng-rollout/3-1/v1/responses"
    assert url_path_for_run("v1/messages", RUN, enabled=True) == "/ng-rollout/3-1/v1/messages"
    assert base_url_for_run("http://h:1", RUN, enabled=True) == "http://h:1/ng-rollout/3-1"
    assert base_url_for_run("http://h:1/", RUN, enabled=True) == "http://h:1/ng-rollout/3-1"
    # an OpenAI-style base URL keeps /v1 last, where the SDK expects it
    assert base_url_for_run("http://h:1/v1", RUN, enabled=True) == "http://h:1/ng-rollout/3-1/v1"


def test_rollout_context_for_run_sets_and_restores_the_current_rollout() -> None:
    assert current_rollout_id() is None
    with rollout_context_for_run(RUN, enabled=True) as rollout_id:
        assert rollout_id == current_rollout_id() == "3-1"
        with rollout_context_for_run({**RUN, "_ng_attempt_index": 1}, enabled=True):
            assert current_rollout_id() == "3-1-a1"
        with rollout_context_for_run(RUN, enabled=False):
            assert current_rollout_id() is None  # off: no rollout is current inside the block
        assert current_rollout_id() == "3-1"
    assert current_rollout_id() is None


def test_rollout_context_for_run_refuses_an_invalid_id() -> None:
    with (
        pytest.raises(InvalidRolloutIdError),
        rollout_context_for_run({"_ng_rollout_id": "a b"}, enabled=True),
    ):
        pass
    assert current_rollout_id() is None


# --- not gated -------------------------------------------------------------------------------------------


def _request(path: str, path_params: dict[str, str] | None = None) -> Request:
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "headers": [],
        "query_string": b"",
    }
    if path_params is not None:
        scope["path_params"] = path_params
    return Request(scope)


def test_url_path_for_request_copies_the_inbound_prefix() -> None:
    inbound = _request("/ng-rollout/7-0-a1/v1/responses")
    assert url_path_for_request("/v1/chat/completions", inbound) == "/ng-rollout/7-0-a1/v1/chat/completions"
    # NeMo Gym's prefixed twin route: the id is a path parameter
    routed = _request("/ng-rollout/r1/v1/responses", {"rollout_id": "r1"})
    assert url_path_for_request("/v1/responses", routed) == "/ng-rollout/r1/v1/responses"
    # a raw ASGI scope works too
    assert url_path_for_request("/v1/messages", inbound.scope) == "/ng-rollout/7-0-a1/v1/messages"


def test_url_path_for_request_is_not_gated_and_leaves_unprefixed_paths() -> None:
    assert url_path_for_request("/v1/responses", None) == "/v1/responses"
    assert url_path_for_request("/v1/responses", _request("/v1/responses")) == "/v1/responses"
    assert url_path_for_request("/v1/responses", _request("/run")) == "/v1/responses"


def test_url_path_for_request_refuses_an_invalid_inbound_id() -> None:
    with pytest.raises(InvalidRolloutIdError):
        url_path_for_request("/v1/responses", _request("/ng-rollout/a%2Fb/v1/responses"))


def test_resolve_model_base_url_is_not_gated() -> None:
    assert resolve_model_base_url("http://h:8000", "0-0") == "http://h:8000/ng-rollout/0-0/v1"
    assert resolve_model_base_url("http://h:8000/", "0-0-a2") == "http://h:8000/ng-rollout/0-0-a2/v1"
    assert resolve_model_base_url("http://h:8000/v1", "0-0") == "http://h:8000/ng-rollout/0-0/v1"
    assert resolve_model_base_url("http://h:8000") == "http://h:8000/v1"
    assert resolve_model_base_url("http://h:8000/v1/", None) == "http://h:8000/v1"
    # callers pass rollout_id_from_run(body): None when the gate is off
    assert (
        resolve_model_base_url("http://h:8000", rollout_id_from_run(RUN, enabled=False)) == "http://h:8000/v1"
    )
    with pytest.raises(InvalidRolloutIdError):
        resolve_model_base_url("http://h:8000", "bad id")
