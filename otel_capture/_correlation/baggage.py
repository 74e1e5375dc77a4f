"""Agent side: put the current rollout id into outgoing W3C ``baggage`` (and the current trace into
``traceparent``), so a captured model server files the call under that rollout, as a child of the agent's
span, without any URL prefix.

The rollout is the one set with :func:`otel_capture._correlation.ids.rollout_context`; outside such a block
requests go out untouched (apart from what the global propagator injects).

Works with ``httpx`` and with ``httpx2`` (the fork the ``openai`` >= 3 and ``anthropic`` >= 2 SDKs are built
on; their ``http_client`` parameter takes an ``httpx2.Client``/``AsyncClient``), sync and async alike,
through the clients' request event hooks:

    client = openai.OpenAI(http_client=instrument_http_client(openai.DefaultHttpxClient()))
    with rollout_context("0-0"):
        client.chat.completions.create(...)   # baggage: rollout.id=0-0

``instrument_http_client(client, rollout_header=True)`` also sets ``x-rollout-id`` (for a gateway that
forwards only ``x-*`` headers; ``docs/gateways.md``).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, TypeVar

from opentelemetry import baggage, propagate
from opentelemetry import context as otel_context

from .ids import BAGGAGE_ROLLOUT_KEY, ROLLOUT_ID_HEADER, current_rollout_id

_HOOKED = "_otel_capture_rollout_baggage"
_HEADER_HOOKED = "_otel_capture_rollout_header"


class _Request(Protocol):
    @property
    def headers(self) -> Any: ...


_C = TypeVar("_C")


def inject_rollout_baggage(headers: Any, rollout_id: str | None = None) -> None:
    """Set ``baggage`` (with ``rollout.id``) and the global propagator's other headers (``traceparent``)
    on a mutable header mapping, for ``rollout_id`` or else the current rollout. Other baggage entries
    (from the current OpenTelemetry context or already on the request) are kept; an existing
    ``rollout.id`` entry is replaced."""
    rollout_id = rollout_id if rollout_id is not None else current_rollout_id()
    if rollout_id is None:
        return
    context = baggage.set_baggage(BAGGAGE_ROLLOUT_KEY, rollout_id, otel_context.get_current())
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    for name, value in carrier.items():
        if name.lower() != "baggage":
            headers[name] = value
    members = [
        member.strip()
        for value in (headers.get("baggage", ""), carrier.get("baggage", ""))
        for member in value.split(",")
        if member.strip() and member.partition("=")[0].strip() != BAGGAGE_ROLLOUT_KEY
    ]
    # ours first: a receiver keeps only the first 8192 bytes / 180 members of a long header
    members = [f"{BAGGAGE_ROLLOUT_KEY}={rollout_id}", *dict.fromkeys(members)]
    headers["baggage"] = ",".join(members)


def rollout_baggage_hook(request: _Request) -> None:
    """A request event hook for synchronous ``httpx``/``httpx2`` clients:
    ``httpx.Client(event_hooks={"request": [rollout_baggage_hook]})``."""
    inject_rollout_baggage(request.headers)


async def async_rollout_baggage_hook(request: _Request) -> None:
    """The same hook for ``AsyncClient`` (whose hooks must be coroutines)."""
    inject_rollout_baggage(request.headers)


def _rollout_header_hook(request: _Request) -> None:
    rollout_id = current_rollout_id()
    if rollout_id is not None:
        request.headers[ROLLOUT_ID_HEADER] = rollout_id


async def _async_rollout_header_hook(request: _Request) -> None:
    _rollout_header_hook(request)


def instrument_http_client(client: _C, *, rollout_header: bool = False) -> _C:
    """Add the rollout-baggage hook to an ``httpx``/``httpx2`` client, sync or async (once), and return
    it: pass the result as an SDK's ``http_client``. With ``rollout_header`` the current rollout also goes
    out as ``x-rollout-id``, which survives gateways that drop ``baggage``."""
    is_async = inspect.iscoroutinefunction(getattr(type(client), "send", None))
    hooks = client.event_hooks  # type: ignore[attr-defined]  # any httpx-like client
    added = []
    if not getattr(client, _HOOKED, False):
        added.append(async_rollout_baggage_hook if is_async else rollout_baggage_hook)
        setattr(client, _HOOKED, True)
    if rollout_header and not getattr(client, _HEADER_HOOKED, False):
        added.append(_async_rollout_header_hook if is_async else _rollout_header_hook)
        setattr(client, _HEADER_HOOKED, True)
    if added:
        hooks["request"] = [*hooks.get("request", []), *added]
        client.event_hooks = hooks  # type: ignore[attr-defined]
    return client
