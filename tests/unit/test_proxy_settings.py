"""ProxySettings: constructor > our variable > default; a bad value is logged by name and replaced by the
default; the secret headers are always sanitized, whatever the instrumentation's variable adds."""

from __future__ import annotations

import logging

import pytest

from otel_capture import ProxySettings
from otel_capture._settings import SECRET_HEADERS
from otel_capture._telemetry.server_span import redact_query


def test_defaults_fit_long_model_calls_with_images() -> None:
    settings = ProxySettings.from_environ({})
    assert settings.upstream_timeout == 600
    assert settings.max_request_bytes == 64 * 1024 * 1024
    assert settings.shutdown_timeout == 25
    assert settings.max_concurrent_calls == 1024
    assert settings.sanitize_headers == SECRET_HEADERS


def test_variables_then_constructor() -> None:
    env = {
        "OTEL_CAPTURE_UPSTREAM_TIMEOUT": "2.5",
        "OTEL_CAPTURE_MAX_REQUEST_BYTES": "1000",
        "OTEL_CAPTURE_SHUTDOWN_TIMEOUT": "3",
    }
    assert ProxySettings.from_environ(env) == ProxySettings(
        upstream_timeout=2.5, max_request_bytes=1000, shutdown_timeout=3
    )
    given = ProxySettings.from_environ(env, upstream_timeout=9, max_request_bytes=7, shutdown_timeout=1)
    assert (given.upstream_timeout, given.max_request_bytes, given.shutdown_timeout) == (9, 7, 1)


def test_the_call_cap_comes_from_its_variable_unless_given() -> None:
    env = {"OTEL_CAPTURE_MAX_CONCURRENT_CALLS": "8"}
    assert ProxySettings.from_environ(env).max_concurrent_calls == 8
    assert ProxySettings.from_environ(env, max_concurrent_calls=3).max_concurrent_calls == 3


@pytest.mark.parametrize(
    ("name", "raw", "field"),
    [
        ("OTEL_CAPTURE_UPSTREAM_TIMEOUT", "0", "upstream_timeout"),
        ("OTEL_CAPTURE_UPSTREAM_TIMEOUT", "soon", "upstream_timeout"),
        ("OTEL_CAPTURE_UPSTREAM_TIMEOUT", "nan", "upstream_timeout"),
        ("OTEL_CAPTURE_MAX_REQUEST_BYTES", "-1", "max_request_bytes"),
        ("OTEL_CAPTURE_SHUTDOWN_TIMEOUT", "1.5", "shutdown_timeout"),
        ("OTEL_CAPTURE_MAX_CONCURRENT_CALLS", "0", "max_concurrent_calls"),
        ("OTEL_CAPTURE_MAX_CONCURRENT_CALLS", "many", "max_concurrent_calls"),
    ],
)
def test_a_bad_value_is_logged_by_name_and_the_default_kept(
    name: str, raw: str, field: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        settings = ProxySettings.from_environ({name: raw})
    assert getattr(settings, field) == getattr(ProxySettings(), field)
    assert name in caplog.text


def test_the_sanitize_variable_adds_to_the_secret_headers_never_replaces_them() -> None:
    env = {"OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS": " x-internal-token , Authorization,"}
    settings = ProxySettings.from_environ(env)
    assert settings.sanitize_headers == (*SECRET_HEADERS, "x-internal-token")


@pytest.mark.parametrize(
    ("query", "shown"),
    [
        (b"api_key=sk-1", b"api_key=REDACTED"),
        (b"a=1&key=sk-2&flag", b"a=REDACTED&key=REDACTED&flag"),
        (b"x=", b"x=REDACTED"),
        (b"token=a=b", b"token=REDACTED"),
    ],
)
def test_query_values_are_redacted_names_kept(query: bytes, shown: bytes) -> None:
    assert redact_query(query) == shown
