"""A setting passed in code is honoured end to end, whatever the environment says: each field of
CaptureSettings and WriterSettings, through a real server and a real proxy, with the environment set to
the opposite value."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from support import RECORDED, ReplayModelServer, Reply, Telemetry, serve, sse_chunks

from otel_capture import (
    CaptureSettings,
    CaptureStore,
    ModelCallCaptureMiddleware,
    WriterSettings,
    read_model_call_records,
    start_proxy,
)
from otel_capture import _attributes as A

CONTRARY_ENV = {
    "OTEL_SERVICE_NAME": "from-env",
    "OTEL_CAPTURE_MAX_BODY_BYTES": "1000000",
    "OTEL_CAPTURE_KEEP_RAW_STREAM": "false",
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "no_content",
    "OTEL_CAPTURE_CONTENT_MAX_LENGTH": "100000",
    "OTEL_CAPTURE_SYNC": "auto",
}
CHAT_SSE = (RECORDED / "openai-python/chat_completions_sse/parse_nothing.e2aad469b71d.sse").read_bytes()


@pytest.fixture(autouse=True)
def contrary_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in CONTRARY_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OTEL_EXPORTER_MODEL_CALL_JSONL_DIR", str(tmp_path / "from-env"))


def _one_call(
    settings: CaptureSettings, telemetry: Telemetry, body: dict[str, object], stream: bool = False
) -> None:
    replay = ReplayModelServer()
    if stream:
        replay.replies["chat"] = Reply(content_type="text/event-stream", chunks=sse_chunks(CHAT_SSE))
    app = ModelCallCaptureMiddleware(replay, tracer_provider=telemetry.provider, settings=settings)
    with serve(app) as url:
        response = httpx.post(f"{url}/ng-rollout/code/v1/chat/completions", json=body)
        assert response.status_code == 200


def test_service_name(telemetry: Telemetry) -> None:
    _one_call(CaptureSettings(service_name="from-code"), telemetry, {"model": "m"})
    (record,) = read_model_call_records(telemetry.store, "code")
    assert record.model_ref is not None and record.model_ref.name == "from-code"


def test_max_body_bytes(telemetry: Telemetry) -> None:
    _one_call(CaptureSettings(max_body_bytes=64), telemetry, {"model": "m", "pad": "x" * 500})
    (line,) = (telemetry.store.root / "code.capture.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["truncated"] is True and record["request"] is None and len(record["request_raw"]) <= 64


def test_keep_raw_stream(telemetry: Telemetry) -> None:
    _one_call(CaptureSettings(keep_raw_stream=True), telemetry, {"model": "m", "stream": True}, stream=True)
    (line,) = (telemetry.store.root / "code.capture.jsonl").read_text().splitlines()
    assert json.loads(line)["response_raw"] == CHAT_SSE.decode()


def test_capture_content_and_its_length(telemetry: Telemetry) -> None:
    settings = CaptureSettings(capture_content="span_only", content_max_length=150)
    _one_call(settings, telemetry, {"model": "m", "messages": [{"role": "user", "content": "y" * 200}]})
    (span,) = [s for s in telemetry.spans.get_finished_spans() if s.name.startswith("chat")]
    text = span.attributes[A.GEN_AI_INPUT_MESSAGES]
    assert isinstance(text, str) and "yyyy" in text and len(text) <= 150
    json.loads(text)  # cut string by string: still valid JSON


def test_writer_directory_and_sync(tmp_path: Path) -> None:
    upstream_app = ReplayModelServer()
    writer = WriterSettings(directory=tmp_path / "from-code", sync="fsync")
    with serve(upstream_app) as upstream, start_proxy(upstream, writer=writer) as proxy:
        assert httpx.post(f"{proxy.url}/ng-rollout/code/v1/chat/completions", json={"model": "m"}).is_success
        capture = proxy.server.config.app
        while not isinstance(capture, ModelCallCaptureMiddleware):  # the layers around the capture middleware
            capture = capture.app
        assert capture.sink.settings == writer
        assert capture.sink._writer._syncfs is None  # fsync per file, as asked: syncfs is never called
    assert len(read_model_call_records(CaptureStore(tmp_path / "from-code"), "code")) == 1
    assert not (tmp_path / "from-env").exists()


def test_the_environment_still_applies_when_nothing_is_passed(tmp_path: Path) -> None:
    with serve(ReplayModelServer()) as upstream, start_proxy(upstream) as proxy:
        assert httpx.post(f"{proxy.url}/ng-rollout/env/v1/chat/completions", json={"model": "m"}).is_success
    (record,) = read_model_call_records(CaptureStore(tmp_path / "from-env"), "env")
    assert record.model_ref is not None and record.model_ref.name == "from-env"
