"""A tiny OTLP receiver for tests: OTLP/HTTP (``POST /v1/traces`` and ``/v1/metrics`` with protobuf bodies;
serve it with ``support.serve``) and OTLP/gRPC traces (:func:`serve_grpc`), decoded with
``opentelemetry-proto`` into plain dicts."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from support import read_body


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs if isinstance(kv, KeyValue)}


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


@dataclass
class ReceivedHistogram:
    name: str
    unit: str
    bounds: list[float]
    count: int
    sum: float
    attributes: dict[str, Any]


@dataclass
class OtlpReceiver:
    spans: list[ReceivedSpan] = field(default_factory=list)
    histograms: list[ReceivedHistogram] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if scope["path"] == "/v1/traces":
            self._traces(body)
            reply = ExportTraceServiceResponse().SerializeToString()
        elif scope["path"] == "/v1/metrics":
            self._metrics(body)
            reply = ExportMetricsServiceResponse().SerializeToString()
        else:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        headers = [(b"content-type", b"application/x-protobuf")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": reply})

    def _traces(self, body: bytes) -> None:
        self.add_traces(ExportTraceServiceRequest.FromString(body))

    def add_traces(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            status_code=span.status.code,
                            attributes=attributes(span.attributes),
                            resource=resource,
                        )
                    )
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()

    def _metrics(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest.FromString(body)
        received = []
        for resource_metrics in request.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.WhichOneof("data") != "histogram":
                        continue
                    for point in metric.histogram.data_points:
                        received.append(
                            ReceivedHistogram(
                                metric.name,
                                metric.unit,
                                list(point.explicit_bounds),
                                point.count,
                                point.sum,
                                attributes(point.attributes),
                            )
                        )
        with self._changed:
            self.histograms.extend(received)
            self._changed.notify_all()

    def wait_for(self, ready: Callable[[OtlpReceiver], bool], timeout: float = 30) -> None:
        """Block until ``ready(self)`` holds (checked on every export), or fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not ready(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"the OTLP receiver did not get what was expected: {self.spans!r}")
                self._changed.wait(remaining)


@contextlib.contextmanager
def serve_grpc(receiver: OtlpReceiver) -> Iterator[str]:
    """Serve ``receiver`` as an OTLP/gRPC trace endpoint on 127.0.0.1 (a free port), without TLS; yields
    ``http://127.0.0.1:<port>`` (the ``http`` scheme tells the gRPC exporter to connect insecurely)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]  # generated, untyped
        def Export(self, request: ExportTraceServiceRequest, context: object) -> ExportTraceServiceResponse:
            receiver.add_traces(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait()
