"""The token-in/token-out ``generate`` dialect (otel_capture._dialects.generate): vLLM's
``/inference/v1/generate`` and SGLang's native ``/generate``, streamed and not, in the shapes of
``tests/fixtures/generate/`` (built from the servers' sources; their README names the commits).

What a user would notice: a streamed call gives the record and tokens line of the same call not streamed;
the record reads its usage, finish reason and model; the tokens line has the prompt ids, output ids and
log-probs; the route selects the dialect and the servers' other routes stay unrecorded."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from support import FIXTURES_ROOT

from otel_capture._capture.call import InFlightCall
from otel_capture._correlation.routing import dialect_of
from otel_capture._dialects import DIALECTS, finish_reasons
from otel_capture._dialects.reassembly import accumulator_for
from otel_capture._dialects.sse import SSEDecoder
from otel_capture._records import codec
from otel_capture._settings import CaptureSettings
from otel_capture._telemetry import content_attributes, response_attributes

GENERATE = FIXTURES_ROOT / "generate"
PROMPT = [2, 651, 6037, 576, 6081, 603]
OUTPUT = [7127, 235265, 714, 6037]
LOG_PROBS = [-0.0625, -0.375, -1.125, -0.8125]
VLLM_REQUEST: dict[str, Any] = {
    "model": "gemma-3-270m",
    "token_ids": PROMPT,
    "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 1},
    "return_token_ids": True,
}
SGLANG_REQUEST: dict[str, Any] = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    "return_logprob": True,
}
VLLM_BODY: dict[str, Any] = json.loads((GENERATE / "vllm_generate.json").read_text())
SGLANG_BODY: dict[str, Any] = json.loads((GENERATE / "sglang_generate.json").read_text())


def _reassemble(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    accumulator = accumulator_for("generate")
    for event in SSEDecoder().feed(raw):
        accumulator.add(event)
    assert accumulator.internal_errors == 0
    return accumulator.result(), accumulator.terminal


def _line(request: dict[str, Any], body: bytes, *, stream: bool) -> bytes:
    """The record line the capture writes for one call answered with ``body``."""
    call = InFlightCall("generate", "r", CaptureSettings(service_name="svc"))
    call.set_request(orjson.dumps({**request, "stream": stream}))
    call.on_response_start(200, "text/event-stream" if stream else "application/json")
    for event in body.split(b"\n\n") if stream else [body]:
        call.on_body(event + b"\n\n" if stream else event)
    call.finish()
    tokens = codec.tokens_line(call.response_obj, rollout_id="r", model_call_id="c", request=call.request_obj)
    assert tokens is not None
    return call.line(1, 2) + tokens


def _record_and_tokens(request: dict[str, Any], body: bytes, *, stream: bool) -> tuple[Any, dict[str, Any]]:
    record_line, tokens_line = _line(request, body, stream=stream).splitlines()
    return codec.decode_record_line(record_line, 0), orjson.loads(tokens_line)


# -- vLLM --------------------------------------------------------------------------------------------------


def test_a_vllm_stream_reassembles_into_the_body_vllm_answers_unstreamed() -> None:
    result, terminal = _reassemble((GENERATE / "vllm_generate.sse").read_bytes())
    assert terminal == "completed" and result is not None
    assert result["choices"] == VLLM_BODY["choices"]  # ids, log-probs, finish reason: as the body has them
    assert result["prompt_token_ids"] == PROMPT and result["request_id"] == VLLM_BODY["request_id"]
    usage = {k: v for k, v in VLLM_BODY["usage"].items() if v is not None}
    assert result["usage"] == usage


@pytest.mark.parametrize("stream", [False, True])
def test_a_vllm_call_gives_its_record_and_tokens_line(stream: bool) -> None:
    body = (GENERATE / ("vllm_generate.sse" if stream else "vllm_generate.json")).read_bytes()
    record, tokens = _record_and_tokens(VLLM_REQUEST, body, stream=stream)
    assert (record.dialect, record.stream, record.error_category) == ("generate", stream, None)
    assert (record.tokens_in, record.tokens_out, record.tokens_total) == (6, 4, 10)
    assert (record.finish_reason, record.model) == ("length", "gemma-3-270m")
    assert record.response_id == VLLM_BODY["request_id"]
    assert record.request == {**VLLM_REQUEST, "stream": stream}
    assert record.response is not None and record.response["choices"] == VLLM_BODY["choices"]
    assert tokens["prompt_token_ids"] == PROMPT
    assert tokens["generations"] == [{"index": 0, "token_ids": OUTPUT, "log_probs": LOG_PROBS}]


def test_vllm_prompt_ids_come_from_the_request_when_the_answer_has_none() -> None:
    body = {k: v for k, v in VLLM_BODY.items() if k != "prompt_token_ids"}
    request = {k: v for k, v in VLLM_REQUEST.items() if k != "return_token_ids"}
    line = codec.tokens_line(body, rollout_id="r", model_call_id="c", request=request)
    assert line is not None and orjson.loads(line)["prompt_token_ids"] == PROMPT
    assert (
        orjson.loads(codec.tokens_line(body, rollout_id="r", model_call_id="c") or b"{}")["prompt_token_ids"]
        is None
    )  # without the request: nothing invented


def test_vllm_text_mode_joins_the_texts_and_n_keeps_choices_apart() -> None:
    chunks = [
        {"request_id": "g", "output_mode": "text", "choices": [{"index": 1, "text": "b", "token_ids": [5]}]},
        {"request_id": "g", "output_mode": "text", "choices": [{"index": 0, "text": "a", "token_ids": [3]}]},
        {
            "request_id": "g",
            "choices": [{"index": 0, "text": "c", "token_ids": [4], "finish_reason": "stop"}],
        },
        {
            "request_id": "g",
            "choices": [{"index": 1, "text": "", "token_ids": [], "finish_reason": "length"}],
        },
    ]
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    result, _ = _reassemble(raw)
    assert result is not None
    assert [(c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in result["choices"]] == [
        (0, "ac", [3, 4], "stop"),
        (1, "b", [5], "length"),
    ]
    assert finish_reasons(result, "generate") == ["stop", "length"]


def test_an_error_chunk_ends_the_stream_as_an_error() -> None:
    error = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    accumulator = accumulator_for("generate")
    for event in SSEDecoder().feed(b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n"):
        accumulator.add(event)
    assert accumulator.terminal == "error" and accumulator.error == error["error"]


# -- SGLang ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sglang_generate_cumulative.sse", "sglang_generate_incremental.sse"])
def test_an_sglang_stream_reassembles_into_the_body_sglang_answers_unstreamed(name: str) -> None:
    result, terminal = _reassemble((GENERATE / name).read_bytes())
    assert terminal == "completed"
    assert result == SGLANG_BODY  # text, output ids and meta_info with every log-prob entry


@pytest.mark.parametrize(
    "body", ["sglang_generate.json", "sglang_generate_cumulative.sse", "sglang_generate_incremental.sse"]
)
def test_an_sglang_call_gives_its_record_and_tokens_line(body: str) -> None:
    stream = body.endswith(".sse")
    record, tokens = _record_and_tokens(SGLANG_REQUEST, (GENERATE / body).read_bytes(), stream=stream)
    assert (record.dialect, record.error_category, record.response) == ("generate", None, SGLANG_BODY)
    # NeMo Gym's rules find none of these in an SGLang answer: read from its meta_info
    assert (record.tokens_in, record.tokens_out, record.tokens_total) == (6, 4, 10)
    assert (record.finish_reason, record.response_id) == ("length", SGLANG_BODY["meta_info"]["id"])
    assert (record.cached_tokens, record.cache_hit, record.model) == (0, False, None)
    assert record.engine_weight_version == "default"
    assert tokens == {
        "schema_version": 1,
        "rollout_id": "r",
        "model_call_id": "c",
        "model": None,
        "prompt_token_ids": PROMPT,  # the request's input_ids
        "generations": [{"index": 0, "token_ids": OUTPUT, "log_probs": LOG_PROBS}],
    }


def test_an_sglang_answer_read_by_the_other_dialects_rules_gives_gyms_facts() -> None:
    """Only a generate line gets the meta_info facts: the same body under another dialect reads as NeMo Gym
    reads it (nothing), so Gym's own files keep giving Gym's records."""
    line = orjson.loads(_line(SGLANG_REQUEST, (GENERATE / "sglang_generate.json").read_bytes(), stream=False)
                        .splitlines()[0])  # fmt: skip
    line["dialect"] = "completions"
    record = codec.decode_record_line(orjson.dumps(line), 0)
    assert (record.tokens_in, record.finish_reason, record.response_id) == (None, None, None)


def test_a_batched_sglang_stream_is_kept_raw_not_reassembled() -> None:
    chunks = [{"index": 0, "text": "a", "output_ids": [1], "meta_info": {"completion_tokens": 1}},
              {"index": 1, "text": "b", "output_ids": [2], "meta_info": {"completion_tokens": 1}}]  # fmt: skip
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    call = InFlightCall("generate", "r", CaptureSettings())
    call.set_request(orjson.dumps({"input_ids": [[1], [2]], "stream": True}))
    call.on_response_start(200, "text/event-stream")
    call.on_body(raw)
    call.finish()
    line = orjson.loads(call.line(1, 2))
    assert line["response"] is None and line["response_raw"] == raw.decode()


def test_sglang_finish_reasons_semconv_messages_and_span_attributes() -> None:
    assert finish_reasons(SGLANG_BODY, "generate") == ["length"]
    content = content_attributes("generate", SGLANG_REQUEST, SGLANG_BODY, 10_000)
    assert json.loads(content["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "token_ids", "content": "6 token ids"}]}
    ]
    assert json.loads(content["gen_ai.output.messages"]) == [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": SGLANG_BODY["text"]}],
            "finish_reason": "length",
        }
    ]
    vllm = content_attributes("generate", VLLM_REQUEST, VLLM_BODY, 10_000)
    assert json.loads(vllm["gen_ai.output.messages"])[0]["parts"] == [
        {"type": "token_ids", "content": "4 token ids"}
    ]
    attributes = response_attributes(VLLM_BODY, "generate")
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (6, 4)
    assert DIALECTS["generate"].operation_name == "text_completion"


# -- routes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "root_path", "dialect"),
    [
        ("POST", "/inference/v1/generate", "", "generate"),
        ("POST", "/generate", "", "generate"),
        ("POST", "/generate/", "", "generate"),
        ("POST", "/ng-rollout/r1/generate", "/ng-rollout/r1", "generate"),
        ("PUT", "/generate", "", None),  # SGLang serves PUT too: not a route the capture records
        ("GET", "/generate", "", None),
        ("POST", "/v1/generate", "", None),
        ("POST", "/inference/v1/abort_requests", "", None),
        ("GET", "/v1/models", "", None),
        ("GET", "/health", "", None),
        ("POST", "/update_weight_version", "", None),
        ("POST", "/update_weights_from_disk", "", None),
        ("POST", "/pause", "", None),
        ("POST", "/chat/completions", "", "chat"),  # the /v1-less OpenAI paths still select theirs
    ],
)
def test_the_generate_routes_select_the_dialect_and_no_other_route_does(
    method: str, path: str, root_path: str, dialect: str | None
) -> None:
    assert dialect_of({"type": "http", "method": method, "path": path, "root_path": root_path}) == dialect


@pytest.mark.parametrize(
    "name", ["vllm_generate.sse", "sglang_generate_cumulative.sse", "sglang_generate_incremental.sse"]
)
def test_a_stream_cut_anywhere_keeps_the_tokens_that_arrived(name: str) -> None:
    raw = (GENERATE / name).read_bytes()
    for cut in range(0, len(raw), 7):
        result, terminal = _reassemble(raw[:cut])
        assert terminal is None  # no [DONE]: the record says stream_truncated
        if result is None:
            continue
        ids = result["choices"][0]["token_ids"] if "choices" in result else result["output_ids"]
        assert ids == OUTPUT[: len(ids)]  # a prefix of the answer, never more nor other ids
