"""A streamed call and the same call not streamed give the same tokens line (issue #13 item 9).

Chat Completions from vLLM with ``return_token_ids``: ``tests/fixtures/vllm/chat_return_token_ids.sse`` and
``.json`` are one call (``n=2``, ``logprobs``, ``top_logprobs=1``, ``max_tokens=4``) as vLLM writes it
streamed and not. They were built field by field from vLLM's own definitions (not recorded from a running
vLLM): ``ChatCompletionStreamResponse``, ``ChatCompletionResponseStreamChoice``, ``ChatCompletionResponse``
and ``ChatCompletionResponseChoice`` in ``vllm/entrypoints/openai/chat_completion/protocol.py`` (vLLM main at
commit 002032ee2b18e1f7bd924ec47b62504ba3866063; the module was ``vllm/entrypoints/openai/protocol.py``
before), and the order and content of the chunks from ``chat_completion_stream_generator`` in
``chat_completion/serving.py`` (commit 006c49d485f9ca479bf4989cbb694d0ac02f44b5): each choice's first chunk
carries the role and the top-level ``prompt_token_ids``, every later chunk its own ``token_ids`` and
``logprobs.content``, the last one ``finish_reason`` and ``stop_reason``, then a usage chunk and ``[DONE]``.

The openai SDK's accumulator is the reference for the fields it knows (content, log-probs, finish reasons);
for vLLM's ``token_ids`` it is not: it keeps a choice's extra fields from its first chunk only (the role
chunk, which has none), so the reference there is vLLM's own non-streaming body.

Responses: the ``response.output_text.delta`` events carry ``logprobs`` (the openai SDK's
``ResponseTextDeltaEvent``); the events here are validated by the SDK's own models.

Messages: the Anthropic API has no log-probs, and llama.cpp's ``/v1/messages`` sends none (it ignores
``logprobs``; ``tests/e2e/test_tiny_model_tokens.py`` checks that on the real server), so no tokens line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from support import FIXTURES_ROOT

from otel_capture._dialects.reassembly import Dialect, accumulator_for
from otel_capture._dialects.sse import SSEDecoder, SSEEvent
from otel_capture._records import tokens_line

JsonDict = dict[str, Any]

VLLM = FIXTURES_ROOT / "vllm"
STREAM = (VLLM / "chat_return_token_ids.sse").read_bytes()
BODY: JsonDict = json.loads((VLLM / "chat_return_token_ids.json").read_text())


def decode(raw: bytes) -> list[SSEEvent]:
    decoder = SSEDecoder()
    return decoder.feed(raw) + decoder.close()


def reassemble(dialect: Dialect, events: Iterable[SSEEvent]) -> JsonDict:
    accumulator = accumulator_for(dialect)
    for event in events:
        accumulator.add(event)
    assert accumulator.internal_errors == 0
    result = accumulator.result()
    assert result is not None
    return result


def line(response: JsonDict) -> JsonDict | None:
    raw = tokens_line(response, rollout_id="r", model_call_id="c")
    return None if raw is None else json.loads(raw)


def chunks(raw: bytes) -> list[JsonDict]:
    return [json.loads(event.data) for event in decode(raw) if event.data != "[DONE]"]


def as_stream(objects: Iterable[JsonDict]) -> bytes:
    return b"".join(b"data: " + json.dumps(obj).encode() + b"\n\n" for obj in objects) + b"data: [DONE]\n\n"


# -- Chat Completions from vLLM ---------------------------------------------------------------------


def test_the_fixtures_are_one_call_in_vllm_shapes() -> None:
    """Both parse with the openai SDK's models (vLLM's extra fields are kept as extras), and the stream's
    pieces add up to the body: the fixtures cannot disagree with each other."""
    body = ChatCompletion.model_validate(BODY)
    parsed = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks(STREAM)]
    assert parsed[0].model_extra == {"prompt_token_ids": BODY["prompt_token_ids"], "prompt_text": None}
    for choice in body.choices:
        mine = [c for chunk in parsed for c in chunk.choices if c.index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        ids = [i for c in mine for i in (c.model_extra or {}).get("token_ids") or []]
        assert ids == (choice.model_extra or {})["token_ids"]
    assert parsed[-1].choices == [] and parsed[-1].usage is not None


def test_a_streamed_vllm_call_gives_the_tokens_line_of_the_same_call_not_streamed() -> None:
    streamed = line(reassemble("chat", decode(STREAM)))
    assert streamed is not None
    assert streamed == line(BODY)
    assert streamed["prompt_token_ids"] == BODY["prompt_token_ids"]
    assert streamed["generations"] == [
        {
            "index": choice["index"],
            "token_ids": choice["token_ids"],
            "log_probs": [entry["logprob"] for entry in choice["logprobs"]["content"]],
        }
        for choice in BODY["choices"]
    ]


def test_the_reassembled_choices_are_the_non_streaming_choices() -> None:
    ours = reassemble("chat", decode(STREAM))
    assert ours["prompt_token_ids"] == BODY["prompt_token_ids"]
    assert ours["usage"] == {k: v for k, v in BODY["usage"].items() if v is not None}
    for mine, theirs in zip(ours["choices"], BODY["choices"], strict=True):
        for key in ("index", "token_ids", "finish_reason", "stop_reason"):
            assert mine[key] == theirs[key], key
        assert mine["logprobs"]["content"] == theirs["logprobs"]["content"]
        assert mine["message"]["content"] == theirs["message"]["content"]


def test_the_sdk_accumulates_the_same_content_and_log_probs() -> None:
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for chunk in chunks(STREAM):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    sdk = state.current_completion_snapshot.model_dump(mode="json", exclude_unset=True)
    ours = reassemble("chat", decode(STREAM))
    assert len(sdk["choices"]) == len(ours["choices"]) == 2
    for mine, theirs in zip(ours["choices"], sdk["choices"], strict=True):
        assert mine["message"]["content"] == theirs["message"]["content"]
        assert mine["logprobs"] == theirs["logprobs"]
        assert mine["finish_reason"] == theirs["finish_reason"]


def _without_token_ids(chunk: JsonDict) -> JsonDict:
    """The chunk as vLLM sends it without ``return_token_ids``: ``token_ids`` null, no prompt ids."""
    chunk = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
    chunk["choices"] = [{**c, "token_ids": None} if "token_ids" in c else c for c in chunk["choices"]]
    return chunk


def test_without_return_token_ids_the_log_probs_still_match() -> None:
    body = {k: v for k, v in BODY.items() if k != "prompt_token_ids"}
    body["choices"] = [{**choice, "token_ids": None} for choice in BODY["choices"]]
    ours = reassemble("chat", decode(as_stream(_without_token_ids(c) for c in chunks(STREAM))))
    assert [choice["token_ids"] for choice in ours["choices"]] == [None, None]  # null, as in the body
    streamed = line(ours)
    assert streamed is not None and streamed == line(body)
    assert streamed["prompt_token_ids"] is None
    assert [g["token_ids"] for g in streamed["generations"]] == [None, None]
    assert all(g["log_probs"] for g in streamed["generations"])


def test_return_tokens_as_token_ids_streamed() -> None:
    """vLLM's ``return_tokens_as_token_ids``: each log-prob's token is ``"token_id:N"``; without
    ``token_ids`` the ids come from there, streamed as not."""
    ids = {choice["index"]: choice["token_ids"] for choice in BODY["choices"]}
    seen = {0: 0, 1: 0}
    objects = []
    for chunk in chunks(STREAM):
        chunk = _without_token_ids(chunk)
        for choice in chunk["choices"]:
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                entry["token"] = f"token_id:{ids[choice['index']][seen[choice['index']]]}"
                seen[choice["index"]] += 1
        objects.append(chunk)
    streamed = line(reassemble("chat", decode(as_stream(objects))))
    assert streamed is not None
    assert [g["token_ids"] for g in streamed["generations"]] == [ids[0], ids[1]]


def test_a_cut_stream_keeps_the_tokens_it_carried() -> None:
    objects = chunks(STREAM)
    kept = objects[:6]  # the two role chunks, then two tokens of each choice
    cut = reassemble("chat", decode(b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in kept)))
    streamed = line(cut)
    assert streamed is not None
    assert streamed["prompt_token_ids"] == BODY["prompt_token_ids"]
    full = line(BODY)
    assert full is not None
    for mine, theirs in zip(streamed["generations"], full["generations"], strict=True):
        assert mine["token_ids"] == theirs["token_ids"][:2]
        assert mine["log_probs"] == theirs["log_probs"][:2]


# -- Responses ------------------------------------------------------------------------------------------

_EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
_TOKENS = [("Red", -0.25, [82, 101, 100]), (",", -0.5, [44]), (" green", -1.5, [32, 103, 114, 101, 101, 110])]


def _logprob(token: str, logprob: float, raw: list[int], *, with_bytes: bool) -> JsonDict:
    entry: JsonDict = {"token": token, "logprob": logprob, "top_logprobs": []}
    if with_bytes:  # the output_text part's log-probs carry bytes; the delta event's do not
        entry["bytes"] = raw
    return entry


def _responses_call() -> tuple[JsonDict, list[JsonDict]]:
    """A Responses call with ``include: ["message.output_text.logprobs"]``: its final response, and its
    events in the order the Responses API sends them."""
    text = "".join(token for token, _, _ in _TOKENS)
    part = {
        "type": "output_text",
        "text": text,
        "annotations": [],
        "logprobs": [_logprob(*t, with_bytes=True) for t in _TOKENS],
    }
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed", "content": [part]}
    response = {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "model": "m",
        "output": [item],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    shell = {**response, "status": "in_progress", "output": []}
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    events: list[JsonDict] = [
        {"type": "response.created", "response": shell},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**item, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **where, "part": {**part, "text": "", "logprobs": []}},
        *(
            {
                "type": "response.output_text.delta",
                **where,
                "delta": t[0],
                "logprobs": [_logprob(*t, with_bytes=False)],
            }
            for t in _TOKENS
        ),
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": {**part, "logprobs": []}},
        {
            "type": "response.output_item.done",
            "output_index": 0,
            "item": {**item, "content": [{**part, "logprobs": []}]},
        },
        {"type": "response.completed", "response": response},
    ]
    for number, event in enumerate(events):
        event["sequence_number"] = number
        _EVENTS.validate_python(event)  # the SDK's own event models accept every one
    Response.model_validate(response)
    return response, events


def _sse(events: Iterable[JsonDict]) -> list[SSEEvent]:
    return [SSEEvent(event["type"], json.dumps(event)) for event in events]


def test_a_streamed_responses_call_gives_the_tokens_line_of_the_same_call_not_streamed() -> None:
    response, events = _responses_call()
    streamed = line(reassemble("responses", _sse(events)))
    assert streamed is not None and streamed == line(response)
    assert streamed["generations"] == [{"index": 0, "token_ids": None, "log_probs": [-0.25, -0.5, -1.5]}]


@pytest.mark.parametrize(
    "cut_after", ["response.output_text.delta", "response.content_part.done", "response.output_item.done"]
)
def test_a_cut_responses_stream_keeps_the_log_probs_its_deltas_carried(cut_after: str) -> None:
    """Cut before ``response.completed``: the deltas' log-probs are kept, also when a ``.done`` event
    replaced the part with one that says ``"logprobs": []`` (as llama.cpp's do)."""
    _, events = _responses_call()
    last = max(i for i, event in enumerate(events) if event["type"] == cut_after)
    streamed = line(reassemble("responses", _sse(events[: last + 1])))
    assert streamed is not None
    assert streamed["generations"] == [{"index": 0, "token_ids": None, "log_probs": [-0.25, -0.5, -1.5]}]
