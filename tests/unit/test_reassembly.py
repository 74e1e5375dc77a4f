"""Stream reassembly against the official SDKs' own accumulators, on every recorded stream.

References (all offline, fed the same decoded events):

- Chat Completions: ``openai.lib.streaming.chat.ChatCompletionStreamState().current_completion_snapshot``
  (not ``get_final_completion()``, which raises on ``length``/``content_filter``).
- Responses: ``openai.lib.streaming.responses.ResponseStreamState``: for a finished stream the response it
  emits with ``response.completed``/``.failed``/``.incomplete``; for a cut stream its running snapshot, which
  assembles ``output_text`` and ``function_call_arguments`` deltas only, so there the comparison is on those.
- Messages: ``anthropic.lib.streaming._beta_messages.accumulate_event``: the beta accumulator keeps what the
  plain one drops (``compaction_delta``, the fallback block's relabelled ``model``, ``usage.iterations``).

What is excluded from the comparison, and why (everything else must be equal):

- Chat: the SDK's message model carries ``parsed``, ``annotations``, ``audio``, ``function_call`` and
  ``tool_calls`` as ``None`` when the stream never sent them (model defaults, not stream data; the
  non-streaming body has no such keys); its tool calls keep the stream's ``index`` and its own
  ``parsed_arguments``.
- Responses: ``parsed`` on output text and ``parsed_arguments`` on function calls (added by the SDK's
  ``parse_response``, not in the stream).
- Messages: a tool input whose JSON is unfinished (``max_tokens`` cut it, or the stream was cut) reads as
  the SDK's (jiter's partial parse, compared as is); we also keep the text as the block's ``partial_json``,
  which the SDK does not. That side field is left out of the comparison, after checking that it is
  unfinished JSON and that the SDK's parse of it is the ``input`` we give, so the bytes we keep must be
  exactly those the SDK parsed.
- Chat: vLLM's ``choices[i].token_ids`` (``return_token_ids``) are joined across chunks by us; the SDK keeps
  only a choice's first chunk's extra fields, so ``tests/unit/test_stream_tokens.py`` compares them with
  vLLM's non-streaming body instead (none of the recorded streams here has them).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from typing import Any, cast

import httpx2
import jiter
import orjson
import pytest
from anthropic.lib.streaming import _beta_messages
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from support import RECORDED as STREAMS
from support import recorded_streams

from otel_capture._dialects.chat import ChatCompletionsAccumulator
from otel_capture._dialects.reassembly import Dialect, accumulator_for
from otel_capture._dialects.sse import SSEDecoder, SSEEvent

JsonDict = dict[str, Any]


# -- the recordings ------------------------------------------------------------------------------------


RECORDED = recorded_streams()
EXPECTED_TERMINAL = {"streamingerrorhandling__insufficientquotaerrorresponse.sse": "error"}


def test_the_recordings_are_there() -> None:
    dialects = [dialect for _, dialect, _ in RECORDED]
    assert (dialects.count("chat"), dialects.count("responses"), dialects.count("messages")) == (12, 5, 16)


def recorded_params() -> list[Any]:
    return [pytest.param(name, dialect, raw, id=name) for name, dialect, raw in RECORDED]


# -- feeding -------------------------------------------------------------------------------------------


def split(raw: bytes, sizes: Iterable[int]) -> list[bytes]:
    chunks, start = [], 0
    for size in sizes:
        if start >= len(raw):
            break
        chunks.append(raw[start : start + size])
        start += size
    if start < len(raw):
        chunks.append(raw[start:])
    return chunks


def random_chunks(raw: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return split(raw, (rng.randint(1, 97) for _ in range(len(raw))))


def decode(chunks: Iterable[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    return events + decoder.close()


def accumulate(dialect: Dialect, events: Iterable[SSEEvent]) -> Any:
    accumulator = accumulator_for(dialect)
    for event in events:
        accumulator.add(event)
    assert accumulator.internal_errors == 0
    return accumulator


def strip_event_lines(raw: bytes) -> bytes:
    return b"".join(line for line in raw.splitlines(keepends=True) if not line.startswith(b"event:"))


def with_keepalives(raw: bytes) -> bytes:
    return b": keep-alive\n\n" + raw.replace(b"\n\n", b"\n: comment inside\n\n: keep-alive\n\n")


# Every variant must give the same reassembly as the SDK on the plain stream.
VARIANTS: dict[str, Callable[[bytes], list[bytes]]] = {
    "whole": lambda raw: [raw],
    "1-byte": lambda raw: [raw[i : i + 1] for i in range(len(raw))],
    "random-1": lambda raw: random_chunks(raw, 1),
    "random-2": lambda raw: random_chunks(raw, 2),
    "crlf-1-byte": lambda raw: split(raw.replace(b"\n", b"\r\n"), [1] * len(raw) * 2),
    "cr-random": lambda raw: random_chunks(raw.replace(b"\n", b"\r"), 3),
    "data-only": lambda raw: [strip_event_lines(raw)],
    "no-final-blank-line": lambda raw: random_chunks(raw.rstrip(b"\r\n"), 4),
    "keep-alives": lambda raw: random_chunks(with_keepalives(raw), 5),
}


# -- the SDK references --------------------------------------------------------------------------------


def json_events(events: Iterable[SSEEvent]) -> list[JsonDict]:
    parsed = []
    for event in events:
        try:
            obj = json.loads(event.data)
        except ValueError:
            continue
        if isinstance(obj, dict):
            parsed.append(obj)
    return parsed


def dump(model: Any) -> JsonDict:
    result: JsonDict = model.model_dump(mode="json", exclude_unset=True, by_alias=True, warnings=False)
    return result


def sdk_chat(events: list[SSEEvent]) -> JsonDict | None:
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    chunks = json_events(events)
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    if not chunks:
        return None
    snapshot = dump(state.current_completion_snapshot)
    if snapshot.get("usage", ...) is None:  # the SDK copies each chunk's usage, None before the usage chunk
        del snapshot["usage"]
    for choice in snapshot["choices"]:
        message = choice["message"]
        # After only one chunk of a choice the SDK's message lacks `refusal` (it re-dumps the message with
        # its defaults from the second chunk on); the non-streaming body always has it.
        message.setdefault("refusal", None)
        for key in ("parsed", "annotations", "audio", "function_call", "tool_calls"):
            if key in message and message[key] is None:
                del message[key]
        for call in message.get("tool_calls", []):
            del call["index"]
            call["function"].pop("parsed_arguments", None)
    return snapshot


def sdk_responses(events: list[SSEEvent]) -> tuple[JsonDict | None, JsonDict | None]:
    """(the response the SDK emits with the terminal event, its running snapshot)."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    final = None
    for obj in json_events(events):
        for out in state.handle_event(cast(Any, construct_type(type_=ResponseStreamEvent, value=obj))):
            if final is None and out.type in ("response.completed", "response.failed", "response.incomplete"):
                final = dump(out.response)
    snapshot = getattr(state, "_ResponseStreamState__current_snapshot", None)  # no public accessor
    if final is not None:
        for item in final["output"]:
            item.pop("parsed_arguments", None)
            for part in item.get("content") or []:
                part.pop("parsed", None)
    return final, (dump(snapshot) if snapshot is not None else None)


def sdk_messages(events: list[SSEEvent]) -> JsonDict | None:
    snapshot = None
    buffers: dict[int, bytes] = {}
    for obj in json_events(events):
        if obj.get("type") == "ping" or (snapshot is None and obj.get("type") != "message_start"):
            continue
        snapshot = _beta_messages.accumulate_event(
            event=obj,  # type: ignore[arg-type]  # the SDK builds the model from a dict itself
            current_snapshot=snapshot,
            json_bufs=buffers,
            request_headers=httpx2.Headers(),
        )
    return dump(snapshot) if snapshot is not None else None


def without_partial_json(message: JsonDict | None) -> JsonDict | None:
    """``message`` without the ``partial_json`` side field of its unfinished tool inputs, once checked:
    the text is unfinished JSON and its partial parse, the SDK's way, is the block's ``input``."""
    if message is None:
        return None
    message = dict(message)
    content = []
    for block in message["content"]:
        if "partial_json" in block:
            block = dict(block)
            text = block.pop("partial_json")
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)  # only an unfinished input keeps its text
            assert block["input"] == jiter.from_json(text.encode(), partial_mode=True)
        content.append(block)
    message["content"] = content
    return message


def sdk_reference(dialect: Dialect, events: list[SSEEvent]) -> JsonDict | None:
    if dialect == "chat":
        return sdk_chat(events)
    if dialect == "messages":
        return sdk_messages(events)
    return sdk_responses(events)[0]


def ours_comparable(dialect: Dialect, result: JsonDict | None) -> JsonDict | None:
    return without_partial_json(result) if dialect == "messages" else result


# -- complete streams ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("name", "dialect", "raw"), recorded_params())
def test_reassembly_equals_the_sdk(name: str, dialect: Dialect, raw: bytes, variant: str) -> None:
    reference = sdk_reference(dialect, decode([raw]))
    assert reference is not None
    accumulator = accumulate(dialect, decode(VARIANTS[variant](raw)))
    assert ours_comparable(dialect, accumulator.result()) == reference
    assert accumulator.terminal == EXPECTED_TERMINAL.get(name, "completed")


@pytest.mark.parametrize(("name", "dialect", "raw"), recorded_params())
def test_terminal_and_error(name: str, dialect: Dialect, raw: bytes) -> None:
    accumulator = accumulate(dialect, decode([raw]))
    if name == "streamingerrorhandling__insufficientquotaerrorresponse.sse":
        # `event: error` comes first and wins; the result is still response.failed's response.
        assert accumulator.terminal == "error"
        assert accumulator.error["code"] == "insufficient_quota"
        assert accumulator.error["type"] == "insufficient_quota"
        result = accumulator.result()
        assert result["status"] == "failed"
        assert result["error"]["code"] == "insufficient_quota"
    else:
        assert accumulator.terminal == "completed"
        assert accumulator.error is None


def test_the_unfinished_tool_json_is_kept_whole() -> None:
    name = "messages_sse/incomplete_partial_json_response.sse"
    raw = next(raw for n, _, raw in RECORDED if n == name)
    events = decode([raw])
    pieces = [
        obj["delta"]["partial_json"]
        for obj in json_events(events)
        if obj.get("type") == "content_block_delta" and obj["delta"]["type"] == "input_json_delta"
    ]
    result = accumulate("messages", events).result()
    tool = result["content"][1]
    sdk_tool = sdk_messages(events)["content"][1]  # type: ignore[index]
    assert tool["type"] == "tool_use"
    assert tool["input"] == sdk_tool["input"]  # the record reads the cut input as the SDK reads it
    assert tool["input"] == {
        "filename": "taxes.txt",
        "lines_of_text": [
            "# COMPREHENSIVE TAX GUIDE FOR INDIVIDUALS WITH MULTIPLE W-2s",
            "",
            "## INTRODUCTION",
            "",
        ],
    }
    assert tool["partial_json"] == "".join(pieces)
    assert tool["partial_json"].endswith('"Filing taxes')  # the SDK's parse loses this unfinished string
    assert "partial_json" not in sdk_tool
    assert result["stop_reason"] == "max_tokens"


@pytest.mark.parametrize(
    ("pieces", "expected_input", "kept"),
    [
        (['{"city": "Par', 'is", "days": 3}'], {"city": "Paris", "days": 3}, False),  # finished: parsed whole
        (['{"city": "Paris", "days": [1, 2', ", 3"], {"city": "Paris", "days": [1, 2, 3]}, True),
        (['{"city": "Par'], {}, True),  # the unfinished string is dropped, as the SDK drops it
        (
            ['{"city" "Paris"}'],
            {},
            True,
        ),  # not JSON at all (the SDK raises): the text is kept, input as started
    ],
)
def test_a_tool_input_is_parsed_as_the_sdk_parses_it(
    pieces: list[str], expected_input: JsonDict, kept: bool
) -> None:
    events = [
        '{"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "content": [],'
        ' "model": "x", "usage": {"input_tokens": 1, "output_tokens": 0}}}',
        '{"type": "content_block_start", "index": 0,'
        ' "content_block": {"type": "tool_use", "id": "t", "name": "weather", "input": {}}}',
        *(
            json.dumps(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "input_json_delta", "partial_json": p},
                }
            )
            for p in pieces
        ),
    ]
    decoded = [SSEEvent(None, e) for e in events]
    (tool,) = accumulate("messages", decoded).result()["content"]
    assert tool["input"] == expected_input
    assert tool.get("partial_json") == ("".join(pieces) if kept else None)
    try:
        sdk = sdk_messages(decoded)
    except ValueError:  # "Unable to parse tool parameter JSON from model"
        assert kept and tool["input"] == {}
        return
    assert sdk is not None and sdk["content"][0]["input"] == expected_input


def test_server_tool_use_input_and_kept_blocks() -> None:
    raw = next(raw for n, _, raw in RECORDED if n.endswith("stream-a-toolrefusal.sse"))
    result = accumulate("messages", decode([raw])).result()
    kinds = [block["type"] for block in result["content"]]
    assert kinds == ["server_tool_use", "web_search_tool_result", "text"]
    assert result["content"][0]["input"] == {"query": "solar eclipse viewing safety news 2026"}
    assert result["content"][1]["content"][0]["type"] == "web_search_result"
    assert result["stop_reason"] == "refusal" and result["stop_details"]["type"] == "refusal"


def test_thinking_and_signature_are_kept() -> None:
    raw = next(raw for n, _, raw in RECORDED if n.endswith("stream-a-refusal.sse"))
    result = accumulate("messages", decode([raw])).result()
    thinking = [block for block in result["content"] if block["type"] == "thinking"]
    assert thinking and thinking[0]["thinking"] and thinking[0]["signature"]


def test_chat_choices_stay_apart() -> None:
    raw = next(raw for n, _, raw in RECORDED if n.startswith("parse_pydantic_model_multiple_choices"))
    result = accumulate("chat", decode([raw])).result()
    contents = [json.loads(choice["message"]["content"]) for choice in result["choices"]]
    assert [choice["index"] for choice in result["choices"]] == [0, 1, 2]
    assert [content["temperature"] for content in contents] == [65, 61, 59]


@pytest.mark.parametrize(
    "stem",
    ["parse_nothing", "parse_max_tokens_reached", "parse_pydantic_tool", "parse_multiple_pydantic_tools"],
)
def test_chat_result_has_the_non_streaming_shape(stem: str) -> None:
    raw = next(raw for n, _, raw in RECORDED if n.startswith(stem + "."))
    body = json.loads((STREAMS / "openai-python" / "chat_completions_json" / f"{stem}.json").read_text())
    result = accumulate("chat", decode([raw])).result()
    assert set(result) == set(body)
    for ours, theirs in zip(result["choices"], body["choices"], strict=True):
        assert set(ours) == set(theirs)
        assert set(ours["message"]) == set(theirs["message"])
        for our_call, their_call in zip(
            ours["message"].get("tool_calls", []), theirs["message"].get("tool_calls", []), strict=True
        ):
            assert set(our_call) == set(their_call) and set(our_call["function"]) == set(
                their_call["function"]
            )


# -- Responses deltas assembled without the final event ------------------------------------------------

_DONE_EVENTS = {
    "response.output_item.done",
    "response.content_part.done",
    "response.output_text.done",
    "response.function_call_arguments.done",
    "response.completed",
}


def _responses_projection(response: JsonDict) -> list[tuple[str, str]]:
    """(item type, its text or arguments) per output item: what a cut stream must keep."""
    projection = []
    for item in response["output"]:
        if item["type"] == "message":
            text = "".join(part.get("text", part.get("refusal", "")) for part in item.get("content", []))
            projection.append(("message", text))
        elif item["type"] == "function_call":
            projection.append(("function_call", item["arguments"]))
        elif item["type"] == "reasoning":
            parts = (item.get("summary") or []) + (item.get("content") or [])
            projection.append(("reasoning", "".join(part.get("text", "") for part in parts)))
    return projection


def _without_encrypted(output: list[JsonDict]) -> list[JsonDict]:
    return [{k: v for k, v in item.items() if k != "encrypted_content"} for item in output]


RESPONSES_COMPLETED = [
    p for p in recorded_params() if p.values[1] == "responses" and b"response.completed" in p.values[2]
]


@pytest.mark.parametrize(("name", "dialect", "raw"), RESPONSES_COMPLETED)
def test_responses_output_is_assembled_without_the_final_event(
    name: str, dialect: Dialect, raw: bytes
) -> None:
    events = decode([raw])
    final = accumulate(dialect, events).result()
    before_final = [event for event in events if json.loads(event.data)["type"] != "response.completed"]
    partial = accumulate(dialect, before_final)
    assert partial.terminal is None
    # OpenAI re-encrypts a reasoning item's `encrypted_content` each time it sends it (added, done and
    # completed all differ in these recordings), so that one field cannot match.
    assert _without_encrypted(partial.result()["output"]) == _without_encrypted(final["output"])
    deltas_only = [event for event in events if json.loads(event.data)["type"] not in _DONE_EVENTS]
    partial = accumulate(dialect, deltas_only).result()
    assert partial["id"] == final["id"] and partial["status"] == "in_progress"
    assert _responses_projection(partial) == _responses_projection(final)


# -- cut streams ---------------------------------------------------------------------------------------

_TERMINAL_MARKERS = (
    b"data: [DONE]",
    b'"type":"response.completed"',
    b'"type":"error"',
    b"event: message_stop",
)


def cut_points(raw: bytes) -> list[int]:
    """Byte offsets strictly before the first terminal event's line, spread over the stream."""
    end = min(raw.find(marker) for marker in _TERMINAL_MARKERS if marker in raw)
    end = raw.rfind(b"\n", 0, end) + 1 if raw.rfind(b"\n", 0, end) >= 0 else end
    rng = random.Random(len(raw))
    points = {0, 1, end, max(end - 1, 0), *(end * k // 12 for k in range(12)), *rng.sample(range(end), 12)}
    return sorted(points)


def _texts(dialect: Dialect, result: JsonDict | None) -> dict[str, str]:
    if result is None:
        return {}
    texts: dict[str, str] = {}
    if dialect == "chat":
        for choice in result["choices"]:
            message = choice["message"]
            for key in ("content", "refusal", "reasoning_content", "reasoning"):
                if message.get(key):
                    texts[f"{choice['index']}.{key}"] = message[key]
            for number, call in enumerate(message.get("tool_calls", [])):
                texts[f"{choice['index']}.tool{number}"] = call["function"]["arguments"]
    elif dialect == "responses":
        for number, (kind, text) in enumerate(_responses_projection(result)):
            texts[f"{number}.{kind}"] = text
    else:
        for number, block in enumerate(result["content"]):
            for key in ("text", "thinking"):
                if block.get(key):
                    texts[f"{number}.{key}"] = block[key]
    return texts


def assert_same_items_and_text(ours: list[JsonDict], sdk: list[JsonDict]) -> None:
    """The SDK's running snapshot holds the items as added plus their text and argument deltas."""
    assert [(item["type"], item["id"]) for item in ours] == [(item["type"], item["id"]) for item in sdk]
    for (kind, our_text), (_, sdk_text) in zip(
        _responses_projection({"output": ours}), _responses_projection({"output": sdk}), strict=True
    ):
        if kind != "reasoning":  # the SDK does not assemble reasoning deltas
            assert our_text == sdk_text


@pytest.mark.parametrize(("name", "dialect", "raw"), recorded_params())
def test_cut_streams_keep_a_prefix_of_the_content(name: str, dialect: Dialect, raw: bytes) -> None:
    full = _texts(dialect, accumulate(dialect, decode([raw])).result())
    for point in cut_points(raw):
        events = decode(random_chunks(raw[:point], point))
        accumulator = accumulate(dialect, events)
        assert accumulator.terminal is None, point
        result = accumulator.result()
        for key, text in _texts(dialect, result).items():
            assert full[key].startswith(text), (point, key)
        if dialect == "responses":
            _, snapshot = sdk_responses(events)
            if snapshot is not None:
                assert_same_items_and_text(result["output"], snapshot["output"])
        else:
            assert ours_comparable(dialect, result) == sdk_reference(dialect, events), point


# -- llama.cpp-style Responses (no output_index, content_index or sequence_number) -------------------

_LLAMA_EVENTS: list[JsonDict] = [
    {
        "type": "response.created",
        "response": {
            "id": "resp_llama1",
            "object": "response",
            "status": "in_progress",
            "model": "gemma-3-270m",
            "output": [],
        },
    },
    {
        "type": "response.in_progress",
        "response": {
            "id": "resp_llama1",
            "object": "response",
            "status": "in_progress",
            "model": "gemma-3-270m",
            "output": [],
        },
    },
    {
        "type": "response.output_item.added",
        "item": {
            "id": "rs_l1",
            "type": "reasoning",
            "status": "in_progress",
            "summary": [],
            "content": [],
            "encrypted_content": "",
        },
    },
    {"type": "response.reasoning_text.delta", "item_id": "rs_l1", "delta": "The user wants "},
    {"type": "response.reasoning_text.delta", "item_id": "rs_l1", "delta": "the weather."},
    {
        "type": "response.output_item.added",
        "item": {
            "id": "msg_l1",
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        },
    },
    {"type": "response.output_text.delta", "item_id": "msg_l1", "delta": "Let me "},
    {"type": "response.output_text.delta", "item_id": "msg_l1", "delta": "check — ☀️."},
    {
        "type": "response.output_item.added",
        "item": {
            "id": "fc_l1",
            "type": "function_call",
            "call_id": "call_l1",
            "name": "get_weather",
            "arguments": "",
            "status": "in_progress",
        },
    },
    {"type": "response.function_call_arguments.delta", "item_id": "fc_l1", "delta": '{"city": '},
    {"type": "response.function_call_arguments.delta", "delta": '"Paris"}'},
    {"type": "response.function_call_arguments.done", "item_id": "fc_l1", "arguments": '{"city": "Paris"}'},
    {
        "type": "response.output_item.done",
        "item": {
            "id": "fc_l1",
            "type": "function_call",
            "call_id": "call_l1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        },
    },
    {
        "type": "response.completed",
        "response": {
            "id": "resp_llama1",
            "object": "response",
            "status": "completed",
            "model": "gemma-3-270m",
            "usage": {"input_tokens": 12, "output_tokens": 20, "total_tokens": 32},
        },
    },
]
_LLAMA_OUTPUT = [
    {
        "id": "rs_l1",
        "type": "reasoning",
        "status": "in_progress",
        "summary": [],
        "encrypted_content": "",
        "content": [{"type": "reasoning_text", "text": "The user wants the weather."}],
    },
    {
        "id": "msg_l1",
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [{"type": "output_text", "text": "Let me check — ☀️.", "annotations": []}],
    },
    {
        "id": "fc_l1",
        "type": "function_call",
        "call_id": "call_l1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    },
]


def _llama_stream(events: list[JsonDict]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events)


def test_llama_cpp_style_responses_stream() -> None:
    raw = _llama_stream(_LLAMA_EVENTS)
    accumulator = accumulate("responses", decode(random_chunks(raw, 7)))
    assert accumulator.terminal == "completed"
    result = accumulator.result()
    # The terminal response left out `output`: it is rebuilt from the items, as the openai SDK does.
    assert result["output"] == _LLAMA_OUTPUT
    assert result["status"] == "completed" and result["usage"]["total_tokens"] == 32


def test_llama_cpp_style_responses_stream_cut() -> None:
    raw = _llama_stream(
        [*_LLAMA_EVENTS[:-4], {"type": "response.function_call_arguments.delta", "delta": '"Pa'}]
    )
    accumulator = accumulate("responses", decode([raw]))
    assert accumulator.terminal is None
    result = accumulator.result()
    assert result["id"] == "resp_llama1" and result["status"] == "in_progress"
    assert [item["id"] for item in result["output"]] == ["rs_l1", "msg_l1", "fc_l1"]
    assert result["output"][1]["content"][0]["text"] == "Let me check — ☀️."
    assert result["output"][2]["arguments"] == '{"city": "Pa'


def test_responses_deltas_for_items_that_never_arrived_are_kept() -> None:
    raw = _llama_stream(
        [
            {
                "type": "response.output_text.delta",
                "item_id": "msg_x",
                "output_index": 0,
                "content_index": 0,
                "delta": "Hi",
            },
            {
                "type": "response.refusal.delta",
                "item_id": "msg_x",
                "output_index": 0,
                "content_index": 1,
                "delta": "No.",
            },
            {
                "type": "response.reasoning_summary_text.delta",
                "item_id": "rs_x",
                "output_index": 1,
                "summary_index": 0,
                "delta": "Thought.",
            },
        ]
    )
    result = accumulate("responses", decode([raw])).result()
    assert result["output"][0]["content"] == [
        {"type": "output_text", "text": "Hi", "annotations": []},
        {"type": "refusal", "refusal": "No."},
    ]
    assert result["output"][1]["type"] == "reasoning"
    assert result["output"][1]["summary"] == [{"type": "summary_text", "text": "Thought."}]


# -- terminal detection from payloads ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dialect", "stream", "terminal"),
    [
        ("chat", b"data: [DONE]", "completed"),
        ("chat", b'data: {"error": {"message": "boom", "type": "server_error"}}\n\n', "error"),
        ("chat", b'event: error\ndata: {"message": "boom"}\n\n', "error"),
        ("chat", b'data: {"error": null, "choices": []}\n\n', None),
        (
            "responses",
            b'data: {"type": "response.incomplete", "response": {"status": "incomplete"}}\n\n',
            "incomplete",
        ),
        (
            "responses",
            b'data: {"type": "response.failed", "response": {"error": {"code": "x"}}}\n\n',
            "failed",
        ),
        ("responses", b'data: {"type": "error", "code": "server_error", "message": "boom"}\n\n', "error"),
        ("responses", b'event: response.completed\ndata: {"response": {"id": "r"}}\n\n', "completed"),
        ("messages", b'data: {"type": "message_stop"}', "completed"),
        ("messages", b'data: {"type": "error", "error": {"type": "overloaded_error"}}\n\n', "error"),
        ("messages", b'event: message_stop\ndata: {"x": 1}\n\n', "completed"),
    ],
)
def test_terminal_comes_from_the_payload(dialect: Dialect, stream: bytes, terminal: str | None) -> None:
    accumulator = accumulate(dialect, decode([stream]))
    assert accumulator.terminal == terminal
    assert (accumulator.error is not None) == (terminal in ("error", "failed"))


def test_first_terminal_wins() -> None:
    stream = (
        b'data: {"type": "response.completed", "response": {"id": "a", "output": []}}\n\n'
        b'data: {"type": "response.failed", "response": {"id": "b", "output": []}}\n\n'
    )
    accumulator = accumulate("responses", decode([stream]))
    assert accumulator.terminal == "completed" and accumulator.result()["id"] == "a"


def test_in_stream_errors_are_recorded() -> None:
    chat = accumulate("chat", decode([b'data: {"error": {"message": "boom", "code": 500}}\n\n']))
    assert chat.error == {"message": "boom", "code": 500}
    messages = accumulate(
        "messages",
        decode(
            [
                b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", "message": "x"}}\n\n'
            ]
        ),
    )
    assert messages.error == {"type": "overloaded_error", "message": "x"}
    responses = accumulate("responses", decode([b'data: {"type": "error", "code": "c", "message": "m"}\n\n']))
    assert responses.error == {"code": "c", "message": "m"}


# -- what counts as content (time to first chunk) ------------------------------------------------------


@pytest.mark.parametrize(("name", "dialect", "raw"), recorded_params())
def test_first_content_event(name: str, dialect: Dialect, raw: bytes) -> None:
    accumulator = accumulator_for(dialect)
    flags = [accumulator.add(event) for event in decode([raw])]
    if name == "streamingerrorhandling__insufficientquotaerrorresponse.sse" or not any(flags):
        # no output at all: the quota error, and the refusal fixture whose only text block stays empty
        assert name.endswith(("insufficientquotaerrorresponse.sse", "refusal_response.sse"))
        assert not any(_texts(dialect, accumulate(dialect, decode([raw])).result()).values())
        return
    first = flags.index(True)
    assert not any(flags[:first])
    before = accumulate(dialect, decode([raw])[:first]).result()
    assert not any(_texts(dialect, before).values())  # nothing the model wrote arrived before it


@pytest.mark.parametrize(
    ("dialect", "data", "carries"),
    [
        ("chat", '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}', False),
        ("chat", '{"choices": [{"index": 0, "delta": {"content": "a"}}]}', True),
        ("chat", '{"choices": [{"index": 0, "delta": {"reasoning_content": "r"}}]}', True),
        ("chat", '{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c"}]}}]}', True),
        ("chat", '{"choices": [], "usage": {"total_tokens": 3}}', False),
        ("responses", '{"type": "response.output_text.delta", "delta": "x"}', True),
        ("responses", '{"type": "response.reasoning_summary_text.delta", "delta": "x"}', True),
        ("responses", '{"type": "response.created", "response": {"id": "r"}}', False),
        (
            "messages",
            '{"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "t"}}',
            True,
        ),
        (
            "messages",
            '{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}',
            False,
        ),
        ("messages", '{"type": "ping"}', False),
    ],
)
def test_content_flag(dialect: Dialect, data: str, carries: bool) -> None:
    assert accumulator_for(dialect).add(SSEEvent(None, data)) is carries


# -- chat details no recording exercises ---------------------------------------------------------------


def _chat(*chunks: JsonDict) -> JsonDict:
    result: JsonDict = accumulate("chat", [SSEEvent(None, orjson.dumps(c).decode()) for c in chunks]).result()
    return result


def test_chat_reasoning_and_tool_calls_without_index() -> None:
    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    result = _chat(
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "think "}}]},
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "more"}}]},
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{"}}
                        ]
                    },
                }
            ],
        },
        {**base, "choices": [{"index": 0, "delta": {"tool_calls": [{"function": {"arguments": "}"}}]}}]},
        {
            **base,
            "choices": [{"index": 0, "delta": {"tool_calls": [{"id": "b", "function": {"name": "g"}}]}}],
        },
        {
            **base,
            "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
            "service_tier": "default",
        },
    )
    message = result["choices"][0]["message"]
    assert message["role"] == "assistant" and message["reasoning_content"] == "think more"
    assert message["tool_calls"] == [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}},
    ]
    assert result["choices"][0]["finish_reason"] == "tool_calls" and result["service_tier"] == "default"


def test_chat_keeps_the_last_usage_even_if_a_later_chunk_has_none() -> None:
    result = _chat(
        {"id": "c", "choices": [], "usage": {"total_tokens": 5}},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}], "usage": None},
    )
    assert result["usage"] == {"total_tokens": 5}


# -- hostile input -------------------------------------------------------------------------------------

_HOSTILE = [
    "",
    "[DONE",
    "null",
    "[]",
    "1",
    '"x"',
    "{",
    '{"type": 5}',
    '{"choices": "x"}',
    '{"choices": [1, null]}',
    '{"choices": [{"index": "a", "delta": [], "logprobs": {"content": "x"}}]}',
    '{"choices": [{"delta": {"tool_calls": [{"index": -1, "function": "f"}, 3]}}]}',
    '{"type": "response.output_text.delta", "output_index": 99, "content_index": 99, "delta": 5}',
    '{"type": "response.output_text.delta", "output_index": true, "content_index": -1, "delta": "x"}',
    '{"type": "response.output_item.added", "item": []}',
    '{"type": "response.content_part.added", "part": {"type": "output_text"}, "content_index": 7}',
    '{"type": "response.output_text.annotation.added", "annotation": {"x": 1}}',
    '{"type": "response.completed", "response": []}',
    '{"type": "content_block_delta", "index": 3, "delta": {"type": "input_json_delta", "partial_json": "{"}}',
    '{"type": "content_block_delta", "index": "a", "delta": {"type": "citations_delta"}}',
    '{"type": "content_block_delta", "delta": {"type": "new_delta", "x": [1]}}',
    '{"type": "message_delta", "delta": [], "usage": 3}',
    '{"type": "message_start", "message": {"content": "x", "usage": null}}',
    '{"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}',
    "\ud800",
    '{"a": 1e999999, "b": 123456789012345678901234567890}',
]


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_hostile_payloads_never_raise(dialect: Dialect) -> None:
    accumulator = accumulator_for(dialect)
    for data in _HOSTILE:
        for name in (None, "error", "message_stop", "response.completed"):
            accumulator.add(SSEEvent(name, data))
    assert accumulator.internal_errors == 0
    result = accumulator.result()
    assert result is None or isinstance(orjson.dumps(result), bytes)


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_nothing_usable_gives_none(dialect: Dialect) -> None:
    accumulator = accumulate(dialect, decode([b": keep-alive\n\ndata: not json\n\ndata: [1, 2]\n\n"]))
    assert accumulator.result() is None and accumulator.terminal is None


def test_unknown_dialect() -> None:
    with pytest.raises(ValueError, match="dialect"):
        accumulator_for("embeddings")  # type: ignore[arg-type]


# -- long streams --------------------------------------------------------------------------------------


def _long_stream(dialect: Dialect, pieces: list[str]) -> list[SSEEvent]:
    def ev(obj: JsonDict) -> SSEEvent:
        return SSEEvent(None, json.dumps(obj))

    if dialect == "chat":
        return [ev({"id": "c", "choices": [{"index": 0, "delta": {"content": p}}]}) for p in pieces]
    if dialect == "messages":
        start = [
            ev({"type": "message_start", "message": {"id": "m", "content": []}}),
            ev({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ]
        return start + [
            ev({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}})
            for p in pieces
        ]
    start = [
        ev(
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {"type": "message", "id": "i", "content": []},
            }
        )
    ]
    return start + [
        ev({"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": p})
        for p in pieces
    ]


def _text_of(dialect: Dialect, result: JsonDict) -> str:
    if dialect == "chat":
        return str(result["choices"][0]["message"]["content"])
    if dialect == "messages":
        return str(result["content"][0]["text"])
    return str(result["output"][0]["content"][0]["text"])


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_many_deltas_join_exactly_and_the_result_can_be_read_mid_stream(dialect: Dialect) -> None:
    """Text deltas are kept as pieces (appending to a str made long streams quadratic) and written back
    whenever the result is read; reading it mid-stream changes nothing."""
    pieces = [f"t{i % 97}é " for i in range(5000)]
    accumulator = accumulator_for(dialect)
    for number, event in enumerate(_long_stream(dialect, pieces)):
        accumulator.add(event)
        if number in (3, 700, 3001):
            assert _text_of(dialect, accumulator.result()).startswith("t0é t1é")
    assert _text_of(dialect, accumulator.result()) == "".join(pieces)
    assert _text_of(dialect, accumulator.result()) == "".join(pieces)  # reading twice is the same
    assert accumulator.internal_errors == 0


def test_a_done_event_replaces_the_streamed_pieces() -> None:
    accumulator = accumulator_for("responses")
    events = [
        *_long_stream("responses", ["a", "b", "c"]),
        SSEEvent(
            None,
            json.dumps(
                {"type": "response.output_text.done", "output_index": 0, "content_index": 0, "text": "final"}
            ),
        ),
    ]
    for event in events:
        accumulator.add(event)
    assert _text_of("responses", accumulator.result()) == "final"


def _chat_datas() -> list[tuple[str, list[str]]]:
    """The data of every event of every recorded chat stream (OpenAI's, vLLM's with log-probs and token
    ids), and of hand-made ones that leave the usual shape mid-stream."""
    found = []
    for name, dialect, raw in RECORDED:
        if dialect == "chat":
            found.append((name, [e.data for e in SSEDecoder().feed(raw)]))
    vllm = (STREAMS / "vllm_0.32.0_cpu" / "chat_completions.sse").read_bytes()
    found.append(("vllm chat", [e.data for e in SSEDecoder().feed(vllm)]))

    def chunk(delta: dict[str, Any], **choice: Any) -> str:
        body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        return orjson.dumps({**body, "choices": [{"index": 0, "delta": delta, **choice}]}).decode()

    found.append(
        (
            "shapes",
            [
                chunk({"role": "assistant", "content": ""}),
                *(chunk({"content": f"w{i} "}) for i in range(40)),
                chunk({"content": "a", "reasoning_content": "r"}),  # two keys: add's way
                chunk({"content": "b"}, logprobs={"content": [{"token": "b", "logprob": -0.5}]}),
                chunk({"content": "c"}, token_ids=[7]),
                chunk({"content": "d"}, index=1),  # a choice not begun
                chunk(
                    {"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f", "arguments": "{}"}}]}
                ),
                chunk({"content": "NaN"}),
                '{"choices": [{"index": 0, "delta": {"content": "x"}}], "x": NaN}',  # lenient JSON
                chunk({"content": "e"}, finish_reason="stop"),
                orjson.dumps({"id": "c", "choices": [], "usage": {"prompt_tokens": 3}}).decode(),
                "[DONE]",
            ],
        )
    )
    lp = {"content": [{"token": "w", "logprob": -0.5, "bytes": [119], "top_logprobs": []}]}
    found.append(
        (
            "vllm shapes",  # what an RL run asks vLLM for: token ids and log-probs on every chunk
            [
                chunk({"role": "assistant", "content": ""}, logprobs=None, finish_reason=None),
                *(chunk({"content": f"w{i} "}, logprobs=lp, token_ids=[i]) for i in range(300)),
                chunk({"content": "a"}, logprobs=None, token_ids=None),  # null token ids: the key kept
                chunk({"content": "b"}, logprobs=[1], token_ids=[1]),  # log-probs not an object
                chunk({"content": "c"}, logprobs={"refusal": [{"token": "r"}]}, token_ids="x"),
                chunk({"content": "d"}, logprobs={"content": "not a list"}, token_ids=[2]),
                chunk({"content": "e"}, token_ids=[3], stop_reason=None),
                chunk({"content": "f"}, token_ids=[4], stop_reason=7),
                chunk({"content": "g"}, index=True),
                chunk({"content": "h"}, index=0.0),
                chunk({"content": "i"}, index=None),
                orjson.dumps(
                    {
                        "id": "c",
                        "model": "m",
                        "new_key": 1,
                        "choices": [{"index": 0, "delta": {"content": "j"}}],
                    }
                ).decode(),  # a top-level key not seen before, then it again
                *(chunk({"content": f"k{i}"}, token_ids=[i]) for i in range(3)),
                orjson.dumps(
                    {"id": "c", "new_key": 2, "choices": [{"index": 0, "delta": {"content": "l"}}]}
                ).decode(),
                orjson.dumps({"id": "c", "error": None, "choices": [{"delta": {"content": "m"}}]}).decode(),
                orjson.dumps(
                    {
                        "id": "c",
                        "error": {"message": "boom"},
                        "choices": [{"index": 0, "delta": {"content": "o"}}],
                    }
                ).decode(),  # an error beside a usual choice: add's way (it ends the stream as "error")
                chunk({"content": "n"}, logprobs=lp, token_ids=[9]),
                chunk({"content": ""}, logprobs=lp, token_ids=[], finish_reason="length"),
                "[DONE]",
            ],
        )
    )
    found.append(
        (
            "null token ids",  # every chunk sends the key as null: the answer keeps it as null
            [
                chunk({"role": "assistant", "content": ""}),
                *(chunk({"content": f"w{i} "}, logprobs=None, token_ids=None) for i in range(5)),
            ],
        )
    )
    return found


@pytest.mark.parametrize(("name", "datas"), _chat_datas(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_chat_accumulators_batch_read_equals_reading_event_by_event(name: str, datas: list[str]) -> None:
    one_by_one = ChatCompletionsAccumulator()
    for data in datas:
        one_by_one.add(SSEEvent(None, data))
    batched = ChatCompletionsAccumulator()
    batched.add_data(datas)
    assert batched.result() == one_by_one.result() is not None
    assert (batched.terminal, batched.error) == (one_by_one.terminal, one_by_one.error)
    assert batched.internal_errors == one_by_one.internal_errors == 0
