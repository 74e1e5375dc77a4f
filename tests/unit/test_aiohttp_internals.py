"""The aiohttp internals the proxy's upstream client drives (listed in otel_capture/_proxy/pool.py's
docstring), pinned against the installed aiohttp: a release that moves or renames one fails here, by name,
before any proxy test has to guess why an upstream call broke. The behaviour itself is tested end to end
by tests/integration/test_proxy*.py."""

from __future__ import annotations

import inspect

import aiohttp
import pytest
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import BaseConnector, Connection
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import EofStream

import otel_capture._proxy.pool as pool


def _parameters(function: object) -> set[str]:
    return set(inspect.signature(function).parameters)  # type: ignore[arg-type]  # any callable


def test_the_aiohttp_major_version_is_the_one_tested() -> None:
    assert aiohttp.__version__.split(".")[0] == "3"  # pyproject pins <4: a 4.x must be checked first


def test_the_connector_hands_out_connections_for_a_bare_request() -> None:
    assert {"req", "traces", "timeout"} <= _parameters(BaseConnector.connect)
    assert {"method", "url", "loop"} <= _parameters(ClientRequest.__init__)
    for name in ("protocol", "transport", "release", "close"):
        assert hasattr(Connection, name), name


def test_the_response_protocol_reads_as_the_proxy_drives_it() -> None:
    params = _parameters(ResponseHandler.set_response_params)
    assert {"skip_payload", "read_until_eof", "auto_decompress", "read_timeout"} <= params
    assert callable(ResponseHandler.start_timeout) and callable(ResponseHandler.read)
    assert issubclass(HttpProcessingError, Exception) and issubclass(EofStream, Exception)
    error = HttpProcessingError(code=400, message="bad")
    assert (error.code, error.message) == (400, "bad")  # what the proxy turns into a ClientResponseError


@pytest.mark.parametrize("name", ["ClientRequest", "Connection", "HttpProcessingError", "EofStream"])
def test_the_proxy_imports_them_from_where_they_are(name: str) -> None:
    assert (
        getattr(pool, name)
        is {
            "ClientRequest": ClientRequest,
            "Connection": Connection,
            "HttpProcessingError": HttpProcessingError,
            "EofStream": EofStream,
        }[name]
    )
