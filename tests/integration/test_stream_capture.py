"""Stream capture for all three dialects, end to end: every recorded stream replayed by a real uvicorn
model server, through the capture middleware (or the capture proxy), to the official SDKs.

The record's ``response`` must equal what the SDK accumulated from the very same bytes:

- Chat Completions: ``client.chat.completions.stream(...)`` (its ``current_completion_snapshot``; not
  ``get_final_completion()``, which raises on ``length``) and ``create(stream=True)`` fed to
  ``ChatCompletionStreamState``.
- Responses: ``responses.create(stream=True)`` (the response of the terminal event) and
  ``responses.stream(...).get_final_response()``.
- Messages: ``messages.stream(...).get_final_message()`` and ``beta.messages.stream(...)``, whose
  accumulator keeps what the plain one drops (``compaction`` content, the model a ``fallback`` block
  relabels the message with); each stream is compared with both, where the plain one keeps less only
  the beta one is the reference (``PLAIN_KEEPS_LESS``).

Where the SDK cannot be the reference it is said at the test: the Responses stream that fails with
``insufficient_quota`` makes both SDK paths raise ``APIError`` at its ``error`` event, so the record is
checked against the stream's own ``response.failed`` event.

What is left out of the comparison, and why (everything else must be equal), as in
``tests/unit/test_reassembly.py``: fields the SDK models add with ``None``/their own values that are not
stream data (chat ``parsed``/``annotations``/``audio``/``function_call``, a tool call's ``index`` and
``parsed_arguments``; Responses ``parsed``/``parsed_arguments``); and for an Anthropic tool input whose JSON
is unfinished (cut by ``max_tokens``), the ``partial_json`` text we keep beside the SDK's partial parse (the
``input`` is compared as is; the text must parse, jiter's partial way, to that same input).

Then the failure paths: a stream cut by the upstream (it raises mid-stream, or ends early without its
terminal event) and one abandoned by the client, through the middleware and through the proxy; and a
check that chunks are forwarded as they come (no buffering), synchronised with events only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import httpx2
import jiter
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from support import Gate, ReplayModelServer, Telemetry, recorded_streams, serve, sse_chunks

from otel_capture import (
    CaptureSettings,
    ModelCallCaptureMiddleware,
    ModelCallRecord,
    read_model_call_records,
    start_proxy,
)
from otel_capture._dialects.reassembly import accumulator_for
from otel_capture._dialects.sse import SSEDecoder

JsonDict = dict[str, Any]
RECORDINGS = recorded_streams()
QUOTA = "streamingerrorhandling__insufficientquotaerrorresponse.sse"
# The plain Messages accumulator drops these; the beta one keeps them (and is then the only reference).
PLAIN_KEEPS_LESS = {
    "messages_sse/compaction_response.sse",  # compaction_delta content
    "messages_sse/fallback_response.sse",  # the fallback block's relabelled model
    "messages_sse/fallback_credit_response.sse",
    "messages_sse_fable_fallback/stream-b-fallback.sse",
    "messages_sse_fable_fallback/stream-a-refusal.sse",  # usage.iterations
    "messages_sse_fable_fallback/stream-a-toolrefusal.sse",
}
USER = [{"role": "user", "content": "hi"}]
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
TIMEOUT = 15.0


def test_every_recording_is_replayed() -> None:
    dialects = [dialect for _, dialect, _ in RECORDINGS]
    assert (dialects.count("chat"), dialects.count("responses"), dialects.count("messages")) == (12, 5, 16)


# -- harness -------------------------------------------------------------------------------------------


class SpanEnded(SpanProcessor):
    """Lets a test wait until the call span of a rollout has ended (its record is then on its way)."""

    def __init__(self) -> None:
        self._ended: list[ReadableSpan] = []
        self._changed = threading.Condition()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        with self._changed:
            self._ended.append(span)
            self._changed.notify_all()

    def wait_for(self, rollout_id: str) -> ReadableSpan:
        def found() -> ReadableSpan | None:
            for span in self._ended:
                if (span.attributes or {}).get("rollout.id") == rollout_id and "gen_ai.operation.name" in (
                    span.attributes or {}
                ):
                    return span
            return None

        with self._changed:
            assert self._changed.wait_for(lambda: found() is not None, TIMEOUT), f"no span for {rollout_id}"
            span = found()
        assert span is not None
        return span


@dataclass
class Harness:
    url: str
    upstream: ReplayModelServer
    telemetry: Telemetry
    ended: SpanEnded

    def record(self, rollout_id: str) -> tuple[ModelCallRecord, ReadableSpan]:
        """The rollout's only record (waited for: a client that gave up did not wait for it) and span."""
        span = self.ended.wait_for(rollout_id)
        assert self.telemetry.jsonl.force_flush()
        (record,) = read_model_call_records(self.telemetry.store, rollout_id)
        assert record.span_id == format(span.context.span_id, "016x")
        return record, span

    def stream(self, dialect: str, chunks: list[bytes], **reply: Any) -> None:
        self.upstream.replies[dialect].content_type = "text/event-stream"
        self.upstream.replies[dialect].chunks = chunks
        for key, value in reply.items():
            setattr(self.upstream.replies[dialect], key, value)


def _harness(replay_server: ReplayModelServer, telemetry: Telemetry, proxy: bool) -> Iterator[Harness]:
    ended = SpanEnded()
    telemetry.provider.add_span_processor(ended)
    settings = CaptureSettings()
    if proxy:
        with (
            serve(replay_server) as upstream,
            start_proxy(upstream, settings=settings, tracer_provider=telemetry.provider) as running,
        ):
            yield Harness(running.url, replay_server, telemetry, ended)
    else:
        app = ModelCallCaptureMiddleware(replay_server, tracer_provider=telemetry.provider, settings=settings)
        with serve(app) as url:
            yield Harness(url, replay_server, telemetry, ended)


@pytest.fixture
def captured(replay_server: ReplayModelServer, telemetry: Telemetry) -> Iterator[Harness]:
    """The capture middleware around the replaying model server, served by uvicorn."""
    yield from _harness(replay_server, telemetry, proxy=False)


@pytest.fixture(params=["middleware", "proxy"])
def either(
    request: pytest.FixtureRequest, replay_server: ReplayModelServer, telemetry: Telemetry
) -> Iterator[Harness]:
    """The same, or the capture proxy in front of the replaying model server served on its own."""
    yield from _harness(replay_server, telemetry, proxy=request.param == "proxy")


class TeeTransport(httpx2.BaseTransport):
    """The SDK's transport, keeping a copy of every response body byte the SDK read."""

    def __init__(self) -> None:
        self._inner = httpx2.HTTPTransport()
        self.received = bytearray()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._inner.handle_request(request)
        received = self.received
        inner = response.stream

        class Tee(httpx2.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                for chunk in inner:  # type: ignore[union-attr]
                    received.extend(chunk)
                    yield chunk

            def close(self) -> None:
                inner.close()  # type: ignore[union-attr]

        return httpx2.Response(
            response.status_code, headers=response.headers, stream=Tee(), extensions=response.extensions
        )

    def close(self) -> None:
        self._inner.close()


def _openai(base_url: str, tee: TeeTransport) -> openai.OpenAI:
    http = httpx2.Client(transport=tee, timeout=TIMEOUT)
    return openai.OpenAI(base_url=base_url, api_key="sk-test", max_retries=0, http_client=http)


def _anthropic(base_url: str, tee: TeeTransport) -> anthropic.Anthropic:
    http = httpx2.Client(transport=tee, timeout=TIMEOUT)
    return anthropic.Anthropic(base_url=base_url, api_key="sk-ant-test", max_retries=0, http_client=http)


# -- the SDKs as references ----------------------------------------------------------------------------


def dump(model: Any) -> JsonDict:
    result: JsonDict = model.model_dump(mode="json", exclude_unset=True, by_alias=True, warnings=False)
    return result


def chat_reference(snapshot: Any) -> JsonDict:
    result = dump(snapshot)
    if result.get("usage", ...) is None:  # the SDK copies each chunk's usage, None before the usage chunk
        del result["usage"]
    for choice in result["choices"]:
        message = choice["message"]
        message.setdefault("refusal", None)  # the SDK leaves it out after a choice's first chunk only
        for key in ("parsed", "annotations", "audio", "function_call", "tool_calls"):
            if key in message and message[key] is None:
                del message[key]
        for call in message.get("tool_calls", []):
            del call["index"]
            call["function"].pop("parsed_arguments", None)
    return result


def responses_reference(response: Any) -> JsonDict:
    result = dump(response)
    for item in result["output"]:
        item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return result


def without_partial_json(message: JsonDict) -> JsonDict:
    """``message`` without the ``partial_json`` text kept beside an unfinished tool input, once checked
    against the ``input``: the SDK's partial parse of that text."""
    content = []
    for block in message["content"]:
        if "partial_json" in block:
            block = dict(block)
            assert block["input"] == jiter.from_json(block.pop("partial_json").encode(), partial_mode=True)
        content.append(block)
    return {**message, "content": content}


def _chat_stream(url: str, rollout: str, tee: TeeTransport) -> JsonDict:
    with (
        _openai(f"{url}/ng-rollout/{rollout}/v1", tee) as client,
        client.chat.completions.stream(model="gpt-4o", messages=USER) as stream,  # type: ignore[arg-type]
    ):
        for _ in stream:
            pass
        return chat_reference(stream.current_completion_snapshot)


def _chat_create(url: str, rollout: str, tee: TeeTransport) -> JsonDict:
    with _openai(f"{url}/ng-rollout/{rollout}/v1", tee) as client:
        state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(model="gpt-4o", messages=USER, stream=True):  # type: ignore[arg-type]
            state.handle_chunk(chunk)
        return chat_reference(state.current_completion_snapshot)


def _responses_create(url: str, rollout: str, tee: TeeTransport) -> JsonDict:
    with _openai(f"{url}/ng-rollout/{rollout}/v1", tee) as client:
        final = None
        for event in client.responses.create(model="gpt-5", input="hi", stream=True):
            if final is None and event.type in (
                "response.completed",
                "response.failed",
                "response.incomplete",
            ):
                final = event.response
        assert final is not None
        return responses_reference(final)


def _responses_stream(url: str, rollout: str, tee: TeeTransport) -> JsonDict:
    with (
        _openai(f"{url}/ng-rollout/{rollout}/v1", tee) as client,
        client.responses.stream(model="gpt-5", input="hi") as stream,
    ):
        for _ in stream:
            pass
        return responses_reference(stream.get_final_response())


def _messages_stream(url: str, rollout: str, tee: TeeTransport) -> JsonDict:
    with (
        _anthropic(f"{url}/ng-rollout/{rollout}", tee) as client,
        client.messages.stream(model="claude-test", max_tokens=1024, messages=USER) as stream,  # type: ignore[arg-type]
    ):
        for _ in stream:
            pass
        return dump(stream.get_final_message())


def _messages_beta(url: str, rollout: str, tee: TeeTransport) -> JsonDict:
    with (
        _anthropic(f"{url}/ng-rollout/{rollout}", tee) as client,
        client.beta.messages.stream(model="claude-test", max_tokens=1024, messages=USER) as stream,  # type: ignore[arg-type]
    ):
        for _ in stream:
            pass
        return dump(stream.get_final_message())


SDK_PATHS: dict[str, dict[str, Callable[[str, str, TeeTransport], JsonDict]]] = {
    "chat": {"stream": _chat_stream, "create": _chat_create},
    "responses": {"create": _responses_create, "stream": _responses_stream},
    "messages": {"stream": _messages_stream, "beta": _messages_beta},
}


def sdk_params() -> list[Any]:
    params = []
    for name, dialect, raw in RECORDINGS:
        if name == QUOTA:
            continue  # the SDK raises on it: test_a_stream_that_fails_in_stream_is_an_upstream_error
        for path in SDK_PATHS[dialect]:
            if path == "stream" and dialect == "messages" and name in PLAIN_KEEPS_LESS:
                continue  # checked against the beta accumulator only (and the plain one's drop is below)
            params.append(pytest.param(name, dialect, raw, path, id=f"{dialect}-{path}-{name}"))
    return params


def expected_finish_reasons(dialect: str, response: JsonDict) -> list[str]:
    if dialect == "chat":
        return [c["finish_reason"] for c in response["choices"] if c.get("finish_reason")]
    if dialect == "messages":
        return [response["stop_reason"]] if response.get("stop_reason") else []
    details = response.get("incomplete_details") or {}
    return [details.get("reason") or response["status"]]


def assert_stream_span(span: ReadableSpan, record: ModelCallRecord, finish_reasons: list[str]) -> None:
    attributes = span.attributes or {}
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.response.time_to_first_chunk"] > 0
    assert list(attributes.get("gen_ai.response.finish_reasons", ())) == finish_reasons
    assert attributes.get("error.type") == record.error_category


# -- clean streams against the SDKs --------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dialect", "raw", "path"), sdk_params())
def test_the_record_equals_what_the_sdk_accumulated(
    captured: Harness, name: str, dialect: str, raw: bytes, path: str
) -> None:
    captured.stream(dialect, sse_chunks(raw))
    tee = TeeTransport()
    reference = SDK_PATHS[dialect][path](captured.url, "r-sdk", tee)

    assert bytes(tee.received) == raw  # the client got exactly the upstream bytes
    record, span = captured.record("r-sdk")
    ours = record.response
    assert ours is not None
    assert (without_partial_json(ours) if dialect == "messages" else ours) == reference
    assert record.stream is True and record.stream_truncated is False
    assert record.error_category is None and record.failure is None
    assert record.response_raw is None  # a clean stream is not stored twice
    assert record.status_code == 200
    assert record.latency_ttft_ms is not None and record.latency_total_ms is not None
    assert 0 < record.latency_ttft_ms <= record.latency_total_ms
    assert_stream_span(span, record, expected_finish_reasons(dialect, reference))
    # the derived fields come from the same reassembled response
    if dialect == "chat":
        calls = [c for choice in reference["choices"] for c in choice["message"].get("tool_calls", [])]
        assert [(c["name"], c["arguments"]) for c in record.tool_calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
        ]
    elif dialect == "responses":
        calls = [item for item in reference["output"] if item["type"] == "function_call"]
        assert [(c["name"], c["arguments"]) for c in record.tool_calls] == [
            (c["name"], json.loads(c["arguments"])) for c in calls
        ]
    else:
        calls = [block for block in reference["content"] if block["type"] == "tool_use"]
        # an unfinished input too: the record's arguments are what the SDK parsed of it
        assert [(c["name"], c["arguments"]) for c in record.tool_calls] == [
            (c["name"], c["input"]) for c in calls
        ]
        thinking = [block["thinking"] for block in reference["content"] if block["type"] == "thinking"]
        assert (record.reasoning_content or None) == ("".join(thinking) or None)


@pytest.mark.parametrize("name", sorted(PLAIN_KEEPS_LESS))
def test_the_plain_messages_accumulator_keeps_less_than_the_record(captured: Harness, name: str) -> None:
    """Why these streams are compared with the beta accumulator only: the plain one drops a part of
    them that the record (and the beta accumulator) keeps."""
    (raw,) = [raw for n, _, raw in RECORDINGS if n == name]
    captured.stream("messages", sse_chunks(raw))
    plain = _messages_stream(captured.url, "r-plain", TeeTransport())
    record, _ = captured.record("r-plain")
    assert record.response is not None
    assert plain != record.response
    assert plain["id"] == record.response["id"]
    assert plain["stop_reason"] == record.response["stop_reason"]
    assert plain["usage"]["output_tokens"] == record.response["usage"]["output_tokens"]


def test_a_stream_that_fails_in_stream_is_an_upstream_error(captured: Harness) -> None:
    """The Responses stream that fails with ``insufficient_quota``: both SDK paths raise ``APIError`` at
    its ``error`` event, so they cannot be the reference; the record must equal the response of the
    stream's own terminal ``response.failed`` event."""
    (raw,) = [raw for n, _, raw in RECORDINGS if n == QUOTA]
    captured.stream("responses", sse_chunks(raw))
    failed = [json.loads(e.data) for e in SSEDecoder().feed(raw) if e.event == "response.failed"]
    (own_final,) = [event["response"] for event in failed]
    for number, path in enumerate(("create", "stream")):
        with pytest.raises(openai.APIError, match="You exceeded your current quota"):
            SDK_PATHS["responses"][path](captured.url, f"r-quota-{number}", TeeTransport())
        record, span = captured.record(f"r-quota-{number}")
        assert record.response == own_final
        assert record.error_category == "upstream_error"
        assert record.failure is not None and record.failure["error"]["code"] == "insufficient_quota"
        assert record.stream is True and record.stream_truncated is False
        assert record.response_raw == raw.decode()  # kept for a call that did not end cleanly
        assert record.latency_ttft_ms is not None and record.latency_total_ms is not None
        assert record.latency_ttft_ms <= record.latency_total_ms
        assert span.status.status_code.name == "ERROR"
        assert_stream_span(span, record, ["failed"])
    # A client that reads to the end gets every byte, the terminal event included.
    with httpx.stream(
        "POST", f"{captured.url}/ng-rollout/r-quota-raw/v1/responses", json={"stream": True}
    ) as r:
        assert r.read() == raw
    record, _ = captured.record("r-quota-raw")
    assert record.error_category == "upstream_error" and record.response == own_final


# -- streams cut by the upstream, or abandoned by the client -------------------------------------------

CUT = {  # one recorded stream per dialect, with content at the cut
    "chat": "parse_multiple_pydantic_tools.f82268f2fefd.sse",
    "responses": "streamingtoolcalls__response1.sse",
    "messages": "messages_sse/tool_use_response.sse",
}


def _cut(dialect: str) -> tuple[list[bytes], int]:
    (raw,) = [raw for n, _, raw in RECORDINGS if n == CUT[dialect]]
    chunks = sse_chunks(raw)
    return chunks, len(chunks) * 2 // 3


def partial(dialect: str, chunks: list[bytes]) -> JsonDict | None:
    decoder, accumulator = SSEDecoder(), accumulator_for(dialect)  # type: ignore[arg-type]
    for event in decoder.feed(b"".join(chunks)) + decoder.close():
        accumulator.add(event)
    assert accumulator.terminal is None
    return accumulator.result()


def assert_partial_record(
    record: ModelCallRecord, span: ReadableSpan, dialect: str, sent: list[bytes], category: str
) -> None:
    assert record.error_category == category
    assert record.stream is True and record.stream_truncated is True
    assert record.response == partial(dialect, sent)  # what the deltas carried before the cut
    assert record.response_raw == b"".join(sent).decode()
    assert record.latency_ttft_ms is not None and record.latency_total_ms is not None
    assert record.latency_ttft_ms <= record.latency_total_ms
    assert span.status.status_code.name == "ERROR"
    assert (span.attributes or {})["error.type"] == category
    assert (span.attributes or {})["gen_ai.request.stream"] is True


def _content_of(dialect: str, response: JsonDict | None) -> str:
    """A piece of partial content to look for (the tool call being streamed at the cut)."""
    assert response is not None
    if dialect == "chat":
        calls = response["choices"][0]["message"]["tool_calls"]
        return str(calls[-1]["function"]["arguments"])
    if dialect == "responses":
        return str([i for i in response["output"] if i["type"] == "function_call"][-1]["arguments"])
    return str(response["content"][-1].get("partial_json") or response["content"][-1].get("input"))


def _follow_up_succeeds(harness: Harness, dialect: str, chunks: list[bytes]) -> None:
    harness.stream(dialect, chunks, raise_after=None, hang_after=None)
    with httpx.stream("POST", f"{harness.url}/ng-rollout/r-next/v1{PATHS[dialect][3:]}", json={}) as response:
        assert response.read() == b"".join(chunks)
    record, _ = harness.record("r-next")
    assert record.error_category is None and record.stream_truncated is False


def _read_raw_into(url: str, received: bytearray) -> None:
    with httpx.stream("POST", url, json={}) as response:
        for piece in response.iter_raw():
            received.extend(piece)


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_a_stream_the_upstream_cuts_mid_way(either: Harness, dialect: str) -> None:
    """The model server fails mid-stream: uvicorn aborts the connection without the body's end."""
    chunks, cut = _cut(dialect)
    either.stream(dialect, chunks, raise_after=cut)
    received = bytearray()
    url = f"{either.url}/ng-rollout/r-cut/v1{PATHS[dialect][3:]}"
    with pytest.raises(httpx.RemoteProtocolError):
        _read_raw_into(url, received)
    assert bytes(received) == b"".join(chunks[:cut])
    record, span = either.record("r-cut")
    assert_partial_record(record, span, dialect, chunks[:cut], "stream_truncated")
    assert _content_of(dialect, record.response)
    assert record.failure is not None and record.failure["exception"] in (
        "UpstreamFailure",  # in-process: the app's own exception
        "ClientPayloadError",  # the proxy: aiohttp's error for a body cut before its end
    )
    assert either.upstream.outcomes == ["raised"]
    _follow_up_succeeds(either, dialect, chunks)


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_a_stream_that_ends_without_its_terminal_event(either: Harness, dialect: str) -> None:
    chunks, cut = _cut(dialect)
    either.stream(dialect, chunks[:cut])
    with httpx.stream("POST", f"{either.url}/ng-rollout/r-short/v1{PATHS[dialect][3:]}", json={}) as response:
        assert response.read() == b"".join(chunks[:cut])
    record, span = either.record("r-short")
    assert_partial_record(record, span, dialect, chunks[:cut], "stream_truncated")
    assert record.failure is None
    _follow_up_succeeds(either, dialect, chunks)


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_a_stream_the_client_abandons(either: Harness, dialect: str) -> None:
    """The client closes the response while the upstream is still streaming (it hangs after ``cut``
    chunks): the upstream hears the disconnect and stops, the record is ``cancelled``."""
    chunks, cut = _cut(dialect)
    either.stream(dialect, chunks, hang_after=cut)
    expected = b"".join(chunks[:cut])
    received = bytearray()
    with httpx.stream("POST", f"{either.url}/ng-rollout/r-gone/v1{PATHS[dialect][3:]}", json={}) as response:
        for piece in response.iter_raw():
            received.extend(piece)
            if len(received) >= len(expected):
                break
    # leaving the block closed the response before its end: the connection is dropped
    assert bytes(received) == expected
    record, span = either.record("r-gone")
    assert_partial_record(record, span, dialect, chunks[:cut], "cancelled")
    assert either.upstream.finished.wait(TIMEOUT)
    assert either.upstream.outcomes == ["disconnected"]  # the model server stopped streaming
    _follow_up_succeeds(either, dialect, chunks)


def test_an_sdk_client_that_abandons_a_stream(captured: Harness) -> None:
    chunks, cut = _cut("chat")
    gate = Gate()
    captured.stream("chat", chunks, gate=gate, gate_after=cut)
    with _openai(f"{captured.url}/ng-rollout/r-sdk-gone/v1", TeeTransport()) as client:
        try:
            stream = client.chat.completions.create(model="gpt-4o", messages=USER, stream=True)  # type: ignore[arg-type]
            seen = [next(stream) for _ in range(cut - 1)]
            stream.close()
            assert gate.reached.wait(TIMEOUT)
            record, _ = captured.record("r-sdk-gone")  # before the gate opens: the upstream is still held
        finally:
            gate.open()
        assert len(seen) == cut - 1
        assert captured.upstream.outcomes == ["disconnected"]
        assert record.error_category == "cancelled" and record.stream_truncated is True
        assert record.response is not None and record.response["id"] == seen[0].id


# -- no buffering --------------------------------------------------------------------------------------

FIRST = {  # a stream per dialect whose first event is not its terminal one
    "chat": "parse_nothing.e2aad469b71d.sse",
    "responses": "streamingtext__helloworldresponse.sse",
    "messages": "messages_sse/basic_response.sse",
}


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_the_first_event_reaches_the_client_before_the_upstream_continues(
    either: Harness, dialect: str
) -> None:
    """The upstream sends its first event and waits at a gate only the test opens: the client must get
    that event while the upstream is still waiting (a buffering capture would deadlock here until the
    client's read timeout)."""
    (raw,) = [raw for n, _, raw in RECORDINGS if n == FIRST[dialect]]
    chunks = sse_chunks(raw)
    gate = Gate()
    either.stream(dialect, chunks, gate=gate, gate_after=1)
    received = bytearray()
    try:
        with httpx.stream(
            "POST", f"{either.url}/ng-rollout/r-flow/v1{PATHS[dialect][3:]}", json={}, timeout=TIMEOUT
        ) as response:
            pieces = response.iter_raw()
            while len(received) < len(chunks[0]):
                received.extend(next(pieces))
            assert bytes(received) == chunks[0]
            assert gate.reached.wait(TIMEOUT) and not gate.is_open  # the upstream is still held
            gate.open()
            for piece in pieces:
                received.extend(piece)
    finally:
        gate.open()
    assert bytes(received) == raw
    record, _ = either.record("r-flow")
    assert record.error_category is None and record.stream is True


def test_the_sdk_gets_the_first_chunk_before_the_upstream_continues(captured: Harness) -> None:
    (raw,) = [raw for n, _, raw in RECORDINGS if n == FIRST["chat"]]
    chunks = sse_chunks(raw)
    gate = Gate()
    captured.stream("chat", chunks, gate=gate, gate_after=1)
    tee = TeeTransport()
    with _openai(f"{captured.url}/ng-rollout/r-sdk-flow/v1", tee) as client:
        try:
            stream = client.chat.completions.create(model="gpt-4o", messages=USER, stream=True)  # type: ignore[arg-type]
            first = next(stream)
            assert gate.reached.wait(TIMEOUT) and not gate.is_open
            assert first.id == json.loads(chunks[0].split(b"data: ", 1)[1])["id"]
            gate.open()
            rest = list(stream)
        finally:
            gate.open()
        assert len(rest) == len(chunks) - 2  # every chunk but the first and [DONE]
        assert bytes(tee.received) == raw
        record, span = captured.record("r-sdk-flow")
        assert record.error_category is None
        assert (span.attributes or {})["gen_ai.response.time_to_first_chunk"] > 0
