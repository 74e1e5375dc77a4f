"""The agent-side httpx integration: the current rollout id goes into outgoing W3C baggage, the current
trace into traceparent, with httpx and httpx2 (what the openai/anthropic SDKs are built on), sync and async."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import httpx2
import pytest
from opentelemetry import baggage
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider

from otel_capture import inject_rollout_baggage, instrument_http_client, rollout_context


def _echo(request: Any) -> Any:
    module = httpx2 if isinstance(request, httpx2.Request) else httpx
    return module.Response(200, json=dict(request.headers))


@pytest.mark.parametrize("module", [httpx, httpx2], ids=["httpx", "httpx2"])
def test_sync_client_sends_the_current_rollout_in_baggage(module: Any) -> None:
    client = instrument_http_client(module.Client(transport=module.MockTransport(_echo)))
    assert instrument_http_client(client) is client  # once only
    with client:
        outside = client.get("http://model/v1/x").json()
        with rollout_context("r-1"):
            inside = client.get("http://model/v1/x", headers={"baggage": "user=alice,rollout.id=old"}).json()
    assert "baggage" not in outside
    assert inside["baggage"] == "rollout.id=r-1,user=alice"
    assert len(client.event_hooks["request"]) == 1


@pytest.mark.parametrize("module", [httpx, httpx2], ids=["httpx", "httpx2"])
def test_async_client_sends_the_current_rollout_in_baggage(module: Any) -> None:
    async def main() -> dict[str, str]:
        async with instrument_http_client(
            module.AsyncClient(transport=module.MockTransport(_echo))
        ) as client:
            with rollout_context("r-async"):
                response = await client.get("http://model/v1/x")
        return response.json()  # type: ignore[no-any-return]

    assert asyncio.run(main())["baggage"] == "rollout.id=r-async"


def test_the_current_trace_and_other_baggage_go_along() -> None:
    provider = TracerProvider()
    token = otel_context.attach(baggage.set_baggage("tenant", "t1"))
    try:
        with provider.get_tracer("agent").start_as_current_span("step") as span, rollout_context("r-2"):
            headers: dict[str, str] = {}
            inject_rollout_baggage(headers)
    finally:
        otel_context.detach(token)
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert headers["traceparent"].split("-")[1] == trace_id
    assert headers["baggage"].split(",")[0] == "rollout.id=r-2"
    assert "tenant=t1" in headers["baggage"].split(",")


def test_an_explicit_rollout_id_needs_no_context() -> None:
    headers: dict[str, str] = {}
    inject_rollout_baggage(headers, "r-3")
    assert headers["baggage"] == "rollout.id=r-3"
