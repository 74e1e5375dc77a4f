"""``otel-capture demo``: capture a few real rollouts end to end and show what was recorded.

It starts the tiny model (llama.cpp + Gemma 3 270M, unless an upstream is given), puts the capture proxy in
front of it, and runs a few rollouts (``demo-0``, ``demo-1``, ...) as an agent would: each makes a Responses
call, a streamed Chat Completions call and a streamed Anthropic Messages call with the official SDKs,
through ``/ng-rollout/<rollout_id>/`` base URLs. Then it prints the captured calls and where they are.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import httpx

from otel_capture import CaptureStore, start_proxy
from otel_capture._cli.show import format_calls_table, format_rollouts_table

from .tiny_model import TinyModelError, start_tiny_model

if TYPE_CHECKING:
    import anthropic
    import openai
    from opentelemetry.sdk.trace import TracerProvider

_logger = logging.getLogger(__name__)

Say = Callable[[str], None]

DIALECTS = ("responses", "chat", "messages")
MAX_TOKENS = 16
CALL_TIMEOUT_S = 120.0
MAX_PARALLEL_ROLLOUTS = 4  # the tiny model serves four calls at once
PROMPTS = (
    "Name three colours.",
    "Count from one to five.",
    "Say hello in French.",
    "What is two plus two?",
)


# --- one rollout: three calls, one per dialect, through the rollout's prefixed base URL -------------------


@dataclass
class _Clients:
    """One OpenAI and one Anthropic client per rollout, both on the rollout's prefixed base URL."""

    openai_client: openai.OpenAI
    anthropic_client: anthropic.Anthropic


def _responses_call(clients: _Clients, model: str, prompt: str) -> None:
    clients.openai_client.responses.create(model=model, input=prompt, max_output_tokens=MAX_TOKENS)


def _chat_call(clients: _Clients, model: str, prompt: str) -> None:
    stream = clients.openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    for _chunk in stream:
        pass


def _messages_call(clients: _Clients, model: str, prompt: str) -> None:
    with clients.anthropic_client.messages.stream(
        model=model, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}]
    ) as stream:
        stream.get_final_message()


CALLS: tuple[tuple[str, Callable[[_Clients, str, str], None]], ...] = (
    ("responses", _responses_call),
    ("chat (streamed)", _chat_call),
    ("messages (streamed)", _messages_call),
)


@contextlib.contextmanager
def _rollout_clients(proxy_url: str, rollout_id: str) -> Iterator[_Clients]:
    # Imported here: only the demo needs the SDKs (the `demo` extra).
    import anthropic
    import openai

    base = f"{proxy_url}/ng-rollout/{rollout_id}"
    options: dict[str, Any] = {"api_key": "demo", "max_retries": 0, "timeout": CALL_TIMEOUT_S}
    with (
        openai.OpenAI(base_url=base + "/v1", **options) as openai_client,
        anthropic.Anthropic(base_url=base, **options) as anthropic_client,
    ):
        yield _Clients(openai_client, anthropic_client)


def _run_rollout(proxy_url: str, rollout_id: str, model: str, prompt: str, say: Say) -> list[str]:
    """Make the rollout's calls one after another, as an agent would; return what failed."""
    failures = []
    started = time.monotonic()
    with _rollout_clients(proxy_url, rollout_id) as clients:
        for name, call in CALLS:
            try:
                call(clients, model, prompt)
            except Exception as exc:  # any SDK or network error: report it, go on with the next call
                _logger.debug("demo call failed", exc_info=True)
                failures.append(f"{rollout_id} {name}: {type(exc).__name__}: {exc}")
    status = "ok" if not failures else f"{len(failures)} failed"
    say(f"  {rollout_id}: {len(CALLS)} calls, {status}, {time.monotonic() - started:.1f} s")
    return failures


def _run_rollouts(proxy_url: str, model: str, rollout_ids: Sequence[str], say: Say) -> list[str]:
    workers = max(1, min(len(rollout_ids), MAX_PARALLEL_ROLLOUTS))
    with ThreadPoolExecutor(workers, thread_name_prefix="otel-capture-demo") as pool:
        futures = [
            pool.submit(_run_rollout, proxy_url, rid, model, PROMPTS[i % len(PROMPTS)], say)
            for i, rid in enumerate(rollout_ids)
        ]
        return [failure for future in futures for failure in future.result()]


# --- the report -----------------------------------------------------------------------------------------


def _check_rollout(store: CaptureStore, rollout_id: str, records: Sequence[Any]) -> list[str]:
    problems = []
    if len(records) != len(CALLS):
        problems.append(f"{rollout_id}: {len(records)} records, expected {len(CALLS)}")
    for record in records:
        if record.failed:
            what = f"status {record.status_code}, error {record.error_category}"
            problems.append(f"{rollout_id} call {record.call_index}: {what}")
    if store.is_incomplete(rollout_id):
        problems.append(f"{rollout_id}: marked incomplete ({store.incomplete_path(rollout_id)})")
    return problems


def _report(
    store: CaptureStore, rollout_ids: Sequence[str], say: Say, trace_url: str | None = None
) -> list[str]:
    """Print each rollout's calls (with their trace links when ``trace_url`` names a tracing UI) and the
    per-rollout summary; return what does not look right."""
    from otel_capture import read_model_call_records

    problems = []
    for rollout_id in rollout_ids:
        records = read_model_call_records(store, rollout_id)
        say(f"\nrollout {rollout_id}: {store.data_path(rollout_id)}")
        say(format_calls_table(records, trace_url=trace_url))
        problems += _check_rollout(store, rollout_id, records)
    say("\n" + format_rollouts_table(store))
    say(f"\nrecords are in {store.root}")
    again = f" --trace-url {trace_url}" if trace_url else ""
    say(f"show them again: otel-capture ls {store.root}; otel-capture show {store.root} ROLLOUT_ID{again}")
    return problems


# --- setup and the whole run ----------------------------------------------------------------------------


def _capture_dir(capture_dir: str | None) -> Path:
    if capture_dir is None:
        return Path(tempfile.mkdtemp(prefix="otel-capture-demo-"))  # kept after exit, on purpose
    path = Path(capture_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _otlp_tracer_provider(otlp_endpoint: str, store: CaptureStore) -> TracerProvider:
    """The provider the proxy would build (records, and whatever the ``OTEL_*`` variables ask for), plus
    OTLP/HTTP to ``otlp_endpoint`` (a base URL, as ``OTEL_EXPORTER_OTLP_ENDPOINT``). Raises ``RuntimeError``
    when the OTLP/HTTP exporter is not installed."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from otel_capture._settings import CaptureSettings, WriterSettings
    from otel_capture._telemetry import build_tracer_provider

    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise RuntimeError(
            "--otlp-endpoint needs the OTLP/HTTP exporter: pip install 'otel-capture[auto]'"
        ) from exc
    writer = WriterSettings.from_environ(directory=str(store.root))
    provider = build_tracer_provider(CaptureSettings.from_environ(), writer)
    exporter = OTLPSpanExporter(endpoint=f"{otlp_endpoint.rstrip('/')}/v1/traces")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _upstream_model(upstream: str, say: Say) -> str:
    """The first model the upstream lists at ``/v1/models``; ``default`` if it lists none."""
    try:
        listed = httpx.get(upstream + "/v1/models", timeout=10.0).raise_for_status().json()
        return str(listed["data"][0]["id"])
    except (httpx.HTTPError, ValueError, LookupError, TypeError) as exc:
        say(f"could not list the upstream's models ({exc}); asking for model 'default'")
        return "default"


def _start_upstream(upstream: str | None, stack: contextlib.ExitStack, say: Say) -> tuple[str, str]:
    """(base URL, model name) of the upstream, starting the tiny model when none is given."""
    if upstream is not None:
        url = upstream.rstrip("/")
        return url, _upstream_model(url, say)
    say("starting the tiny model (llama.cpp + Gemma 3 270M, CPU)")
    model = stack.enter_context(start_tiny_model(progress=lambda line: say("  " + line)))
    return model.base_url, model.model


def _fail(message: str) -> int:
    print(f"otel-capture demo: {message}", file=sys.stderr)
    return 1


def run_demo(
    upstream: str | None = None,
    capture_dir: str | None = None,
    rollouts: int = 3,
    out: TextIO | None = None,
    otlp_endpoint: str | None = None,
    trace_url: str | None = None,
) -> int:
    """Run the demo; return the exit code (0 when every call was captured with status 200).

    Spans go where the standard ``OTEL_*`` variables say (``OTEL_TRACES_EXPORTER=otlp`` ...) and, with
    ``otlp_endpoint``, over OTLP/HTTP there too; with ``trace_url`` (a tracing UI's base URL) each call's
    line ends with the link to its trace. Progress and tables go to ``out`` (``sys.stdout`` as it is at
    call time); errors to ``sys.stderr``.
    """
    stream = out if out is not None else sys.stdout
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            print(line, file=stream, flush=True)

    if rollouts < 1:
        return _fail("--rollouts must be at least 1")
    store = CaptureStore(_capture_dir(capture_dir))
    rollout_ids = [f"demo-{i}" for i in range(rollouts)]
    existing = set(store.rollout_ids())
    reused = [rid for rid in rollout_ids if rid in existing]
    if reused:
        return _fail(f"{store.root} already holds {', '.join(reused)}; give an empty capture directory")
    say(f"capture directory: {store.root}")
    with contextlib.ExitStack() as stack:
        try:
            provider = _otlp_tracer_provider(otlp_endpoint, store) if otlp_endpoint else None
            if provider is not None:
                stack.callback(provider.shutdown)  # after the proxy stops: flushes records and spans
            upstream_url, model = _start_upstream(upstream, stack, say)
            if provider is None:
                proxy = stack.enter_context(start_proxy(upstream_url, str(store.root)))
            else:
                proxy = stack.enter_context(start_proxy(upstream_url, tracer_provider=provider))
        except (TinyModelError, OSError, RuntimeError) as exc:
            return _fail(str(exc))
        say(f"capture proxy: {proxy.url} -> {upstream_url}")
        if otlp_endpoint:
            say(f"spans: OTLP/HTTP to {otlp_endpoint}")
        say(f"running {rollouts} rollouts ({', '.join(DIALECTS)} calls each)…")
        failures = _run_rollouts(proxy.url, model, rollout_ids, say)
    try:
        problems = failures + _report(store, rollout_ids, say, trace_url)
    except Exception as exc:  # the reader's typed errors (a damaged file, ...): one line, exit 1
        _logger.debug("reading the demo's records failed", exc_info=True)
        return _fail(f"could not read the records in {store.root}: {type(exc).__name__}: {exc}")
    for problem in problems:
        say(f"problem: {problem}")
    return 0 if not problems else 1
