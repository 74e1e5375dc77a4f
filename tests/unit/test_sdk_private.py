"""Each private attribute of the OpenTelemetry SDK that otel-capture reads (otel_capture._sdk_private),
pinned against the installed SDK: a release that renames one fails here, loudly, instead of leaving a
middleware that finds no sink and writes no records."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import attributes as otel_attributes
from opentelemetry import metrics, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.metrics import _internal as metrics_api
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk import _configuration as sdk_configuration
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_capture import _sdk_private as sdk
from otel_capture._capture.sink import find_sink
from otel_capture._telemetry.metrics import MeterGate
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter


def test_the_provider_keeps_its_processors_where_they_are_read() -> None:
    provider = TracerProvider()
    multi = provider._active_span_processor  # read as is: an AttributeError here is the rename
    assert multi._span_processors == ()
    simple = SimpleSpanProcessor(InMemorySpanExporter())
    provider.add_span_processor(simple)
    before = multi._span_processors
    assert before == (simple,) and sdk.span_processors(provider) is before
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    # a new tuple per processor added: the sink lookup tells a change by identity
    assert sdk.span_processors(provider) is not before and len(multi._span_processors) == 2
    assert provider._disabled is False and sdk.provider_disabled(provider) is False
    assert sdk.span_processors(trace.NoOpTracerProvider()) is None
    provider.shutdown()


def test_each_sdk_processor_keeps_its_exporter_where_it_is_read() -> None:
    exporter = InMemorySpanExporter()
    simple = SimpleSpanProcessor(exporter)
    assert simple.span_exporter is exporter and sdk.processor_exporter(simple) is exporter
    batch = BatchSpanProcessor(exporter)
    try:
        held = getattr(batch, "span_exporter", None) or batch._batch_processor._exporter
        assert held is exporter and sdk.processor_exporter(batch) is exporter
    finally:
        batch.shutdown()


def test_the_sdk_configuration_helpers_read_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,model_call_jsonl")
    assert sdk_configuration._get_exporter_names("traces") == ["console", "model_call_jsonl"]
    assert sdk.configured_exporter_names() == ["console", "model_call_jsonl"]
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    sampler = sdk.configured_sampler()
    assert isinstance(sampler, Sampler) and "0.25" in sampler.get_description()


def test_a_provider_of_the_sdk_without_its_processors_is_an_error_in_the_log(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdk, "_reported", set())  # logged once per process: this test's own once
    provider = TracerProvider()
    exporter = ModelCallJsonlExporter(tmp_path)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert find_sink(provider) is exporter
    renamed = provider._active_span_processor
    del provider._active_span_processor  # what an SDK that renamed it looks like
    with caplog.at_level(logging.ERROR, logger="otel_capture._sdk_private"):
        assert find_sink(provider) is None
        assert find_sink(provider) is None
    errors = [r for r in caplog.records if "_active_span_processor" in r.getMessage()]
    assert len(errors) == 1 and "opentelemetry-sdk" in errors[0].getMessage()
    provider._active_span_processor = renamed
    provider.shutdown()


def test_contribs_fastapi_instrumentation_marks_the_app_it_wrapped() -> None:
    fastapi = pytest.importorskip("fastapi")
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    app = fastapi.FastAPI()
    assert sdk.instrumented_by_contrib(app) is False
    FastAPIInstrumentor.instrument_app(app, tracer_provider=TracerProvider())
    try:
        assert app._is_instrumented_by_opentelemetry is True  # read as is: the rename fails here
        assert sdk.instrumented_by_contrib(app) is True
    finally:
        FastAPIInstrumentor.uninstrument_app(app)
    assert sdk.instrumented_by_contrib(app) is False


def test_the_meter_provider_keeps_its_readers_where_they_are_read() -> None:
    alone = MeterProvider()
    consumer = alone._measurement_consumer  # read as is: an AttributeError here is the rename
    assert consumer._reader_storages == {} and sdk.measurement_consumer(alone) is consumer
    assert sdk.has_metric_readers(consumer) is False and MeterGate(alone).recording is False
    read = MeterProvider(metric_readers=[InMemoryMetricReader()])
    assert (
        sdk.has_metric_readers(sdk.measurement_consumer(read)) is True and MeterGate(read).recording is True
    )
    assert sdk.measurement_consumer(metrics.NoOpMeterProvider()) is None
    alone.shutdown()
    read.shutdown()


def test_the_api_stand_in_keeps_the_provider_set_behind_it_where_it_is_read() -> None:
    stand_in = metrics_api._ProxyMeterProvider()  # read as is: the rename fails here
    assert stand_in._real_meter_provider is None
    assert sdk.is_meter_provider_stand_in(stand_in) and sdk.meter_provider_pending(stand_in)
    assert MeterGate(stand_in).recording is False
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    stand_in.on_set_meter_provider(provider)
    assert stand_in._real_meter_provider is provider and not sdk.meter_provider_pending(stand_in)
    assert not sdk.is_meter_provider_stand_in(provider)
    provider.shutdown()


def test_a_meter_provider_of_the_sdk_without_its_readers_is_an_error_in_the_log(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdk, "_reported", set())  # logged once per process: this test's own once
    provider = MeterProvider()
    consumer = provider._measurement_consumer
    storages = consumer._reader_storages
    del consumer._reader_storages  # what an SDK that renamed it looks like
    with caplog.at_level(logging.ERROR, logger="otel_capture._sdk_private"):
        gate = MeterGate(provider)
        assert gate.recording is True and gate.recording is True  # assumed to record, as a vendor's
        del provider._measurement_consumer
        assert MeterGate(provider).recording is True
    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 2 and all("opentelemetry-sdk" in e for e in errors)
    assert "_reader_storages" in errors[0] and errors[1].endswith(
        "has no MeterProvider._measurement_consumer: metrics are recorded as if a reader were there; "
        "otel-capture needs an update for this SDK"
    )
    consumer._reader_storages = storages
    provider._measurement_consumer = consumer
    provider.shutdown()


def test_the_sdk_otlp_span_exporters_encode_where_the_capture_puts_its_encoder(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    methods = sdk.http_encoding_methods(HttpExporter)
    assert methods and all("encode_spans" in getattr(HttpExporter, m).__code__.co_names for m in methods)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    assert sdk.grpc_request_class(GrpcExporter) is ExportTraceServiceRequest
    assert "encode_spans" in GrpcExporter._translate_data.__code__.co_names
    with caplog.at_level(logging.ERROR, logger="otel_capture._sdk_private"):
        assert sdk.http_encoding_methods(object) == [] and sdk.grpc_request_class(object) is None
    assert "the same bytes, more CPU" in caplog.text


def test_the_composite_propagator_keeps_its_propagators_where_they_are_read() -> None:
    inner = [TraceContextTextMapPropagator(), W3CBaggagePropagator()]
    composite = CompositePropagator(inner)
    assert list(composite._propagators) == inner  # read as is: an AttributeError here is the rename
    assert sdk.composite_propagators(composite) == tuple(inner)


def test_the_default_parent_based_sampler_keeps_its_delegates_where_they_are_read() -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    sampler = TracerProvider().sampler
    assert type(sampler) is ParentBased  # the SDK's default, without OTEL_TRACES_SAMPLER
    assert sampler._root is ALWAYS_ON  # read as is: an AttributeError here is the rename
    assert sampler._remote_parent_sampled is ALWAYS_ON and sampler._local_parent_sampled is ALWAYS_ON
    assert sampler._remote_parent_not_sampled is ALWAYS_OFF
    assert sampler._local_parent_not_sampled is ALWAYS_OFF
    assert sdk.is_default_parent_based(sampler)


# -- the capture's own span attributes, stored without the SDK's check of every value ----------------------

_OWN_ATTRIBUTES = {
    "gen_ai.operation.name": "chat",
    "gen_ai.request.model": "m",
    "gen_ai.request.max_tokens": 16,
    "gen_ai.request.temperature": 0.5,
    "gen_ai.request.stream": False,
    "gen_ai.response.finish_reasons": ["stop", "length"],  # a list: stored as a tuple
    "gen_ai.request.stop_sequences": ("\n",),
}


def _two_spans(limits: SpanLimits | None = None) -> tuple[Any, Any]:
    tracer = TracerProvider(span_limits=limits).get_tracer("t")
    return tracer.start_span("by the sdk"), tracer.start_span("by the capture")


def _stored(span: Any) -> list[tuple[str, Any]]:
    return list(span.attributes.items())  # in order, with each value's own type


def test_the_capture_stores_its_attributes_as_set_attributes_does(monkeypatch: pytest.MonkeyPatch) -> None:
    by_sdk, by_capture = _two_spans()
    by_sdk.set_attributes(_OWN_ATTRIBUTES)
    checked: list[object] = []
    check = otel_attributes._clean_attribute_value
    monkeypatch.setattr(otel_attributes, "_clean_attribute_value", lambda *a: checked.append(a) or check(*a))
    sdk.set_clean_attributes(by_capture, _OWN_ATTRIBUTES)
    # a key set again moves to the end, as the SDK's own set does; the list is a tuple there too
    again = {"gen_ai.request.model": "m2", "http.response.status_code": 200}
    sdk.set_clean_attributes(by_capture, again)
    monkeypatch.undo()
    by_sdk.set_attributes(again)
    assert _stored(by_capture) == _stored(by_sdk)
    assert dict(by_capture.attributes)["gen_ai.response.finish_reasons"] == ("stop", "length")
    assert list(by_capture.attributes)[-2:] == ["gen_ai.request.model", "http.response.status_code"]
    # read where it is stored, no value checked: the private attributes are there on this SDK
    assert checked == [] and isinstance(by_capture._attributes, otel_attributes.BoundedAttributes)
    assert by_capture._attributes._dict is not None and by_capture._lock is not None


@pytest.mark.parametrize(
    ("limits", "attributes"),
    [
        (SpanLimits(max_span_attribute_length=3), _OWN_ATTRIBUTES),  # values cut, with the SDK's warning
        (SpanLimits(max_span_attributes=3), _OWN_ATTRIBUTES),  # the oldest dropped and counted
        (None, {"a": None, "b": b"x", "c": {"d": 1}}),  # types the SDK's check changes or keeps its way
        (None, {"a": ["x", {"y": 1}], "b": 1}),  # a list of an odd value
    ],
    ids=["value length limit", "count limit", "other types", "odd list"],
)
def test_whatever_the_sdks_check_would_change_goes_through_it(
    limits: SpanLimits | None, attributes: dict[str, Any]
) -> None:
    by_sdk, by_capture = _two_spans(limits)
    by_sdk.set_attributes(attributes)
    sdk.set_clean_attributes(by_capture, attributes)
    assert _stored(by_capture) == _stored(by_sdk)
    assert by_capture.dropped_attributes == by_sdk.dropped_attributes


def test_an_ended_span_keeps_its_attributes(caplog: pytest.LogCaptureFixture) -> None:
    _, span = _two_spans()
    span.set_attributes({"a": 1})
    span.end()
    with caplog.at_level(logging.WARNING):
        sdk.set_clean_attributes(span, {"a": 2, "b": "x"})
    assert dict(span.attributes) == {"a": 1}
    assert "Setting attribute on ended span" in caplog.text  # the SDK's own word on it


def test_a_span_not_of_the_sdk_gets_set_attributes() -> None:
    class Recording(trace.NonRecordingSpan):
        def __init__(self) -> None:
            super().__init__(trace.INVALID_SPAN_CONTEXT)
            self.seen: dict[str, Any] = {}

        def set_attributes(self, attributes: Any) -> None:
            self.seen.update(attributes)

    span = Recording()
    sdk.set_clean_attributes(span, _OWN_ATTRIBUTES)
    assert span.seen == _OWN_ATTRIBUTES


@pytest.mark.parametrize("read", [*sdk._BOUNDED_READ, "span lock"])
def test_a_renamed_private_attribute_costs_the_check_not_the_attributes(
    read: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SDK that keeps one of them under another name (looked for here under a name it does not have):
    one error in the log, and the attributes set by the SDK's own ``set_attributes``, never an exception in
    a call's path."""
    monkeypatch.setattr(sdk, "_reported", set())
    monkeypatch.setattr(sdk, "_READABLE", {})  # looked at once per span class: this test's own look
    if read == "span lock":
        monkeypatch.setattr(sdk, "_SPAN_LOCK", "_renamed")
    else:
        names = tuple("_renamed" if name == read else name for name in sdk._BOUNDED_READ)
        monkeypatch.setattr(sdk, "_BOUNDED_READ", names)
    by_sdk, by_capture = _two_spans()
    by_sdk.set_attributes(_OWN_ATTRIBUTES)
    with caplog.at_level(logging.ERROR, logger="otel_capture._sdk_private"):
        sdk.set_clean_attributes(by_capture, _OWN_ATTRIBUTES)
        sdk.set_clean_attributes(by_capture, _OWN_ATTRIBUTES)
    errors = [r for r in caplog.records if "BoundedAttributes" in r.getMessage()]
    assert len(errors) == 1 and "opentelemetry-sdk" in errors[0].getMessage()
    assert _stored(by_capture) == _stored(by_sdk)
