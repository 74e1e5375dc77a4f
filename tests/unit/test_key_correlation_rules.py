"""The rollout id from the API key or ``x-session-id`` (issue 22 item 4), the pure parts: the settings, the
place of each carrier in the order, the key replaced upstream. End to end:
tests/integration/test_key_correlation.py."""

from __future__ import annotations

from typing import Any

import pytest

from otel_capture import CaptureSettings
from otel_capture._correlation import Correlation, RolloutRules, correlate
from otel_capture._correlation.ids import match_api_key
from otel_capture._errors import ConfigurationError
from otel_capture._key_pattern import ApiKeyRolloutPattern

PATTERN = ApiKeyRolloutPattern.compile(r"rk-(?P<rollout>[A-Za-z0-9_-]+)\.[A-Za-z0-9]+")
KEY = "rk-r-7.S3cretPart"
BOTH = RolloutRules(PATTERN, session_id=True)


def _scope(path: str = "/v1/chat/completions", method: str = "POST", **headers: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
    }


def _found(scope: dict[str, Any], rules: RolloutRules = BOTH) -> Correlation:
    found = correlate(scope, rules)
    assert isinstance(found, Correlation)
    return found


def test_off_by_default() -> None:
    found = _found(_scope(authorization=f"Bearer {KEY}", x_session_id="s-1"), RolloutRules())
    assert found.rollout_id is None and not found.captured


@pytest.mark.parametrize(
    ("path", "headers", "expected"),
    [
        (
            "/ng-rollout/from-prefix/v1/chat/completions",
            {"x_rollout_id": "from-header"},
            ("from-prefix", "url_prefix"),
        ),
        ("/v1/chat/completions", {"x_rollout_id": "from-header"}, ("from-header", "header")),
        ("/v1/chat/completions", {}, ("r-7", "api_key")),
    ],
)
def test_the_key_comes_after_the_prefix_and_the_header(
    path: str, headers: dict[str, str], expected: tuple[str, str]
) -> None:
    found = _found(
        _scope(path, authorization=f"Bearer {KEY}", x_session_id="s-1", baggage="rollout.id=b-1", **headers)
    )
    assert (found.rollout_id, found.source) == expected


def test_then_the_session_id_then_baggage() -> None:
    found = _found(_scope(x_session_id="s-1", baggage="rollout.id=b-1"))
    assert (found.rollout_id, found.source) == ("s-1", "session_id")
    found = _found(_scope(authorization="Bearer not-a-rollout-key", baggage="rollout.id=b-1"))
    assert (found.rollout_id, found.source) == ("b-1", "baggage")


def test_x_api_key_too_and_the_whole_key_must_match() -> None:
    assert _found(_scope(x_api_key=KEY)).rollout_id == "r-7"
    assert _found(_scope(x_api_key=KEY + "/extra")).rollout_id is None
    assert _found(_scope(authorization=f"Basic {KEY}")).rollout_id is None  # not a bearer token


def test_a_group_that_breaks_the_grammar_is_not_read() -> None:
    bad = RolloutRules(ApiKeyRolloutPattern.compile(r"k-(?P<rollout>.+)"))
    found = _found(_scope(authorization="Bearer k-has spaces and secrets"), bad)
    assert found.rollout_id is None and found.invalid_api_key_id


def test_the_key_is_replaced_upstream_when_one_is_configured_on_every_request() -> None:
    rules = RolloutRules(PATTERN, upstream_api_key="sk-upstream")
    for scope in (
        _scope(authorization=f"Bearer {KEY}"),
        _scope("/v1/models", method="GET", authorization=f"Bearer {KEY}"),
    ):
        found = _found(scope, rules)
        assert dict(found.scope["headers"])[b"authorization"] == b"Bearer sk-upstream"
    found = _found(_scope(x_api_key=KEY), rules)
    assert dict(found.scope["headers"])[b"x-api-key"] == b"sk-upstream"
    # a key that is not a per-rollout key goes on as sent
    found = _found(_scope(authorization="Bearer sk-real"), rules)
    assert dict(found.scope["headers"])[b"authorization"] == b"Bearer sk-real"
    # without an upstream key, the key goes on as sent
    found = _found(_scope(authorization=f"Bearer {KEY}"), RolloutRules(PATTERN))
    assert dict(found.scope["headers"])[b"authorization"] == f"Bearer {KEY}".encode()


def test_match_api_key_replaces_every_per_rollout_key() -> None:
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"x-api-key", KEY.encode())]
    match = match_api_key(headers, RolloutRules(PATTERN, upstream_api_key="u"))
    assert match is not None and match.rollout_id == "r-7"
    assert match.headers == [(b"authorization", b"Bearer u"), (b"x-api-key", b"u")]


def test_the_settings_from_the_environment_and_the_constructor_wins() -> None:
    env = {
        "OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN": PATTERN.pattern,
        "OTEL_CAPTURE_SESSION_ID_AS_ROLLOUT": "true",
        "OTEL_CAPTURE_UPSTREAM_API_KEY": "sk-upstream-secret",
    }
    settings = CaptureSettings.from_environ(env)
    assert settings.api_key_rollout_pattern is not None
    assert settings.api_key_rollout_pattern.pattern == PATTERN.pattern
    assert (settings.session_id_as_rollout, settings.upstream_api_key) == (True, "sk-upstream-secret")
    assert "sk-upstream-secret" not in repr(settings)
    given = CaptureSettings.from_environ(
        env,
        api_key_rollout_pattern=r"k-(?P<rollout>\w+)",
        session_id_as_rollout=False,
        upstream_api_key="other",
    )
    assert (
        given.api_key_rollout_pattern is not None
        and given.api_key_rollout_pattern.pattern == r"k-(?P<rollout>\w+)"
    )
    assert (given.session_id_as_rollout, given.upstream_api_key) == (False, "other")
    defaults = CaptureSettings.from_environ({})
    assert (defaults.api_key_rollout_pattern, defaults.session_id_as_rollout, defaults.upstream_api_key) == (
        None,
        False,
        None,
    )


def test_a_bad_pattern_is_a_clear_error_in_code_and_from_the_environment() -> None:
    # issue 33 item 3: it used to be logged from the environment and replaced by "no pattern", so the proxy
    # started and recorded nothing; now it is refused, naming the variable or argument
    with pytest.raises(ConfigurationError, match=r"^api_key_rollout_pattern: .*named group \(\?P<rollout>"):
        CaptureSettings(api_key_rollout_pattern=r"rk-(\w+)")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not a regular expression"):
        CaptureSettings.from_environ({}, api_key_rollout_pattern="rk-(")
    assert CaptureSettings(api_key_rollout_pattern=r"rk-(?P<rollout>\w+)").api_key_rollout_pattern == (  # type: ignore[arg-type]
        ApiKeyRolloutPattern.compile(r"rk-(?P<rollout>\w+)")
    )
    with pytest.raises(ConfigurationError, match=r"^OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN: .*named group"):
        CaptureSettings.from_environ({"OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN": "rk-(\\w+)"})
