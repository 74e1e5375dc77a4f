"""vLLM's own span nests under the model-call span, zero-code too: vLLM (``--otlp-traces-endpoint``) takes
its trace parent from the request's headers only, so the capture hands the app the call span's context in
``traceparent`` (the caller's ``tracestate`` and ``baggage`` kept). Both vLLM's spans and ours go to one
real OTLP receiver; each ``llm_request`` span (with vLLM's queue, prefill and decode times) is the child of
its call's span, in the caller's trace."""

from __future__ import annotations

import json
from typing import Any

import pytest
from otlp_receiver import OtlpReceiver, ReceivedSpan
from support import rollout_client
from vllm_backend import MODEL_NAME, Proxy, Vllm

from otel_capture import read_model_call_records

pytestmark = pytest.mark.vllm

TRACESTATE = "vendor=abc"


def _traceparent(n: int) -> tuple[str, str]:
    trace_id, parent_id = f"{n:032x}", f"{n + 0xABC:016x}"
    return trace_id, f"00-{trace_id}-{parent_id}-01"


def _trace(receiver: OtlpReceiver, trace_id: str, *, services: int) -> dict[str, list[ReceivedSpan]]:
    """The trace's spans by name, once the model-call span(s) and vLLM's ``llm_request`` have arrived."""

    def spans() -> list[ReceivedSpan]:
        return [s for s in receiver.spans if s.trace_id == trace_id]

    def ready(_: OtlpReceiver) -> bool:
        names = [s.name for s in spans()]
        return "llm_request" in names and sum(n.startswith("chat ") for n in names) >= services

    receiver.wait_for(ready, timeout=120)  # vLLM's batch processor exports every 5 s
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in spans():
        by_name.setdefault(span.name, []).append(span)
    return by_name


def _headers(traceparent: str) -> dict[str, str]:
    return {"traceparent": traceparent, "tracestate": TRACESTATE, "baggage": "team=rl"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_zero_code_llm_request_is_a_child_of_the_model_call_span(
    vllm: Vllm, otlp: tuple[OtlpReceiver, str], stream: bool
) -> None:
    receiver, _ = otlp
    trace_id, traceparent = _traceparent(0x5EED01 + stream)
    rollout_id = f"trace-zero-code-{int(stream)}"
    with rollout_client(vllm.url, rollout_id, timeout=300) as client:
        request: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
        if stream:
            list(
                client.chat.completions.create(
                    **request, max_tokens=4, stream=True, extra_headers=_headers(traceparent)
                )
            )
        else:
            client.chat.completions.create(**request, max_tokens=4, extra_headers=_headers(traceparent))
    spans = _trace(receiver, trace_id, services=1)
    (call,) = spans[f"chat {MODEL_NAME}"]
    (engine,) = spans["llm_request"]
    assert call.resource["service.name"] == "vllm-under-test"
    assert engine.parent_span_id == call.span_id  # vLLM's span under ours, not a root of its own
    # vLLM's own timings, now in the call's trace
    assert {"gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token"} <= set(engine.attributes)
    (record,) = read_model_call_records(vllm.store, rollout_id)
    assert (record.trace_id, record.span_id) == (trace_id, call.span_id)


def test_through_the_proxy_llm_request_is_a_child_of_the_proxys_span(
    proxy: Proxy, vllm: Vllm, otlp: tuple[OtlpReceiver, str]
) -> None:
    receiver, _ = otlp
    trace_id, traceparent = _traceparent(0x5EED10)
    with rollout_client(proxy.url, "trace-proxy", timeout=300) as client:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_headers=_headers(traceparent),
        )
    spans = _trace(receiver, trace_id, services=1)
    (call,) = spans[f"chat {MODEL_NAME}"]  # one: the zero-code layer behind the proxy passes it through
    (engine,) = spans["llm_request"]
    assert call.resource["service.name"] == "capture-proxy"
    assert engine.parent_span_id == call.span_id
    assert len(read_model_call_records(proxy.store, "trace-proxy")) == 1
    assert "trace-proxy" not in vllm.store.rollout_ids()  # one call, one record


def test_every_llm_request_of_a_captured_call_is_the_child_of_its_call_span(
    vllm: Vllm, otlp: tuple[OtlpReceiver, str]
) -> None:
    """Over every call the session made so far (the other vLLM tests), not only the ones above."""
    receiver, _ = otlp
    # one call of our own last, so at least one is here once its spans arrived
    trace_id, traceparent = _traceparent(0x5EED20)
    with rollout_client(vllm.url, "trace-all", timeout=300) as client:
        client.responses.create(
            model=MODEL_NAME, input="Hi", max_output_tokens=4, extra_headers=_headers(traceparent)
        )
    _trace(receiver, trace_id, services=0)
    calls = {s.span_id: s for s in receiver.spans if s.name.startswith("chat ")}
    engines = [s for s in receiver.spans if s.name == "llm_request"]
    uncorrelated_traces = {s.trace_id for s in engines} - {s.trace_id for s in calls.values()}
    captured = [s for s in engines if s.trace_id not in uncorrelated_traces]
    assert captured
    orphans = [
        json.dumps({"trace": s.trace_id, "parent": s.parent_span_id})
        for s in captured
        if s.parent_span_id not in calls
    ]
    assert orphans == []
