"""The capture middleware's per-call shortcuts agree with the plain forms they replace: the response headers
read in one pass, the propagators reading the request's headers where they are, one timer for all the
durability deadlines of a loop, and the metric attribute sets made once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from opentelemetry import baggage, propagate
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.trace import get_current_span
from support import metric_points

from otel_capture import _attributes as A
from otel_capture._capture.middleware import _Deadlines, _NotDurableInTime
from otel_capture._capture.propagation import HEADERS_GETTER
from otel_capture._correlation import response_headers
from otel_capture._correlation.routing import content_length, first_header, headers_by_name
from otel_capture._telemetry import ServerMetrics

_CASES: list[list[tuple[bytes, bytes]]] = [
    [],
    [(b"content-type", b"application/json"), (b"content-length", b"12")],
    [(b"Content-Type", b"text/event-stream"), (b"Content-Encoding", b"gzip")],
    [
        (b"content-length", b" 7 "),
        (b"content-length", b"9"),
        (b"content-type", b"a"),
        (b"content-type", b"b"),
    ],
    [(b"content-length", b"x1"), (b"content-encoding", b"br"), (b"content-encoding", b"gzip")],
    [(b"content-length", b""), (b"x-other", b"1")],
]


@pytest.mark.parametrize("headers", _CASES)
def test_response_headers_in_one_pass_read_what_first_header_and_content_length_read(
    headers: list[tuple[bytes, bytes]],
) -> None:
    assert response_headers(headers) == (
        first_header(headers, b"content-type"),
        first_header(headers, b"content-encoding"),
        content_length(headers),
    )


def test_the_propagators_read_the_headers_as_from_a_decoded_copy() -> None:
    scope: dict[str, Any] = {
        "headers": [
            (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            (b"baggage", b"rollout.id=r1"),
            (b"baggage", b"k=v"),
            (b"host", b"example"),
        ]
    }
    headers = headers_by_name(scope)
    copy = {k: b",".join(v).decode("latin-1") for k, v in headers.items()}
    ours = propagate.extract(headers, getter=HEADERS_GETTER)
    plain = propagate.extract(copy)
    assert get_current_span(ours).get_span_context() == get_current_span(plain).get_span_context()
    assert get_current_span(ours).get_span_context().is_valid
    assert baggage.get_all(ours) == baggage.get_all(plain) == {"rollout.id": "r1", "k": "v"}
    assert propagate.extract({}, getter=HEADERS_GETTER) == propagate.extract({})


def test_a_wait_past_its_deadline_fails_and_ended_waits_are_dropped() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        deadlines = _Deadlines(loop, 0.01)
        durable: asyncio.Future[None] = loop.create_future()
        stalled: asyncio.Future[None] = loop.create_future()
        deadlines.add(durable)
        deadlines.add(stalled)
        durable.set_result(None)  # resolved by the writer before its deadline: left alone
        with pytest.raises(_NotDurableInTime):
            await stalled
        assert durable.result() is None
        later: asyncio.Future[None] = loop.create_future()
        deadlines.add(later)  # the timer is armed again for a wait added after the queue emptied
        with pytest.raises(_NotDurableInTime):
            await later
        assert not deadlines._queue

    asyncio.run(run())


def test_metric_attribute_sets_are_made_once_per_combination_and_keep_only_the_metric_attributes() -> None:
    reader = InMemoryMetricReader()
    server = ServerMetrics(MeterProvider(metric_readers=[reader]))
    span_attributes = {
        A.GEN_AI_OPERATION_NAME: "chat",
        A.GEN_AI_PROVIDER_NAME: "openai",
        A.GEN_AI_REQUEST_MODEL: "m",
        A.SERVER_ADDRESS: "h",
        A.SERVER_PORT: 80,
        A.ROLLOUT_ID: "never-a-metric-attribute",
    }
    server.record(span_attributes, 0.1, None, None)
    server.record(dict(span_attributes, **{A.ROLLOUT_ID: "another"}), 0.2, None, None)
    server.record(dict(span_attributes, **{A.ERROR_TYPE: "timeout"}), 0.3, None, None)
    assert len(server._attribute_sets) == 2
    points = metric_points(reader, A.METRIC_SERVER_REQUEST_DURATION)
    expected = {k: v for k, v in span_attributes.items() if k != A.ROLLOUT_ID}
    assert sorted(((dict(p.attributes), p.count) for p in points), key=str) == sorted(
        [(expected, 2), ({**expected, A.ERROR_TYPE: "timeout"}, 1)], key=str
    )
