"""The pure parts of gateway correlation: the header, the prefix in root_path, span naming, the rate-limited
notice. End to end: tests/integration/test_gateways.py."""

from __future__ import annotations

from typing import Any

import pytest

from otel_capture import InvalidRolloutIdError, rollout_context, rollout_headers
from otel_capture._correlation import Correlation, server_span_details, unprefixed_raw_path
from otel_capture._correlation import correlate as _correlate
from otel_capture._correlation.ids import rollout_id_from_header
from otel_capture._correlation.routing import (
    INVALID_DOUBLE_PREFIX,
    INVALID_IN_HEADER,
    INVALID_IN_PREFIX,
    route_path,
)
from otel_capture._notices import RateLimitedNotice


def _scope(
    raw_path: bytes, *, root_path: str = "", headers: list[tuple[bytes, bytes]] | None = None
) -> dict[str, Any]:
    from urllib.parse import unquote

    return {
        "type": "http",
        "method": "POST",
        "path": unquote(raw_path.decode()),
        "raw_path": raw_path,
        "root_path": root_path,
        "headers": headers or [],
    }


def test_rollout_headers_name_the_given_or_the_current_rollout() -> None:
    assert rollout_headers("0-1") == {"x-rollout-id": "0-1"}
    assert rollout_headers() == {}
    with rollout_context("r-7"):
        assert rollout_headers() == {"x-rollout-id": "r-7"}
    with pytest.raises(InvalidRolloutIdError):
        rollout_headers("bad id")


def test_repeated_rollout_headers_that_disagree_break_the_grammar() -> None:
    assert rollout_id_from_header([]) is None
    assert rollout_id_from_header([b" a-1 ", b"a-1"]) == "a-1"
    assert rollout_id_from_header([b"a-1", b"b-2"]) == "a-1,b-2"


def test_the_prefix_moves_into_root_path_and_the_path_keeps_it() -> None:
    result = _correlate(_scope(b"/api/ng-rollout/%72-1/v1/chat/completions", root_path="/api"))
    assert isinstance(result, Correlation)
    scope = result.scope
    assert (result.rollout_id, result.source, result.prefixed) == ("r-1", "url_prefix", True)
    assert (result.dialect, result.captured) == ("chat", True)
    assert scope["root_path"] == "/api/ng-rollout/r-1"
    assert scope["path"] == "/api/ng-rollout/r-1/v1/chat/completions"
    assert unprefixed_raw_path(scope) == b"/api/v1/chat/completions"


def test_an_encoded_slash_in_the_id_is_routed_without_the_prefix_and_not_captured() -> None:
    """Before issue 33 this was a 400: capture never fails a call. The id is not a rollout's (never a
    file name); the app routes the model path and the proxy forwards it without the prefix."""
    found = _correlate(_scope(b"/ng-rollout/a%2Fb/v1/chat/completions"))
    assert found.invalid_id == (INVALID_IN_PREFIX, "a/b")
    assert (found.rollout_id, found.dialect, found.captured) == (None, "chat", False)
    assert route_path(found.scope) == "/v1/chat/completions"
    assert unprefixed_raw_path(found.scope) == b"/v1/chat/completions"
    # baggage does not stand in for the id the caller meant
    bagged = _scope(b"/ng-rollout/city%209/v1/responses", headers=[(b"baggage", b"rollout.id=b-1")])
    found = _correlate(bagged)
    assert (found.rollout_id, found.invalid_id, found.captured) == (
        None,
        (INVALID_IN_PREFIX, "city 9"),
        False,
    )


def test_the_header_is_removed_and_loses_to_the_prefix() -> None:
    headers = [(b"x-rollout-id", b"from-header"), (b"x-other", b"kept")]
    result = _correlate(_scope(b"/ng-rollout/from-url/v1/responses", headers=headers))
    assert isinstance(result, Correlation)
    assert (result.rollout_id, result.source) == ("from-url", "url_prefix")
    assert result.scope["headers"] == [(b"x-other", b"kept")]
    found = _correlate(_scope(b"/v1/responses", headers=[(b"x-rollout-id", b"a"), (b"x-rollout-id", b"b")]))
    assert (found.rollout_id, found.invalid_id, found.captured) == (None, (INVALID_IN_HEADER, "a,b"), False)
    assert found.scope["headers"] == []  # removed all the same: never forwarded


def test_a_double_prefix_is_routed_without_both_prefixes_and_not_captured() -> None:
    """Which rollout is meant is anyone's guess: before issue 33 a 400; now served (both prefixes
    stripped, as the caller meant the model path) and not recorded."""
    for raw, route in (
        (b"/ng-rollout/a/ng-rollout/b/v1/chat/completions", "/v1/chat/completions"),
        (b"/ng-rollout/a/ng-rollout/b", "/ng-rollout/a/ng-rollout/b"),
        (b"/ng-rollout/a/%6Eg-rollout/b/v1/responses", "/v1/responses"),  # the app decodes: the same thing
    ):
        found = _correlate(_scope(raw))
        assert found.invalid_id == (INVALID_DOUBLE_PREFIX, "a/b")
        assert found.rollout_id is None and not found.captured
        assert route_path(found.scope) == route
        if route != raw.decode():
            assert unprefixed_raw_path(found.scope) == route.encode()
    # one prefix, and a later segment that merely contains the word, is routed as before
    result = _correlate(_scope(b"/ng-rollout/a/v1/ng-rollout/chat/completions"))
    assert isinstance(result, Correlation) and result.rollout_id == "a"


def test_baggage_and_the_captured_mark_are_decided_with_the_rest() -> None:
    baggage = [(b"baggage", b"rollout.id=from-baggage")]
    result = _correlate(_scope(b"/v1/responses", headers=baggage))
    assert isinstance(result, Correlation)
    assert (result.rollout_id, result.source, result.captured) == ("from-baggage", "baggage", True)
    bad = _correlate(_scope(b"/v1/responses", headers=[(b"baggage", b"rollout.id=bad%20id")]))
    assert isinstance(bad, Correlation)  # ambient context: ignored, never refused
    assert (bad.rollout_id, bad.invalid_baggage_id, bad.captured) == (None, "bad id", False)
    marked = _correlate(_scope(b"/ng-rollout/r/v1/responses", headers=[(b"x-otel-capture", b"captured")]))
    assert isinstance(marked, Correlation) and marked.captured_upstream and not marked.captured
    scope = result.scope_for_capture(mark=True)
    assert (b"x-otel-capture", b"captured") in scope["headers"] and result.scope is not scope


@pytest.mark.parametrize(
    ("path", "name", "route"),
    [
        ("/ng-rollout/r-1/v1/chat/completions", "POST /v1/chat/completions", "/v1/chat/completions"),
        ("/ng-rollout/r-2/responses", "POST /responses", "/responses"),
        ("/v1/messages", "POST /v1/messages", "/v1/messages"),
        ("/ng-rollout/r-3/v1/models", "POST /v1/models", None),  # not a model path: no http.route
    ],
)
def test_server_spans_are_named_without_the_rollout(path: str, name: str, route: str | None) -> None:
    span_name, attributes = server_span_details(_scope(path.encode()))
    assert span_name == name
    assert attributes.get("http.route") == route


def test_the_notice_says_the_first_time_then_counts_what_it_held_back() -> None:
    always = RateLimitedNotice(0.0)
    assert [always.note() for _ in range(3)] == [0, 1, 1]
    rarely = RateLimitedNotice(3600.0)
    assert [rarely.note() for _ in range(3)] == [0, None, None]


def test_the_server_span_is_named_without_any_prefix_even_one_outside_the_grammar() -> None:
    """An id outside the grammar is served (issue 33), so its server span is named: without the id."""
    for raw in (
        b"/ng-rollout/city%209/v1/chat/completions",
        b"/ng-rollout/a%2Fb/v1/chat/completions",
        b"/ng-rollout/a/ng-rollout/b/v1/chat/completions",
        b"/ng-rollout/r-1/v1/chat/completions",
    ):
        name, attributes = server_span_details(_scope(raw))
        assert name == "POST /v1/chat/completions", raw
        assert attributes == {"http.route": "/v1/chat/completions"}
