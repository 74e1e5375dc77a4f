"""The capture's own cost, reported by itself as OTel metrics (``otel_capture.capture.duration`` and
``otel_capture.durability_wait.duration``), read from an ``InMemoryMetricReader`` after real calls through a
real uvicorn server and the official SDK."""

from __future__ import annotations

from typing import Any

import openai
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support import RECORDED, ReplayModelServer, Reply, Telemetry, serve, sse_chunks

from otel_capture import CaptureSettings, ModelCallCaptureMiddleware, read_model_call_records
from otel_capture import _attributes as A
from otel_capture._telemetry.metrics import CAPTURE_DURATION, DURABILITY_WAIT_DURATION

CHAT_SSE = (RECORDED / "openai-python/chat_completions_sse/parse_nothing.e2aad469b71d.sse").read_bytes()
CHUNK_DELAY_S = 0.02  # the app's own pause before each chunk: time the capture must not count as its own


def _points(reader: InMemoryMetricReader) -> dict[str, Any]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: metric.data.data_points
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
    }


def test_the_capture_reports_its_own_time_and_the_durability_wait_per_call(
    replay_server: ReplayModelServer, telemetry: Telemetry
) -> None:
    reader = InMemoryMetricReader()
    chunks = sse_chunks(CHAT_SSE)
    replay_server.replies["chat"] = Reply(content_type="text/event-stream", chunks=chunks)
    replay_server.chunk_delay = CHUNK_DELAY_S
    app = ModelCallCaptureMiddleware(
        replay_server,
        tracer_provider=telemetry.provider,
        meter_provider=MeterProvider(metric_readers=[reader]),
        settings=CaptureSettings(),
    )
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/ng-rollout/cost/v1", api_key="k", max_retries=0)
        for _ in range(2):
            list(
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=True
                )
            )
        client.close()
    assert len(read_model_call_records(telemetry.store, "cost")) == 2  # both calls were recorded

    points = _points(reader)
    (capture,) = points[CAPTURE_DURATION]
    (wait,) = points[DURABILITY_WAIT_DURATION]
    assert dict(capture.attributes) == dict(wait.attributes) == {A.MODEL_CALL_DIALECT: "chat"}
    assert capture.count == 2 and wait.count == 2  # one of each per call
    # the capture's own time is not the app's: each call waited len(chunks) x 20 ms for the app alone
    app_time = 2 * len(chunks) * CHUNK_DELAY_S
    assert 0 < capture.sum < app_time / 2
    assert wait.sum > 0
    assert capture.explicit_bounds[0] < 1e-4 and wait.explicit_bounds[-1] >= 10  # µs to seconds
