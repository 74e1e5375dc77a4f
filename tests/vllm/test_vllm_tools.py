"""A tool-call round trip on a real vLLM, recorded: the model calls a tool, the agent answers with the
tool's result, the model goes on; streamed and not, zero-code and through the capture proxy, with the
official ``openai`` SDK.

Gemma 3 270M's chat template knows no tools, so the call is forced with a named ``tool_choice``: vLLM then
constrains the output to the function's JSON arguments (structured outputs, on CPU too) and answers with
``tool_calls``. The template renders the ``tool`` message as a user turn, enough for the second call.

What a trainer needs from the two records: the first one's response has the tool call the SDK received
(its id, name and arguments; for a stream, its deltas joined), and the second one's request carries that
same call and the tool's result under the call's id, so the round trip can be followed record to record."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support import rollout_client
from vllm_backend import MODEL_NAME

from otel_capture import CaptureStore, ModelCallRecord, read_model_call_records

pytestmark = pytest.mark.vllm

CITIES = ["Paris", "London"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": CITIES}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
TOOL_CHOICE = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
RESULT = "18 degrees and sunny"


def _streamed_tool_calls(response: Any) -> tuple[list[dict[str, Any]], str]:
    """The tool calls the SDK's stream adds up to (by ``index``: the id, type and name from the delta that
    has them, the argument pieces joined), and the streamed content joined."""
    calls: dict[int, dict[str, Any]] = {}
    content = ""
    for line in response.iter_lines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        for choice in json.loads(line[5:])["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
                for key in ("id", "type"):
                    if piece.get(key):
                        call[key] = piece[key]
                function = piece.get("function") or {}
                if function.get("name"):
                    call["function"]["name"] = function["name"]
                call["function"]["arguments"] += function.get("arguments") or ""
    return [calls[i] for i in sorted(calls)], content


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_tool_call_round_trip_is_recorded_call_by_call(
    front: tuple[str, CaptureStore], stream: bool, request: pytest.FixtureRequest
) -> None:
    url, store = front
    rollout_id = f"tools-{request.node.callspec.id}"
    client = rollout_client(url, rollout_id, timeout=300)
    first: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [QUESTION],
        "tools": TOOLS,
        "tool_choice": TOOL_CHOICE,
        "max_tokens": 32,
    }
    with client:
        if stream:
            with client.chat.completions.with_streaming_response.create(**first, stream=True) as response:
                (called, _) = _streamed_tool_calls(response)
        else:
            received = json.loads(client.chat.completions.with_raw_response.create(**first).text)
            (choice,) = received["choices"]
            called = choice["message"]["tool_calls"]
        (call,) = called
        assert call["function"]["name"] == "get_weather" and call["id"]
        assert json.loads(call["function"]["arguments"])["city"] in CITIES
        answer = [
            QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": RESULT},
        ]
        second: dict[str, Any] = {"model": MODEL_NAME, "messages": answer, "max_tokens": 8}
        if stream:
            with client.chat.completions.with_streaming_response.create(**second, stream=True) as response:
                (_, said) = _streamed_tool_calls(response)
        else:
            said = json.loads(client.chat.completions.with_raw_response.create(**second).text)["choices"][0][
                "message"
            ]["content"]

    records: list[ModelCallRecord] = read_model_call_records(store, rollout_id)
    assert [(r.status_code, r.error_category, r.stream) for r in records] == [(200, None, stream)] * 2
    asked, answered = records
    assert asked.response is not None and answered.response is not None and answered.request is not None
    if not stream:
        assert asked.response == received  # the body as vLLM sent it
    (recorded_call,) = asked.response["choices"][0]["message"]["tool_calls"]
    assert recorded_call == {"type": "function", **call}  # id, name and arguments as the SDK got them
    # the second record's request carries the call and the tool's result under the call's id
    assert answered.request["messages"][1]["tool_calls"] == [call]
    assert answered.request["messages"][2] == {"role": "tool", "tool_call_id": call["id"], "content": RESULT}
    assert answered.response["choices"][0]["message"]["content"] == said
