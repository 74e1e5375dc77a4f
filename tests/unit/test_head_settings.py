"""The settings that go into a request head are refused at start when a head cannot carry them as they are
(issue 30 item 5): the upstream's API key (``OTEL_CAPTURE_UPSTREAM_API_KEY``, sent as ``Authorization`` or
``x-api-key``) and the upstream's URL (``--upstream`` / ``OTEL_CAPTURE_UPSTREAM``: ``Host``, the request
line, Basic auth). The error names the variable and never quotes the value. Through the proxy and its
command: tests/integration/test_refused_settings.py."""

from __future__ import annotations

import pytest

from otel_capture import CaptureSettings
from otel_capture._errors import CaptureError, ConfigurationError
from otel_capture._settings import upstream_from_environ, upstream_url

KEY_ENV = "OTEL_CAPTURE_UPSTREAM_API_KEY"
SECRET = "sk-upstream-S3cretPart"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (SECRET + "\r\nX-Injected: 1", "control character"),  # would add a header upstream
        (SECRET + "\nX-Injected: 1", "control character"),
        (SECRET + "\x00", "control character"),
        (SECRET[:3] + "\x7f" + SECRET[3:], "control character"),
        (SECRET + "\u20ac", "outside latin-1"),  # every matched call was a 500
        (SECRET + "\U0001f511", "outside latin-1"),
    ],
)
def test_an_upstream_key_a_head_cannot_carry_is_refused_naming_the_variable(value: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"^{KEY_ENV}: character \d+ .*{why}") as refused:
        CaptureSettings.from_environ({KEY_ENV: value})
    assert isinstance(refused.value, CaptureError) and isinstance(refused.value, ValueError)
    assert SECRET not in str(refused.value) and "S3cret" not in str(refused.value)  # a credential
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigurationError, match=rf"^upstream_api_key: .*{why}"):
        CaptureSettings(upstream_api_key=value)
    with pytest.raises(ConfigurationError, match=rf"^upstream_api_key: .*{why}"):
        CaptureSettings.from_environ({}, upstream_api_key=value)


def test_a_key_a_head_can_carry_is_kept_as_given() -> None:
    for value in (SECRET, "key with\tinner blanks", "latin-1 caf\u00e9"):
        assert CaptureSettings.from_environ({KEY_ENV: f"  {value}\n"}).upstream_api_key == value


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:8000/v1\r\nX-Injected: 1", "control character"),  # the URL parser drops CR LF
        ("http://127.0.0.1:8000/v\t1", "control character"),
        ("http://127.0.0.1:8000/\x00", "control character"),
        ("http://user:p\u20acss@127.0.0.1:8000", r"user or password.*outside latin-1"),
        ("http://[::1", "not a URL"),
    ],
)
def test_an_upstream_url_a_head_cannot_carry_is_refused_naming_where_it_came_from(url: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"^--upstream.*{why}") as refused:
        upstream_url("--upstream", url)
    assert "p\u20acss" not in str(refused.value)  # may be a password
    with pytest.raises(ConfigurationError, match=r"^OTEL_CAPTURE_UPSTREAM"):
        upstream_from_environ({"OTEL_CAPTURE_UPSTREAM": url})


def test_a_good_upstream_url_is_kept() -> None:
    for url in ("http://127.0.0.1:8000", "http://user:caf\u00e9@h\u00e9st:8000/base/"):
        assert upstream_url("--upstream", url) == url
