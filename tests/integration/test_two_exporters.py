"""Two tracer providers with two JSONL exporters in one process: each middleware writes through the exporter
of its own provider, records and in-flight markers alike (one route for a record)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from support import Gate, ReplayModelServer, Reply, recorded_json, serve

from otel_capture import CaptureStore, ModelCallCaptureMiddleware, read_model_call_records
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter


def test_each_middleware_writes_through_its_own_providers_exporter(tmp_path: Path) -> None:
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    provider_a, provider_b = TracerProvider(), TracerProvider()
    provider_a.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(dir_a)))
    # the second one as zero-code builds it: behind the batch processor, made last (it used to win every call)
    provider_b.add_span_processor(BatchSpanProcessor(ModelCallJsonlExporter(dir_b)))
    app_a = ModelCallCaptureMiddleware(ReplayModelServer(), tracer_provider=provider_a)
    app_b = ModelCallCaptureMiddleware(ReplayModelServer(), tracer_provider=provider_b)
    with serve(app_a) as url_a, serve(app_b) as url_b:
        for i in range(3):
            assert httpx.post(
                f"{url_a}/ng-rollout/ra/v1/chat/completions", json={"model": "m", "i": i}
            ).is_success
            assert httpx.post(f"{url_b}/ng-rollout/rb/v1/responses", json={"model": "m", "i": i}).is_success
    provider_a.shutdown()
    provider_b.shutdown()

    store_a, store_b = CaptureStore(dir_a), CaptureStore(dir_b)
    assert store_a.rollout_ids() == ["ra"] and store_b.rollout_ids() == ["rb"]
    assert [r.request["i"] for r in read_model_call_records(store_a, "ra") if r.request] == [0, 1, 2]
    assert [r.request["i"] for r in read_model_call_records(store_b, "rb") if r.request] == [0, 1, 2]
    # no phantom in-flight call in either directory: a freeze sees each rollout complete
    for store, rid in ((store_a, "ra"), (store_b, "rb")):
        snapshot = store.freeze_now(rid)
        assert not snapshot.incomplete and len(snapshot.records) == 3


def test_a_call_in_flight_is_announced_only_in_its_own_directory(tmp_path: Path) -> None:
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    provider_a, provider_b = TracerProvider(), TracerProvider()
    provider_a.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(dir_a)))
    provider_b.add_span_processor(SimpleSpanProcessor(ModelCallJsonlExporter(dir_b)))
    gate = Gate()
    upstream = ReplayModelServer()
    upstream.replies["chat"] = Reply(chunks=[b"", recorded_json("chat")], gate=gate, gate_after=1)
    app_a = ModelCallCaptureMiddleware(upstream, tracer_provider=provider_a)
    with serve(app_a) as url_a:
        call = threading.Thread(
            target=httpx.post,
            args=(f"{url_a}/ng-rollout/shared-id/v1/chat/completions",),
            kwargs={"json": {"model": "m"}},
        )
        call.start()
        assert gate.reached.wait(10)
        try:
            # in flight in A: a freeze there reports it; B never heard of the call
            assert CaptureStore(dir_a).freeze_now("shared-id").incomplete
            assert not CaptureStore(dir_b).freeze_now("shared-id").incomplete
        finally:
            gate.open()
            call.join()
    provider_a.shutdown()
    provider_b.shutdown()
