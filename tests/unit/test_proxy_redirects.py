"""The capture proxy's ``Location`` rewrite: an upstream's redirect leads back through the proxy, with the
rollout prefix, and only a redirect on the upstream's own origin is touched."""

from __future__ import annotations

import pytest
from yarl import URL

from otel_capture._proxy.redirects import client_origin, proxied_location, relocate

UPSTREAM = URL("http://10.0.0.5:8000")
PROXY = URL("http://127.0.0.1:4000")
PREFIX = "/ng-rollout/r1"
SLASHED = UPSTREAM / "v1" / "chat" / "completions" / ""  # what the proxy requested: a trailing slash


def _rewrite(
    location: str,
    *,
    upstream: URL = UPSTREAM,
    requested: URL = SLASHED,
    root_path: str = PREFIX,
    client: URL | None = PROXY,
) -> str:
    return proxied_location(
        location, requested=requested, upstream=upstream, root_path=root_path, client=client
    )


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        # absolute on the upstream's origin: absolute on the proxy, as the client addressed it, prefix back on
        (
            "http://10.0.0.5:8000/v1/chat/completions",
            "http://127.0.0.1:4000/ng-rollout/r1/v1/chat/completions",
        ),
        ("HTTP://10.0.0.5:8000/v1/models", "http://127.0.0.1:4000/ng-rollout/r1/v1/models"),
        ("//10.0.0.5:8000/v1/models", "http://127.0.0.1:4000/ng-rollout/r1/v1/models"),  # network-path
        # an absolute path stays one, on the proxy
        ("/v1/chat/completions", "/ng-rollout/r1/v1/chat/completions"),
        # relative references resolve against the URL the proxy requested, then map the same way
        ("../completions", "/ng-rollout/r1/v1/chat/completions"),
        ("next", "/ng-rollout/r1/v1/chat/completions/next"),
        # query and fragment are kept exactly as sent (nothing re-quoted)
        (
            "/v1/chat/completions?api-version=2024%2F10&x=a+b#f",
            "/ng-rollout/r1/v1/chat/completions?api-version=2024%2F10&x=a+b#f",
        ),
        (
            "http://10.0.0.5:8000/v1/a%20b?q=1",
            "http://127.0.0.1:4000/ng-rollout/r1/v1/a%20b?q=1",
        ),
    ],
)
def test_a_location_on_the_upstream_comes_back_through_the_proxy_with_the_prefix(
    location: str, expected: str
) -> None:
    assert _rewrite(location) == expected


@pytest.mark.parametrize(
    "location",
    [
        "http://other.example/v1/chat/completions",  # another host
        "http://10.0.0.5:8001/v1/chat/completions",  # another port
        "https://10.0.0.5:8000/v1/chat/completions",  # another scheme
        "http://[bad/",  # not a URL: the client fails on it either way
    ],
)
def test_a_location_on_another_origin_is_left_alone(location: str) -> None:
    assert _rewrite(location) == location


def test_without_the_prefix_the_location_is_the_same_path_on_the_proxy() -> None:
    """A request correlated by header or baggage keeps them on the client's redirect: no prefix to add."""
    assert _rewrite("http://10.0.0.5:8000/v1/chat/completions", root_path="") == (
        "http://127.0.0.1:4000/v1/chat/completions"
    )
    assert _rewrite("/v1/chat/completions?x=1", root_path="") == "/v1/chat/completions?x=1"


def test_the_upstreams_base_path_is_taken_off_and_a_location_outside_it_left_alone() -> None:
    upstream = URL("http://10.0.0.5:8000/base/")
    requested = URL("http://10.0.0.5:8000/base/v1/chat/completions/")
    for location, expected in [
        (
            "http://10.0.0.5:8000/base/v1/chat/completions",
            "http://127.0.0.1:4000/ng-rollout/r1/v1/chat/completions",
        ),
        ("/base/v1/chat/completions?x=1", "/ng-rollout/r1/v1/chat/completions?x=1"),
        ("/base", "/ng-rollout/r1/"),
        ("/other/v1/chat/completions", "/other/v1/chat/completions"),  # the proxy cannot reach it
        ("/basement/v1", "/basement/v1"),  # a segment boundary, not a string prefix
    ]:
        assert _rewrite(location, upstream=upstream, requested=requested) == expected, location
    assert _rewrite("/base/v1/x", upstream=upstream, requested=requested, root_path="") == "/v1/x"


def test_the_servers_own_root_path_stays_in_front_of_the_prefix() -> None:
    """As a Starlette app builds its URLs: ``root_path`` whole, the proxy's mount point and the prefix."""
    assert (
        _rewrite("/v1/chat/completions", root_path="/api/ng-rollout/r1")
        == "/api/ng-rollout/r1/v1/chat/completions"
    )


def test_with_no_origin_for_the_client_an_absolute_location_becomes_an_absolute_path() -> None:
    assert (
        _rewrite("http://10.0.0.5:8000/v1/chat/completions", client=None)
        == "/ng-rollout/r1/v1/chat/completions"
    )


def test_the_client_origin_is_the_host_it_used_else_the_servers_address() -> None:
    assert client_origin({"scheme": "https", "headers": [(b"host", b"proxy.local:8443")]}) == URL(
        "https://proxy.local:8443"
    )
    assert client_origin({"scheme": "http", "headers": [], "server": ("127.0.0.1", 4000)}) == PROXY
    assert client_origin({"scheme": "http", "headers": [], "server": ("::1", 4000)}) == URL(
        "http://[::1]:4000"
    )
    assert client_origin({"scheme": "http", "headers": []}) is None
    assert client_origin({"scheme": "http", "headers": [(b"host", b"h:port")]}) is None


def test_relocate_rewrites_the_location_header_only() -> None:
    scope = {"scheme": "http", "headers": [(b"host", b"127.0.0.1:4000")], "root_path": PREFIX}
    headers = [(b"content-length", b"0"), (b"Location", b"http://10.0.0.5:8000/v1/chat/completions")]
    assert relocate(headers, scope, SLASHED, UPSTREAM) == [
        (b"content-length", b"0"),
        (b"Location", b"http://127.0.0.1:4000/ng-rollout/r1/v1/chat/completions"),
    ]
    no_location = [(b"content-length", b"0")]
    assert relocate(no_location, scope, SLASHED, UPSTREAM) is no_location
