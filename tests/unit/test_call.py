"""One call's error category comes from the class of the exception that ended it, not from its name."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from otel_capture._call import InFlightCall, classify_exception
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
        (httpx.RemoteProtocolError("peer closed connection without sending complete message body"), "connection"),
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
