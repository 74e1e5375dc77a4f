"""Configuration (README, Configuration): constructor > our variable > standard OTEL_* variable > default; a bad value
is logged by name and replaced by the default. Environments are injected, never patched."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

import otel_capture
from otel_capture import CaptureSettings, WriterSettings
from otel_capture._settings import (
    DEFAULT_CONTENT_MAX_LENGTH,
    DEFAULT_MAX_BODY_BYTES,
    cache_dir,
    lock_timeout_from_environ,
    upstream_from_environ,
)

CASES: list[tuple[str, dict[str, str], dict[str, Any], str, Any, str | None]] = [
    # (case, environ, constructor kwargs, field, expected, variable named in a warning)
    ("dir default", {}, {}, "directory", None, None),
    (
        "dir from our variable",
        {"OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": "/data/calls"},
        {},
        "directory",
        Path("/data/calls"),
        None,
    ),
    (
        "dir constructor wins",
        {"OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": "/data/calls"},
        {"directory": "/x"},
        "directory",
        Path("/x"),
        None,
    ),
    ("dir empty is unset", {"OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": "  "}, {}, "directory", None, None),
    ("sync default", {}, {}, "sync", "auto", None),
    ("sync from our variable", {"OTEL_CAPTURE_SYNC": "FSYNC"}, {}, "sync", "fsync", None),
    ("sync constructor wins", {"OTEL_CAPTURE_SYNC": "auto"}, {"sync": "fsync"}, "sync", "fsync", None),
    ("sync bad", {"OTEL_CAPTURE_SYNC": "never"}, {}, "sync", "auto", "OTEL_CAPTURE_SYNC"),
    ("service default", {}, {}, "service_name", None, None),
    ("service from OTEL_SERVICE_NAME", {"OTEL_SERVICE_NAME": "policy"}, {}, "service_name", "policy", None),
    (
        "service from resource attributes",
        {"OTEL_RESOURCE_ATTRIBUTES": "a=b,service.name=pol%20icy"},
        {},
        "service_name",
        "pol icy",
        None,
    ),
    (
        "OTEL_SERVICE_NAME wins over resource",
        {"OTEL_SERVICE_NAME": "n", "OTEL_RESOURCE_ATTRIBUTES": "service.name=r"},
        {},
        "service_name",
        "n",
        None,
    ),
    ("resource without a service name", {"OTEL_RESOURCE_ATTRIBUTES": "a=b"}, {}, "service_name", None, None),
    (
        "service constructor wins",
        {"OTEL_SERVICE_NAME": "n"},
        {"service_name": "c"},
        "service_name",
        "c",
        None,
    ),
    ("body cap default", {}, {}, "max_body_bytes", DEFAULT_MAX_BODY_BYTES, None),
    ("body cap from our variable", {"OTEL_CAPTURE_MAX_BODY_BYTES": "1024"}, {}, "max_body_bytes", 1024, None),
    (
        "body cap bad",
        {"OTEL_CAPTURE_MAX_BODY_BYTES": "lots"},
        {},
        "max_body_bytes",
        DEFAULT_MAX_BODY_BYTES,
        "OTEL_CAPTURE_MAX_BODY_BYTES",
    ),
    (
        "body cap negative",
        {"OTEL_CAPTURE_MAX_BODY_BYTES": "-1"},
        {},
        "max_body_bytes",
        DEFAULT_MAX_BODY_BYTES,
        "OTEL_CAPTURE_MAX_BODY_BYTES",
    ),
    (
        "body cap constructor wins over a bad variable",
        {"OTEL_CAPTURE_MAX_BODY_BYTES": "lots"},
        {"max_body_bytes": 7},
        "max_body_bytes",
        7,
        None,
    ),
    ("raw stream true", {"OTEL_CAPTURE_KEEP_RAW_STREAM": "TRUE"}, {}, "keep_raw_stream", True, None),
    (
        "raw stream bad",
        {"OTEL_CAPTURE_KEEP_RAW_STREAM": "maybe"},
        {},
        "keep_raw_stream",
        False,
        "OTEL_CAPTURE_KEEP_RAW_STREAM",
    ),
    ("content off by default", {}, {}, "capture_content", "no_content", None),
    (
        "content from the GenAI variable",
        {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"},
        {},
        "capture_content",
        "span_only",
        None,
    ),
    (
        "content span_and_event",
        {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "span_and_event"},
        {},
        "capture_content",
        "span_and_event",
        None,
    ),
    (
        "content event_only",
        {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "event_only"},
        {},
        "capture_content",
        "event_only",
        None,
    ),
    (
        "content legacy true",
        {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true"},
        {},
        "capture_content",
        "span_only",
        None,
    ),
    (
        "content legacy false",
        {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "false"},
        {},
        "capture_content",
        "no_content",
        None,
    ),
    (
        "our content variable wins",
        {
            "OTEL_CAPTURE_MESSAGE_CONTENT": "no_content",
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "span_only",
        },
        {},
        "capture_content",
        "no_content",
        None,
    ),
    (
        "content constructor wins",
        {"OTEL_CAPTURE_MESSAGE_CONTENT": "span_only"},
        {"capture_content": False},
        "capture_content",
        "no_content",
        None,
    ),
    (
        "content bad",
        {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "everything"},
        {},
        "capture_content",
        "no_content",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT",
    ),
    (
        "bad ours does not fall through to the standard one",
        {
            "OTEL_CAPTURE_MESSAGE_CONTENT": "loud",
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "span_only",
        },
        {},
        "capture_content",
        "no_content",
        "OTEL_CAPTURE_MESSAGE_CONTENT",
    ),
    ("content length default", {}, {}, "content_max_length", DEFAULT_CONTENT_MAX_LENGTH, None),
    (
        "content length from our variable",
        {"OTEL_CAPTURE_CONTENT_MAX_LENGTH": "500"},
        {},
        "content_max_length",
        500,
        None,
    ),
    (
        "content length from the SDK limit",
        {"OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "300"},
        {},
        "content_max_length",
        300,
        None,
    ),
    (
        "content length from the general SDK limit",
        {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "200"},
        {},
        "content_max_length",
        200,
        None,
    ),
    (
        "ours never above the SDK limit",
        {"OTEL_CAPTURE_CONTENT_MAX_LENGTH": "5000", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "300"},
        {},
        "content_max_length",
        300,
        None,
    ),
    (
        "ours below the SDK limit",
        {"OTEL_CAPTURE_CONTENT_MAX_LENGTH": "100", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "300"},
        {},
        "content_max_length",
        100,
        None,
    ),
    (
        "content length constructor",
        {"OTEL_CAPTURE_CONTENT_MAX_LENGTH": "100"},
        {"content_max_length": 64},
        "content_max_length",
        64,
        None,
    ),
    (
        "content length bad",
        {"OTEL_CAPTURE_CONTENT_MAX_LENGTH": "0"},
        {},
        "content_max_length",
        DEFAULT_CONTENT_MAX_LENGTH,
        "OTEL_CAPTURE_CONTENT_MAX_LENGTH",
    ),
    ("lock timeout default", {}, {}, "lock_timeout_s", 30.0, None),
    ("lock timeout env", {"OTEL_CAPTURE_LOCK_TIMEOUT_S": "2.5"}, {}, "lock_timeout_s", 2.5, None),
    (
        "lock timeout constructor",
        {"OTEL_CAPTURE_LOCK_TIMEOUT_S": "2.5"},
        {"lock_timeout_s": 0.2},
        "lock_timeout_s",
        0.2,
        None,
    ),
    (
        "lock timeout bad",
        {"OTEL_CAPTURE_LOCK_TIMEOUT_S": "-1"},
        {},
        "lock_timeout_s",
        30.0,
        "OTEL_CAPTURE_LOCK_TIMEOUT_S",
    ),
]


@pytest.mark.parametrize(
    ("environ", "kwargs", "field", "expected", "warned"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_precedence_and_bad_values(
    environ: dict[str, str],
    kwargs: dict[str, Any],
    field: str,
    expected: Any,
    warned: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cls = WriterSettings if field in ("directory", "sync", "lock_timeout_s") else CaptureSettings
    with caplog.at_level(logging.WARNING, logger="otel_capture._settings"):
        settings = cls.from_environ(environ, **kwargs)
    assert getattr(settings, field) == expected
    warnings = [r.getMessage() for r in caplog.records]
    if warned is None:
        assert warnings == []
    else:
        (message,) = warnings
        assert warned in message and repr(environ[warned]) in message and "default" in message


def test_content_goes_on_spans_only_for_the_span_modes() -> None:
    modes = {
        m: CaptureSettings(capture_content=m).content_on_spans  # type: ignore[arg-type]
        for m in ("no_content", "span_only", "event_only", "span_and_event")
    }
    assert modes == {"no_content": False, "span_only": True, "event_only": False, "span_and_event": True}


def test_the_environment_is_read_when_asked_not_at_import() -> None:
    assert CaptureSettings.from_environ({"OTEL_SERVICE_NAME": "a"}).service_name == "a"
    assert CaptureSettings.from_environ({"OTEL_SERVICE_NAME": "b"}).service_name == "b"


def test_the_proxy_upstream_and_the_cache_come_from_their_variables(tmp_path: Path) -> None:
    assert upstream_from_environ({"OTEL_CAPTURE_UPSTREAM": " http://127.0.0.1:9 "}) == "http://127.0.0.1:9"
    with pytest.raises(RuntimeError, match="OTEL_CAPTURE_UPSTREAM"):
        upstream_from_environ({})
    assert cache_dir({"OTEL_CAPTURE_CACHE": str(tmp_path)}) == tmp_path
    assert cache_dir({}) == Path.home() / ".cache" / "otel-capture"


def test_no_module_but_the_settings_reads_the_environment() -> None:
    """One reader of the environment: a setting passed in code is never replaced by a variable elsewhere."""
    package = Path(otel_capture.__file__).parent
    sources = [
        *package.rglob("*.py"),
        *(package.parent / "exporters").rglob("*.py"),
        *(package.parent / "examples" / "demo").rglob("*.py"),
    ]
    readers = sorted(
        str(path.relative_to(package.parent))
        for path in sources
        if path.name != "_settings.py"
        # os.environ.get, os.getenv, or a mapping named env/environ that was handed os.environ
        and re.search(
            r"(os\.environ\.get|os\.getenv|\b(?:env|environ)\.get)\((?!\"PYTHONPATH\")", path.read_text()
        )
    )
    assert readers == []


def test_the_store_takes_its_lock_timeout_from_the_same_variable() -> None:
    assert lock_timeout_from_environ({}) == 30.0
    assert lock_timeout_from_environ({"OTEL_CAPTURE_LOCK_TIMEOUT_S": "3"}) == 3.0
