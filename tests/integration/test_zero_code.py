"""Zero-code: an unmodified FastAPI model app under ``opentelemetry-instrument uvicorn``, configured by
environment variables only, called with the official SDKs; records in the JSONL directory and spans and
metrics at a real OTLP/HTTP receiver (protobuf decoded with opentelemetry-proto)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from otlp_receiver import OtlpReceiver
from support import serve
from zero_code import BIN, instrumented_model_server

from otel_capture import CaptureStore, instrument_http_client, read_model_call_records, rollout_context
from otel_capture import _attributes as A

SERVER = 2  # OTLP Span.SpanKind SPAN_KIND_SERVER


@pytest.fixture
def receiver() -> Iterator[tuple[OtlpReceiver, str]]:
    otlp = OtlpReceiver()
    with serve(otlp) as url:
        yield otlp, url


def _env(receiver_url: str, capture_dir: Path, disabled: str) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp,model_call_jsonl",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver_url,
        "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": str(capture_dir),
        "OTEL_SERVICE_NAME": "recorded-model",
        # Batch export only at shutdown: the records must not wait for it.
        "OTEL_BSP_SCHEDULE_DELAY": "600000",
        "OTEL_METRIC_EXPORT_INTERVAL": "600000",
        "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": disabled,
        "OTEL_PYTHON_EXCLUDED_URLS": "/health$",  # the readiness probe: no span, no metric
    }


def _prefixed_calls(url: str, store: CaptureStore) -> None:
    """Three calls under /ng-rollout/zc-0/ with the official SDKs; each record is durable as soon as the
    SDK returns, while the batch processor still holds every span."""
    with openai.OpenAI(base_url=f"{url}/ng-rollout/zc-0/v1", api_key="k", max_retries=0) as oai:
        oai.responses.create(model="gpt-4o-mini", input="hi")
        assert len(read_model_call_records(store, "zc-0")) == 1
        chunks = list(
            oai.chat.completions.create(
                model="gpt-4o",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None
        assert len(read_model_call_records(store, "zc-0")) == 2
    with anthropic.Anthropic(base_url=f"{url}/ng-rollout/zc-0", api_key="k", max_retries=0) as claude:
        claude.messages.create(
            model="claude-test", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
        )
    assert len(read_model_call_records(store, "zc-0")) == 3


@pytest.mark.parametrize("fastapi_instrumentation", ["off", "on"])
def test_unmodified_fastapi_app_under_opentelemetry_instrument(
    receiver: tuple[OtlpReceiver, str], tmp_path: Path, fastapi_instrumentation: str
) -> None:
    otlp, otlp_url = receiver
    store = CaptureStore(tmp_path / "calls")
    env = _env(otlp_url, store.root, "fastapi" if fastapi_instrumentation == "off" else "")
    agent_provider = TracerProvider()
    agent_spans = InMemorySpanExporter()
    agent_provider.add_span_processor(SimpleSpanProcessor(agent_spans))
    with instrumented_model_server(env) as server:
        _prefixed_calls(server.url, store)
        # an agent with the httpx integration: the rollout id travels only in baggage
        http_client = instrument_http_client(openai.DefaultHttpxClient())
        with (
            openai.OpenAI(
                base_url=f"{server.url}/v1", api_key="k", max_retries=0, http_client=http_client
            ) as agent,
            agent_provider.get_tracer("agent").start_as_current_span("agent step", kind=SpanKind.CLIENT),
            rollout_context("zc-bag"),
        ):
            agent.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        assert len(read_model_call_records(store, "zc-bag")) == 1
        assert otlp.spans == []  # nothing exported yet: the records did not come from the batch export
        output = server.stop()
    # uvicorn re-raises SIGTERM after its graceful shutdown
    assert server.process.returncode in (0, -signal.SIGTERM), output

    otlp.wait_for(lambda r: sum(s.name.startswith("chat ") for s in r.spans) == 4)
    records = read_model_call_records(store, "zc-0") + read_model_call_records(store, "zc-bag")
    by_id = {s.span_id: s for s in otlp.spans}
    model_spans = [s for s in otlp.spans if s.name.startswith("chat ")]
    server_spans = [s for s in otlp.spans if s.kind == SERVER and s.name.startswith("POST")]
    assert len(server_spans) == 4, "exactly one HTTP server span per call (no double wrapping)"
    # named by the route, never by the rollout (one operation per route in the backend), with or without
    # the FastAPI instrumentation (which names a path no route matched by its method alone)
    assert sorted(s.name for s in server_spans) == [
        "POST /v1/chat/completions",
        "POST /v1/chat/completions",
        "POST /v1/messages",
        "POST /v1/responses",
    ]
    assert all(s.attributes["http.route"] == s.name.removeprefix("POST ") for s in server_spans)
    assert not [s for s in otlp.spans if "/health" in s.name]
    if fastapi_instrumentation == "off":  # our server span: the stable HTTP conventions, set once
        assert all(
            s.attributes["http.request.method"] == "POST"
            and s.attributes["http.response.status_code"] == 200
            and s.attributes["url.path"].endswith(s.attributes["http.route"])
            and "http.method" not in s.attributes
            for s in server_spans
        )
    for record in records:
        span = by_id[record.span_id]
        assert span.trace_id == record.trace_id
        assert span.name == f"chat {record.request['model']}"
        assert span.attributes[A.ROLLOUT_ID] == record.rollout_id
        assert span.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == record.tokens_in
        assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == record.tokens_out
        assert span.resource["service.name"] == "recorded-model"
        assert by_id[span.parent_span_id].kind == SERVER  # child of the HTTP server span
        assert abs((span.end_ns - span.start_ns) / 1e6 - record.latency_total_ms) < 50
    streamed = next(s for s in model_spans if s.attributes.get(A.GEN_AI_REQUEST_STREAM))
    assert (
        0
        < streamed.attributes[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK]
        < (streamed.end_ns - streamed.start_ns) / 1e9
    )
    # the baggage-only call: captured under its id, in the agent's trace, below the agent's span
    (agent_span,) = agent_spans.get_finished_spans()
    bag_span = by_id[read_model_call_records(store, "zc-bag")[0].span_id]
    assert bag_span.attributes[A.MODEL_CALL_ROLLOUT_SOURCE] == "baggage"
    assert bag_span.trace_id == format(agent_span.context.trace_id, "032x")
    assert by_id[bag_span.parent_span_id].parent_span_id == format(agent_span.context.span_id, "016x")

    otlp.wait_for(lambda r: any(h.name == A.METRIC_SERVER_REQUEST_DURATION for h in r.histograms))
    durations = [h for h in otlp.histograms if h.name == A.METRIC_SERVER_REQUEST_DURATION]
    assert sum(h.count for h in durations) == 4
    assert durations[0].bounds == list(A.BUCKETS_REQUEST_DURATION) and durations[0].unit == "s"
    ttft = [h for h in otlp.histograms if h.name == A.METRIC_SERVER_TIME_TO_FIRST_TOKEN]
    assert sum(h.count for h in ttft) == 1 and ttft[0].bounds == list(A.BUCKETS_TIME_TO_FIRST_TOKEN)
    assert all("rollout.id" not in h.attributes for h in otlp.histograms)
    if fastapi_instrumentation == "off":  # one http.server.request.duration per call, by route
        otlp.wait_for(lambda r: any(h.name == A.METRIC_HTTP_SERVER_REQUEST_DURATION for h in r.histograms))
        http = [h for h in otlp.histograms if h.name == A.METRIC_HTTP_SERVER_REQUEST_DURATION]
        assert sum(h.count for h in http) == 4 and {h.attributes["http.route"] for h in http} == {
            "/v1/chat/completions",
            "/v1/messages",
            "/v1/responses",
        }
    agent_provider.shutdown()


def test_program_flags_that_look_like_opentelemetry_instrument_options_pass_after_a_double_dash() -> None:
    """The README's advice: ``opentelemetry-instrument`` takes any abbreviation of its own options (argparse),
    so a program flag such as ``--config`` is refused as ambiguous unless ``--`` ends its options."""
    program = [sys.executable, "-c", "import sys; print(sys.argv[1:])", "--config", "run.yaml"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}
    )
    instrument = str(BIN / "opentelemetry-instrument")
    refused = subprocess.run([instrument, *program], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "ambiguous option: --config" in refused.stderr
    passed = subprocess.run(
        [instrument, "--", *program], env=env, capture_output=True, text=True, timeout=120
    )
    assert passed.returncode == 0, passed.stderr
    assert passed.stdout.strip() == "['--config', 'run.yaml']"


def _instrumented_python(code: str, capture_dir: Path | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"})
    if capture_dir is not None:
        env.update(
            {
                "OTEL_TRACES_EXPORTER": "model_call_jsonl",
                "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": str(capture_dir),
            }
        )
    else:
        env["OTEL_TRACES_EXPORTER"] = "none"
    instrument = str(BIN / "opentelemetry-instrument")
    return subprocess.run(
        [instrument, "--", sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_zero_code_on_a_process_with_no_asgi_app_says_so_once_at_exit(tmp_path: Path) -> None:
    """Issue 33: ``opentelemetry-instrument -- vf-eval ...`` (a client, no app) ran, made no capture
    directory and printed nothing. Now one line at exit says nothing was captured and points to the proxy;
    it shows even where the host silences logging (the root logger at ERROR, as vLLM sets it)."""
    capture_dir = tmp_path / "calls"
    silenced = "import logging; logging.getLogger().setLevel(logging.ERROR); print('6 rollouts done')"
    ran = _instrumented_python(silenced, capture_dir)
    assert ran.returncode == 0 and ran.stdout.strip() == "6 rollouts done", ran.stderr
    (notice,) = [line for line in ran.stderr.splitlines() if "captured nothing" in line]
    assert str(capture_dir) in notice and "no Starlette or FastAPI app" in notice
    assert "model server's ASGI app" in notice and "otel-capture proxy --upstream" in notice
    # a multiprocessing child is instrumented too and serves no app by design: only its parent speaks
    spawning = (
        "import multiprocessing as mp\n"
        "if __name__ == '__main__':\n"
        "    p = mp.get_context('spawn').Process(target=print, args=('child',)); p.start(); p.join()\n"
        "    print('parent', p.exitcode)"
    )
    parent = _instrumented_python(spawning, capture_dir)
    assert parent.returncode == 0 and parent.stdout.split() == ["child", "parent", "0"], parent.stderr
    assert len([line for line in parent.stderr.splitlines() if "captured nothing" in line]) == 1
    # a process that builds an app is what zero-code is for: not a word
    served = _instrumented_python(
        "import fastapi; fastapi.FastAPI().build_middleware_stack(); print('built')", capture_dir
    )
    assert served.returncode == 0 and served.stdout.strip() == "built", served.stderr
    assert "captured nothing" not in served.stderr
    # no capture directory configured: nothing was expected of it, nothing to say
    bare = _instrumented_python("print('plain')", None)
    assert bare.returncode == 0 and "captured nothing" not in bare.stderr
