"""Latency in Jaeger, for real: spans go over OTLP (gRPC and HTTP) to a real Jaeger v2 on 127.0.0.1 and
are read back through the HTTP query API its UI uses (``/api/traces?service=...&tags={"rollout.id": ...}``).

Two servers, each with both OTLP protocols, configured only by the standard ``OTEL_*`` variables: the
capture proxy (``otel-capture proxy``, a subprocess) in front of a model server, and an unmodified FastAPI
model server under ``opentelemetry-instrument`` (zero-code). The model server paces its SSE events so a
call's duration is real, answers ``503`` for one model and cuts the stream for another. An agent (this
process) makes each rollout's calls with the official SDKs; one rollout runs under the agent's own span
with the httpx integration, which sends ``traceparent`` and the rollout id in baggage.

What a user looks for in Jaeger, checked against the records: a rollout's calls and only those by their
``rollout.id`` tag; ``chat <model>`` spans with the GenAI tags and the service name; failures as error
spans with ``error.type``; the agent's span, the HTTP server span and the model-call span in one trace;
each call's span as long as the record's latency. Also ``otel-capture show --trace-url`` (a link per call
that opens its trace) and ``otel-capture demo`` sending its spans to Jaeger.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import httpx
import openai
import paced_model_app
import pytest
from jaeger_backend import Jaeger
from model_app import STREAMS
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind
from support import serve, start_cli_proxy
from zero_code import instrumented_model_server

from otel_capture import CaptureStore, instrument_http_client, read_model_call_records, rollout_context

pytestmark = pytest.mark.jaeger

_T = TypeVar("_T")

# The record keeps latency_ms rounded to 0.01 ms; Jaeger keeps microseconds.
CLOCK_RESOLUTION_MS = 0.011
INGEST_TIMEOUT = 60.0
CASES = [("proxy", "grpc"), ("proxy", "http/protobuf"), ("zero-code", "grpc"), ("zero-code", "http/protobuf")]
MESSAGES = [{"role": "user", "content": "hi"}]


def _events(dialect: str) -> int:
    return sum(1 for event in STREAMS[dialect].split(b"\n\n") if event.strip())


# --- reading Jaeger's answers ---------------------------------------------------------------------------


def _tags(span: dict[str, Any]) -> dict[str, Any]:
    return {tag["key"]: tag["value"] for tag in span["tags"]}


def _parent(span: dict[str, Any]) -> str | None:
    parents = [ref["spanID"] for ref in span["references"] if ref["refType"] == "CHILD_OF"]
    return parents[0] if parents else None


def _spans(traces: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every span of ``traces`` by id, each with its service name (from the trace's processes) added."""
    return {
        span["spanID"]: {**span, "service": trace["processes"][span["processID"]]["serviceName"]}
        for trace in traces
        for span in trace["spans"]
    }


def _model_call_spans(traces: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {sid: span for sid, span in _spans(traces).items() if "rollout.id" in _tags(span)}


def _wait_for(fetch: Callable[[], _T], done: Callable[[_T], bool], what: str) -> _T:
    """Poll Jaeger until ``done(fetch())``: spans reach it after the exporters' batch delay and its own."""
    deadline = time.monotonic() + INGEST_TIMEOUT
    while True:
        value = fetch()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"Jaeger did not show {what} within {INGEST_TIMEOUT} s; last answer: {value!r:.3000}"
            )
        time.sleep(0.1)  # polling interval of a bounded wait for ingestion


# --- one scenario: a server, a protocol, four rollouts --------------------------------------------------


@dataclass
class Scenario:
    name: str
    service: str  # OTEL_SERVICE_NAME of the model server
    agent_service: str
    store: CaptureStore
    records: dict[str, list[Any]]  # rollout id -> its records, in call order
    traces: dict[str, list[dict[str, Any]]]  # rollout id -> Jaeger's answer to the search by rollout.id
    agent_trace: dict[str, Any]
    agent_span_name: str
    output: str  # the server's output, for failure messages

    @property
    def all_records(self) -> list[Any]:
        return [record for records in self.records.values() for record in records]

    def span(self, record: Any) -> dict[str, Any]:
        spans = _spans(self.traces[record.rollout_id])
        assert record.span_id in spans, f"no span {record.span_id} for the record in Jaeger"
        return spans[record.span_id]


def _agent_exporter(jaeger: Jaeger, protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=jaeger.otlp_grpc, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=f"{jaeger.otlp_http}/v1/traces")


def _rollouts(url: str, prefix: str, agent: TracerProvider) -> tuple[dict[str, int], str, str]:
    """An agent's rollouts through ``url``: returns how many calls each made, the agent's trace id and the
    name of its span. ``{prefix}-1`` and ``{prefix}-10`` (one id a prefix of the other) succeed; ``-err``
    meets a 503 and a cut stream; ``-bag`` runs under the agent's span with the rollout id in baggage."""

    def clients(rollout: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
        base = f"{url}/ng-rollout/{rollout}"
        return (
            openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0),
            anthropic.Anthropic(base_url=base, api_key="k", max_retries=0),
        )

    oai, claude = clients(f"{prefix}-1")
    with oai, claude:
        oai.responses.create(model="gpt-4o-mini", input="hi")
        list(
            oai.chat.completions.create(
                model="gpt-4o", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
            )
        )
        with claude.messages.stream(model="claude-test", max_tokens=64, messages=MESSAGES) as stream:
            stream.get_final_message()
    oai, claude = clients(f"{prefix}-10")
    with oai, claude:
        oai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    oai, claude = clients(f"{prefix}-err")
    with oai, claude:
        with pytest.raises(openai.InternalServerError):
            oai.chat.completions.create(model=paced_model_app.OVERLOADED, messages=MESSAGES)
        with pytest.raises(openai.APIError):
            list(
                oai.chat.completions.create(model=paced_model_app.CUT_STREAM, messages=MESSAGES, stream=True)
            )
    span_name = f"rollout {prefix}-bag"
    http_client = instrument_http_client(openai.DefaultHttpxClient())
    with (
        openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, http_client=http_client) as oai,
        agent.get_tracer("agent").start_as_current_span(span_name, kind=SpanKind.CLIENT) as root,
        rollout_context(f"{prefix}-bag"),
    ):
        list(oai.chat.completions.create(model="gpt-4o", messages=MESSAGES, stream=True))
    calls = {f"{prefix}-1": 3, f"{prefix}-10": 1, f"{prefix}-err": 2, f"{prefix}-bag": 1}
    return calls, format(root.get_span_context().trace_id, "032x"), span_name


def _run(kind: str, protocol: str, jaeger: Jaeger, workdir: Path) -> Scenario:
    name = f"{kind}-{protocol.split('/')[0]}"
    service = f"model-{name}"
    store = CaptureStore(workdir / "calls")
    env = {
        "OTEL_SERVICE_NAME": service,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_endpoint(protocol),
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    agent = TracerProvider(resource=Resource.create({"service.name": f"agent-{name}"}))
    agent.add_span_processor(SimpleSpanProcessor(_agent_exporter(jaeger, protocol)))
    if kind == "proxy":
        env["OTEL_TRACES_EXPORTER"] = "otlp"
        with serve(paced_model_app.app) as upstream:
            proxy, url = start_cli_proxy(
                upstream, "--capture-dir", str(store.root), env=env, stderr=subprocess.STDOUT
            )
            try:
                calls, trace_id, span_name = _rollouts(url, name, agent)
            finally:
                proxy.terminate()
                output, _ = proxy.communicate(timeout=60)
    else:
        env.update(
            {
                "OTEL_TRACES_EXPORTER": "otlp,model_call_jsonl",
                "OTEL_EXPORTER_MODEL_CALL_JSONL_DIR": str(store.root),
                "OTEL_METRICS_EXPORTER": "none",  # this Jaeger takes traces only
                "OTEL_LOGS_EXPORTER": "none",
            }
        )
        with instrumented_model_server(env, app="paced_model_app:app") as server:
            calls, trace_id, span_name = _rollouts(server.url, name, agent)
            output = server.stop()
    agent.shutdown()

    records = {rollout: read_model_call_records(store, rollout) for rollout in calls}
    assert {rollout: len(r) for rollout, r in records.items()} == calls, output
    traces = {
        rollout: _wait_for(
            lambda rollout=rollout: jaeger.traces(service, {"rollout.id": rollout}),
            lambda found, n=n: len(_model_call_spans(found)) >= n,
            f"{n} spans of rollout {rollout}",
        )
        for rollout, n in calls.items()
    }
    agent_trace = _wait_for(
        lambda: jaeger.trace(trace_id),
        lambda found: (
            found is not None
            and any(s["operationName"] == span_name for s in found["spans"])
            and any(_model_call_spans([found]))
        ),
        f"the agent's trace {trace_id}",
    )
    assert agent_trace is not None
    return Scenario(name, service, f"agent-{name}", store, records, traces, agent_trace, span_name, output)


@pytest.fixture(scope="module", params=CASES, ids=[f"{k}-{p.split('/')[0]}" for k, p in CASES])
def scenario(
    request: pytest.FixtureRequest, jaeger: Jaeger, tmp_path_factory: pytest.TempPathFactory
) -> Scenario:
    kind, protocol = request.param
    return _run(kind, protocol, jaeger, tmp_path_factory.mktemp(f"{kind}-{protocol.split('/')[0]}"))


# --- what a user looks for --------------------------------------------------------------------------


def test_a_rollouts_calls_are_found_by_its_rollout_id_and_no_other_rollouts(scenario: Scenario) -> None:
    for rollout, records in scenario.records.items():
        found = _model_call_spans(scenario.traces[rollout])
        assert {s["spanID"] for s in found.values()} == {r.span_id for r in records}, rollout
        assert {_tags(s)["rollout.id"] for s in found.values()} == {rollout}
        assert {t["traceID"] for t in scenario.traces[rollout]} == {r.trace_id for r in records}


def test_model_call_spans_are_named_by_operation_and_model_with_genai_tags(scenario: Scenario) -> None:
    for record in scenario.all_records:
        span = scenario.span(record)
        tags = _tags(span)
        model = record.request["model"]
        assert span["operationName"] == f"chat {model}"
        assert record.rollout_id not in span["operationName"]
        assert span["service"] == scenario.service
        assert tags["gen_ai.operation.name"] == "chat"
        assert tags["gen_ai.request.model"] == model
        assert tags["gen_ai.provider.name"] == ("anthropic" if record.dialect == "messages" else "openai")
        assert tags["otel_capture.model_call.id"] == record.model_call_id
        assert tags["http.response.status_code"] == record.status_code
        if record.error_category is None:
            assert tags["gen_ai.usage.input_tokens"] == record.tokens_in
            assert tags["gen_ai.usage.output_tokens"] == record.tokens_out
            assert tags["gen_ai.response.model"] == record.response["model"]
            assert "error" not in tags and "error.type" not in tags
        if tags["gen_ai.request.stream"] and record.error_category is None:
            assert abs(tags["gen_ai.response.time_to_first_chunk"] * 1000 - record.latency_ttft_ms) < 0.01


def test_a_streamed_calls_span_lasts_the_whole_paced_stream(scenario: Scenario) -> None:
    """The model server sends one event per ``PACE_S``: a span (and a record) that ended at the first
    chunk, or before the last, would be shorter than the events before the stream's final ones."""
    streamed = [r for r in scenario.all_records if r.request.get("stream") and r.error_category is None]
    assert {r.dialect for r in streamed} == {"chat", "messages"}
    for record in streamed:
        at_least_ms = (_events(record.dialect) - 3) * paced_model_app.PACE_S * 1000
        assert scenario.span(record)["duration"] / 1000 >= at_least_ms
        assert record.latency_total_ms >= at_least_ms


def test_an_upstream_error_and_a_cut_stream_are_error_spans_with_error_type(scenario: Scenario) -> None:
    overloaded, cut = scenario.records[f"{scenario.name}-err"]
    assert overloaded.status_code == 503
    assert overloaded.error_category is not None and cut.error_category is not None
    for record in (overloaded, cut):
        tags = _tags(scenario.span(record))
        assert tags["error"] is True
        assert tags["otel.status_code"] == "ERROR"
        assert tags["error.type"] == record.error_category
    assert _tags(scenario.span(overloaded))["http.response.status_code"] == 503


def test_the_agents_span_the_http_server_span_and_the_model_call_span_form_one_trace(
    scenario: Scenario,
) -> None:
    (record,) = scenario.records[f"{scenario.name}-bag"]
    spans = _spans([scenario.agent_trace])
    assert scenario.agent_trace["traceID"] == record.trace_id
    model_call = spans[record.span_id]
    server = spans[_parent(model_call)]
    agent = spans[_parent(server)]
    assert _tags(model_call)["otel_capture.rollout.source"] == "baggage"
    assert _tags(server)["span.kind"] == "server" and server["service"] == scenario.service
    assert agent["operationName"] == scenario.agent_span_name and agent["service"] == scenario.agent_service
    assert _parent(agent) is None
    assert agent["startTime"] <= server["startTime"] <= model_call["startTime"]


def test_a_calls_span_duration_is_its_records_latency(scenario: Scenario) -> None:
    for record in scenario.all_records:
        duration_ms = scenario.span(record)["duration"] / 1000
        assert abs(duration_ms - record.latency_total_ms) <= CLOCK_RESOLUTION_MS, (
            record.rollout_id,
            record.dialect,
        )


def test_show_prints_a_link_per_call_that_opens_its_trace(scenario: Scenario, jaeger: Jaeger) -> None:
    rollout = f"{scenario.name}-1"
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_capture._cli.main",
            "show",
            str(scenario.store.root),
            rollout,
            "--trace-url",
            jaeger.query_url + "/",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = shown.splitlines()[1:]  # below the header, one line per call in call order
    records = scenario.records[rollout]
    assert len(lines) == len(records)
    for line, record in zip(lines, records, strict=True):
        link = f"{jaeger.query_url}/trace/{record.trace_id}"
        assert line.split()[-1] == link
        assert httpx.get(link, timeout=30).status_code == 200  # the UI's route for one trace
        trace = jaeger.trace(record.trace_id)  # what that page shows
        assert trace is not None and record.span_id in _spans([trace])


# --- the demo -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["variables", "flag"])
def test_the_demo_sends_its_spans_to_jaeger_and_prints_each_calls_link(
    how: str, jaeger: Jaeger, tmp_path: Path
) -> None:
    service = f"demo-{how}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_SERVICE_NAME"] = service
    args = ["--trace-url", jaeger.query_url]
    if how == "variables":
        env.update(
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_http,
            }
        )
    else:
        args += ["--otlp-endpoint", jaeger.otlp_http]
    with serve(paced_model_app.app) as upstream:
        demo = subprocess.run(
            [
                sys.executable,
                "-m",
                "otel_capture._cli.main",
                "demo",
                "--upstream",
                upstream,
                "--capture-dir",
                str(tmp_path),
                "--rollouts",
                "2",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    store = CaptureStore(tmp_path)
    for rollout in ("demo-0", "demo-1"):
        records = read_model_call_records(store, rollout)
        assert len(records) == 3
        traces = _wait_for(
            lambda rollout=rollout: jaeger.traces(service, {"rollout.id": rollout}),
            lambda found: len(_model_call_spans(found)) >= 3,
            f"the demo's rollout {rollout}",
        )
        assert set(_model_call_spans(traces)) == {r.span_id for r in records}
        for record in records:
            assert f"{jaeger.query_url}/trace/{record.trace_id}" in demo.stdout


# --- where Jaeger cannot be built ---------------------------------------------------------------------


@pytest.mark.parametrize("ci", ["", "true"])
def test_without_go_the_jaeger_tests_skip_and_say_why_except_under_ci(ci: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "OTEL_CAPTURE_CACHE")}
    env.update(
        {
            "PATH": str(Path(sys.executable).parent),  # no go here
            "OTEL_CAPTURE_CACHE": str(tmp_path / "empty-cache"),  # and no Jaeger built
            "CI": ci,
        }
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rs",
            "--no-header",
            f"{__file__}::test_a_rollouts_calls_are_found_by_its_rollout_id_and_no_other_rollouts",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    if ci:
        assert run.returncode == 1, run.stdout
        assert "4 errors" in run.stdout and "CI=true" in run.stdout
    else:
        assert run.returncode == 0, run.stdout
        assert "4 skipped" in run.stdout and "Go is not installed" in run.stdout
