"""Settings that cannot be used safely stop the proxy before it listens, with one line naming the variable
(issues 30 items 1 and 5, 33 items 2 and 3), and a pattern that backtracks catastrophically under Python's
``re`` cannot hold the proxy: the official openai SDK sends a key that almost matches it, through a real
proxy on 127.0.0.1, and the proxy answers it, and the next rollout's calls, at once."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import starlette.applications
import starlette.responses
import starlette.routing
from support import ReplayModelServer, serve

from otel_capture import CaptureSettings, CaptureStore, read_model_call_records, start_proxy
from otel_capture._errors import CaptureError, ConfigurationError
from otel_capture._instrumentor import ModelCallInstrumentor
from otel_capture._proxy import build_proxy_app

BOUND = 60  # seconds: a bound on a hang, not a timing assertion
PATTERN_ENV = "OTEL_CAPTURE_API_KEY_ROLLOUT_PATTERN"
KEY_ENV = "OTEL_CAPTURE_UPSTREAM_API_KEY"
SECRET = "sk-upstream-S3cretPart"
# issue 30: "dash-separated words", then a dot and a secret part; rk- + 27 letters + ! held the loop 9.7 s
WORDS = r"rk-(?P<rollout>(?:[A-Za-z0-9]+-?)+)\.[A-Za-z0-9]+"


def _cli_proxy(
    tmp_path: Path, env: dict[str, str], upstream: str = "http://127.0.0.1:9"
) -> subprocess.CompletedProcess[str]:
    """``otel-capture proxy`` as a user runs it, in its own process, with ``env`` added."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_CAPTURE_")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_capture",
            "proxy",
            "--upstream",
            upstream,
            "--capture-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=BOUND,
        stdin=subprocess.DEVNULL,
        env={**clean, **env},
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({PATTERN_ENV: "(?P<rollout>[A-Za-z0-9._-]+)"}, "could be the whole key"),  # the old docs' pattern
        ({PATTERN_ENV: r"rk-([\w-]+)"}, r"named group \(\?P<rollout>"),
        ({PATTERN_ENV: "rk-(?P<rollout>["}, "not a regular expression"),
        ({PATTERN_ENV: r"rk-(?P<rollout>\w+)(?=x)"}, "RE2 cannot compile it"),
        ({KEY_ENV: SECRET + "\r\nX-Injected: 1"}, "control character"),
        ({KEY_ENV: SECRET + "\u20ac"}, "outside latin-1"),
    ],
    ids=["whole-key", "no-group", "not-a-regex", "lookahead", "key-crlf", "key-not-latin-1"],
)
def test_the_proxy_command_refuses_to_start_with_one_line_naming_the_variable(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    (name,) = env
    result = _cli_proxy(tmp_path, env)
    assert result.returncode == 1
    assert "listening on" not in result.stdout  # refused before it listens
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"otel-capture: error: {name}: ")
    assert re.search(message, line)
    assert "S3cret" not in result.stderr  # the upstream key is a credential: never quoted


def test_the_proxy_command_refuses_an_upstream_url_a_head_cannot_carry(tmp_path: Path) -> None:
    result = _cli_proxy(tmp_path, {}, upstream="http://127.0.0.1:9/v1\r\nX-Injected: 1")
    assert result.returncode == 1
    assert "listening on" not in result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith("otel-capture: error: --upstream: character 22 of the URL (U+000D)")


@pytest.mark.parametrize("upstream", ["localhost:8000", "127.0.0.1:8000", "ftp://127.0.0.1:8000", "http://"])
def test_the_proxy_command_refuses_an_upstream_that_is_not_an_http_url_before_listening(
    tmp_path: Path, upstream: str
) -> None:
    """``--upstream localhost:8000`` (no scheme) used to print ``listening on`` and then fail with the URL
    parser's words; it is refused first, with the form it needs."""
    result = _cli_proxy(tmp_path, {}, upstream=upstream)
    assert result.returncode == 1
    assert "listening on" not in result.stdout
    (line,) = result.stderr.splitlines()
    assert line == (
        "otel-capture: error: --upstream: the upstream must be an absolute http:// or https:// URL, "
        "such as http://127.0.0.1:8000"
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (PATTERN_ENV, "(?P<rollout>.+)"),
        (PATTERN_ENV, r"rk-(?P<rollout>a)\1"),
        (KEY_ENV, SECRET + "\nX-Injected: 1"),
    ],
    ids=["whole-key-pattern", "backreference", "key-with-lf"],
)
def test_build_proxy_app_and_start_proxy_raise_a_capture_error_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)  # what they read when no settings are passed
    for start in (
        lambda: build_proxy_app("http://127.0.0.1:9"),
        lambda: start_proxy("http://127.0.0.1:9", str(tmp_path)),
    ):
        with pytest.raises(ConfigurationError, match=f"^{name}: ") as refused:
            start()
        assert isinstance(refused.value, CaptureError) and "S3cret" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_start_proxy_refuses_an_upstream_url_a_head_cannot_carry(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"^upstream: .*control character"):
        start_proxy("http://127.0.0.1:9/v1\r\nX-Injected: 1", str(tmp_path))


def test_a_key_that_would_backtrack_for_years_is_answered_and_the_proxy_goes_on(
    replay_server: ReplayModelServer, tmp_path: Path
) -> None:
    store = CaptureStore(tmp_path / "calls")
    settings = CaptureSettings(api_key_rollout_pattern=WORDS)  # type: ignore[arg-type]
    almost = "rk-" + "a" * 60 + "!"  # with Python's re: ~2^60 steps, on the event loop
    with serve(replay_server) as upstream, start_proxy(upstream, str(store.root), settings=settings) as proxy:
        with openai.OpenAI(
            base_url=f"{proxy.url}/v1", api_key=almost, max_retries=0, timeout=BOUND
        ) as client:
            chat = client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
            assert chat.choices  # served, not recorded: the key is no rollout key
            assert client.models.list() is not None  # every request is matched, a GET /v1/models too
        good = "rk-grpo-step-1-r-0.S3cret"
        with openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=good, max_retries=0, timeout=BOUND) as client:
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert store.rollout_ids() == ["grpo-step-1-r-0"]
    (record,) = read_model_call_records(store, "grpo-step-1-r-0")
    assert record.dialect == "chat"


def test_zero_code_with_a_refused_pattern_serves_the_app_uncaptured_and_logs_the_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # telemetry never breaks the host app: the model server answers, and the log says why nothing is captured
    monkeypatch.setenv(PATTERN_ENV, "(?P<rollout>[A-Za-z0-9._-]+)")
    instrumentor = ModelCallInstrumentor()
    instrumentor.instrument()
    try:
        app = starlette.applications.Starlette(
            routes=[starlette.routing.Route("/health", lambda _: starlette.responses.PlainTextResponse("ok"))]
        )
        with caplog.at_level(logging.ERROR, logger="otel_capture"), serve(app) as url:
            answer = httpx.get(f"{url}/health", timeout=BOUND)
    finally:
        instrumentor.uninstrument()
    assert (answer.status_code, answer.text) == (200, "ok")
    refused = [(r.getMessage(), r.exc_info[1]) for r in caplog.records if r.exc_info]
    assert len(refused) == 1
    message, error = refused[0]
    assert "serving it without capture" in message
    assert isinstance(error, ConfigurationError) and str(error).startswith(f"{PATTERN_ENV}: ")
