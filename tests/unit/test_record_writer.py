"""What a line says about who wrote it and about a refused call (``InFlightCall.line`` with the scope the
proxy writes): NeMo Gym's keys in its order, ours after, read back by the decoder."""

from __future__ import annotations

import os
import socket

import orjson

from otel_capture._capture import SCOPE_LOCAL_RESPONSE, SCOPE_UPSTREAM, SCOPE_UPSTREAM_REQUEST_ID
from otel_capture._capture.call import InFlightCall, writer_of
from otel_capture._records import codec
from otel_capture._records.schema import LINE_KEYS, REFUSED_OVER_CAPACITY
from otel_capture._settings import CaptureSettings

REFUSAL = b'{"error": {"type": "proxy_over_capacity", "message": "retry after 1 s"}}'


def _refused_line(stream_requested: bool) -> bytes:
    scope = {SCOPE_UPSTREAM: "http://vllm:8000"}
    call = InFlightCall("chat", "r", CaptureSettings(), scope=scope)
    call.set_request(orjson.dumps({"model": "m", "stream": stream_requested, "messages": []}))
    scope[SCOPE_LOCAL_RESPONSE] = REFUSED_OVER_CAPACITY  # the proxy refuses it below the capture
    call.on_response_start(503, "application/json")
    call.on_body(REFUSAL)
    call.finish()
    return call.line(1, 2)


def test_a_refused_call_says_so_with_nemo_gyms_local_answer_fields_and_its_real_stream() -> None:
    line = _refused_line(stream_requested=True)
    keys = list(orjson.loads(line))
    assert [key for key in LINE_KEYS if key in keys] == keys  # Gym's keys first, in its order; ours after
    record = codec.decode_record_line(line.strip(), 0)
    assert record.refused and record.failed  # a 503, counted apart from the errors
    assert (record.upstream_attempted, record.response_source) == (False, "local")
    assert record.local_response_reason == "proxy_over_capacity"
    assert record.stream is True and record.stream_truncated is False
    assert codec.decode_record_line(_refused_line(stream_requested=False).strip(), 0).stream is False


def test_the_writer_is_this_process_and_the_proxy_names_its_upstream_and_request_id() -> None:
    scope = {SCOPE_UPSTREAM: "http://vllm:8000", SCOPE_UPSTREAM_REQUEST_ID: "req-7"}
    call = InFlightCall("chat", "r", CaptureSettings(), scope=scope)
    call.set_request(b'{"model": "m"}')
    call.on_response_start(200, "application/json")
    call.on_body(b'{"id": "chatcmpl-1", "choices": []}')
    call.finish()
    record = codec.decode_record_line(call.line(1, 2).strip(), 0)
    host, pid = socket.gethostname(), os.getpid()
    assert record.writer == {"host": host, "pid": pid, "layer": "proxy", "upstream": "http://vllm:8000"}
    assert record.upstream_request_id == "req-7" and not record.refused
    assert writer_of(None) == {"host": host, "pid": pid, "layer": "in_process"}
    assert writer_of(None) is writer_of(None)  # built once per process, not per call
