"""One call's error category comes from the class of the exception that ended it, not from its name."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from otel_capture._capture.call import InFlightCall, classify_exception
from otel_capture._records import build_model_call_record
from otel_capture._settings import CaptureSettings


class Deadline(TimeoutError):
    """A timeout whose name does not say so."""


class PeerGone(ConnectionResetError):
    """A connection failure whose name does not say so."""


class TimeoutConfigInvalid(ValueError):
    """Not a timeout, though its name says so."""


class ConnectionStringMalformed(ValueError):
    """Not a connection failure, though its name says so."""


class CancelButtonMissing(LookupError):
    """Not a cancellation, though its name says so."""


@pytest.mark.parametrize(
    ("exc", "category"),
    [
        (asyncio.CancelledError(), "cancelled"),
        (asyncio.TimeoutError(), "timeout"),
        (Deadline(), "timeout"),
        (httpx.ReadTimeout("slow upstream"), "timeout"),
        (httpx.ConnectTimeout("no answer"), "timeout"),
        (ConnectionRefusedError(), "connection"),
        (PeerGone(), "connection"),
        (httpx.ConnectError("refused"), "connection"),
        (httpx.ReadError("reset"), "connection"),
        (
            httpx.RemoteProtocolError("peer closed connection without sending complete message body"),
            "connection",
        ),
        (TimeoutConfigInvalid(), "exception"),
        (ConnectionStringMalformed(), "exception"),
        (CancelButtonMissing(), "exception"),
        (RuntimeError("boom"), "exception"),
    ],
)
def test_category_follows_the_exception_class(exc: BaseException, category: str) -> None:
    assert classify_exception(exc) == category


def test_the_record_and_span_carry_that_category() -> None:
    call = InFlightCall("chat", "r1", CaptureSettings())
    call.set_request(b'{"model": "m", "messages": []}')
    call.finish(exception=Deadline("upstream took too long"))
    assert call.error_category == "timeout"
    assert call.end_attributes()["error.type"] == "timeout"
    assert b'"error_category":"timeout"' in call.line(1, 2)


def _finished(status: int, body: bytes) -> InFlightCall:
    call = InFlightCall("responses", "r1", CaptureSettings())
    call.set_request(b'{"model": "m", "input": "hi"}')
    call.on_response_start(status, "application/json")
    call.on_body(body)
    call.finish()
    return call


@pytest.mark.parametrize(
    ("status", "body", "failed"),
    [
        (200, b'{"id": "r", "status": "completed", "output": []}', False),
        (307, b"", False),  # a redirect is not a failed model call
        (200, b'{"id": "r", "status": "failed", "output": []}', True),
        (429, b'{"error": {"message": "slow down"}}', True),
        (200, b"not json", True),  # a capture failure: capture_parse_error
    ],
)
def test_the_metrics_and_the_records_agree_on_a_failed_call(status: int, body: bytes, failed: bool) -> None:
    call = _finished(status, body)
    record = build_model_call_record(orjson.loads(call.line(1, 2)), call_index=0)
    assert call.failed is record.failed is failed


def _line_of(request: bytes, response: bytes) -> bytes:
    call = InFlightCall("chat", "r", CaptureSettings.from_environ({}))
    call.set_request(request)
    call.on_response_start(200, "application/json")
    call.on_body(response)
    call.finish()
    return call.line(1, 2)


def test_strict_json_bodies_go_into_the_line_as_sent_even_when_their_text_says_nan() -> None:
    request = b'{"model":"m","messages":[{"role":"user","content":"NaN, or -Infinity?"}],"seed":10000000000000000001}'
    response = b'{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"NaN"},"finish_reason":"stop"}]}'
    line = _line_of(request, response)
    assert b'"request":' + request + b"," in line and b'"response":' + response + b"," in line
    record = orjson.loads(line)
    assert "request_raw" not in record and "response_raw" not in record


def test_bodies_with_nan_are_written_as_null_and_the_answer_as_sent_is_kept() -> None:
    request = b'{"model":"m","temperature":NaN,"messages":[]}'
    response = (
        b'{"id":"c","x":-Infinity,"choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}'
    )
    record = orjson.loads(_line_of(request, response))  # strict JSON: a NaN would make it unreadable
    assert record["request"] == {"model": "m", "temperature": None, "messages": []}
    assert "request_raw" not in record  # the request's meaning is all in `request`
    assert record["response"]["x"] is None and record["response_raw"] == response.decode()
    assert record["error_category"] is None
