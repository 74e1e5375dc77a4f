"""A middleware built before its tracer provider has the records' exporter still records: the sink is looked
for on its calls until found (the provider set globally later, or the exporter added later). When
``OTEL_TRACES_EXPORTER`` names ``model_call_jsonl`` and no sink is there when a call comes, the middleware
says so, once, instead of writing nothing in silence. Real uvicorn servers, real HTTP calls."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import ReplayModelServer, serve

from otel_capture import CaptureSettings, CaptureStore, ModelCallCaptureMiddleware, read_model_call_records
from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

TESTS = Path(__file__).resolve().parents[1]


def test_an_exporter_added_after_the_middleware_was_built_gets_the_next_calls(tmp_path: Path) -> None:
    provider = TracerProvider()
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    app = ModelCallCaptureMiddleware(ReplayModelServer(), tracer_provider=provider)
    assert app.sink is None
    with serve(app) as url:
        assert httpx.post(f"{url}/ng-rollout/early/v1/chat/completions", json={"model": "m"}).is_success
        exporter = ModelCallJsonlExporter(tmp_path)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        for i in range(2):
            response = httpx.post(f"{url}/ng-rollout/late/v1/chat/completions", json={"model": "m", "i": i})
            assert response.is_success
    provider.shutdown()
    assert app.sink is exporter
    store = CaptureStore(tmp_path)
    assert store.rollout_ids() == ["late"]  # the call before the exporter existed was traced only
    assert [r.request["i"] for r in read_model_call_records(store, "late") if r.request] == [0, 1]
    assert len(spans.get_finished_spans()) == 3


def test_a_global_provider_set_after_the_middleware_was_built_is_found(tmp_path: Path) -> None:
    """In a process of its own: the global provider is set once per process, as an app does at start-up
    after building its ASGI stack."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import httpx
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from support import ReplayModelServer, serve
        from otel_capture import CaptureStore, ModelCallCaptureMiddleware, read_model_call_records
        from otel_capture.exporters.model_call_jsonl import ModelCallJsonlExporter

        app = ModelCallCaptureMiddleware(ReplayModelServer())  # the global provider: not set yet
        assert app.sink is None
        provider = TracerProvider()
        exporter = ModelCallJsonlExporter({str(tmp_path)!r})
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        with serve(app) as url:
            assert httpx.post(url + "/ng-rollout/r-1/v1/responses", json={{"model": "m"}}).is_success
        provider.shutdown()
        assert app.sink is exporter
        print(len(read_model_call_records(CaptureStore({str(tmp_path)!r}), "r-1")))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_no_sink_while_the_records_exporter_is_configured_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    settings = CaptureSettings.from_environ({"OTEL_TRACES_EXPORTER": "otlp, model_call_jsonl"})
    assert settings.records_expected
    app = ModelCallCaptureMiddleware(ReplayModelServer(), tracer_provider=provider, settings=settings)
    with caplog.at_level(logging.WARNING, logger="otel_capture._capture.middleware"), serve(app) as url:
        for _ in range(3):
            assert httpx.post(f"{url}/ng-rollout/r/v1/messages", json={"model": "m"}).is_success
    provider.shutdown()
    said = [r.getMessage() for r in caplog.records if "no model_call_jsonl exporter" in r.getMessage()]
    assert len(said) == 1
    assert "OTEL_TRACES_EXPORTER" in said[0] and "not recorded" in said[0]


def test_no_warning_when_the_records_exporter_is_not_configured(caplog: pytest.LogCaptureFixture) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    settings = CaptureSettings.from_environ({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not settings.records_expected
    app = ModelCallCaptureMiddleware(ReplayModelServer(), tracer_provider=provider, settings=settings)
    with caplog.at_level(logging.WARNING, logger="otel_capture._capture.middleware"), serve(app) as url:
        assert httpx.post(f"{url}/ng-rollout/r/v1/messages", json={"model": "m"}).is_success
    provider.shutdown()
    assert not [r for r in caplog.records if "model_call_jsonl" in r.getMessage()]
