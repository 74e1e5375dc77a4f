"""The Chat Completions accumulator reads a batch of events (``add_data``, what the deferred reassembly
feeds it) into the same answer as reading each event alone (``add``), whatever the contents and however
the chunks are written: usual content chunks whose text repeats around another content are taken without
being parsed, and nothing else may change because of it."""

from __future__ import annotations

import itertools
import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_capture._dialects.chat import ChatCompletionsAccumulator
from otel_capture._dialects.sse import SSEEvent

_HEAD = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}

# contents that look like the text around them, or that JSON escapes, or that are not printable
_contents = st.one_of(
    st.text(max_size=6),
    st.sampled_from(
        [
            '"',
            "\\",
            "\n",
            "\x00",
            "\x7f",
            "\u00a0",
            "\u2028",
            "é",
            "😀",
            "",
            " ",
            "m",
            "chatcmpl-x",
            "content",
        ]
    ),
    st.sampled_from(["null", "index", "delta", "fp", "0", "[DONE]", "error", ":", ",", "}"]),
)


def _usual(content: str, fingerprint: str | None, usage: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {**_HEAD}
    if fingerprint is not None:
        payload["system_fingerprint"] = fingerprint
    payload["choices"] = [
        {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
    ]
    if usage:
        payload["usage"] = {"prompt_tokens": 1, "completion_tokens": len(content)}
    return payload


_others = st.sampled_from(
    [
        {**_HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**_HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**_HEAD, "choices": [], "usage": {"prompt_tokens": 3}},
        {**_HEAD, "choices": [{"index": 1, "delta": {"content": "b"}}]},
        {**_HEAD, "choices": [{"index": 0, "delta": {"content": "lp"}, "logprobs": {"content": [{"t": 1}]}}]},
        # vLLM's usual RL chunk (log-probs and token ids), and log-probs of other shapes after it
        {
            **_HEAD,
            "choices": [
                {"index": 0, "delta": {"content": "v"}, "logprobs": {"content": [{"t": 2}]}, "token_ids": [9]}
            ],
        },
        {**_HEAD, "choices": [{"index": 0, "delta": {"content": "n"}, "logprobs": {"content": None}}]},
        {**_HEAD, "choices": [{"index": 0, "delta": {"content": "r"}, "logprobs": {"refusal": [{"t": 3}]}}]},
        {
            **_HEAD,
            "choices": [
                {"index": 0, "delta": {"content": "b"}, "logprobs": {"content": [{"t": 4}], "refusal": None}}
            ],
        },
        {**_HEAD, "choices": [{"index": 0, "delta": {"content": "t"}, "token_ids": [7]}]},
        {
            **_HEAD,
            "model": "other",
            "service_tier": "x",
            "choices": [{"index": 0, "delta": {"content": "o"}}],
        },
        {"error": {"message": "x"}},
    ]
)
_events = st.one_of(
    _contents.map(lambda content: _usual(content, "fp", False)),  # the usual chunk, most often the same shape
    _contents.map(lambda content: _usual(content, "fp", False)),
    st.tuples(_contents, st.sampled_from([None, "fp", "fp2"]), st.booleans()).map(lambda a: _usual(*a)),
    _others,
)


def _text(payload: dict[str, Any], spelling: int) -> str:
    if spelling == 0:
        return orjson.dumps(payload).decode()
    if spelling == 1:
        return json.dumps(payload)  # spaced, non-ASCII escaped
    if spelling == 2:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    # not JSON: what should have been escaped is not (read leniently, or not at all)
    text = orjson.dumps(payload).decode()
    return text.replace("\\n", "\n").replace("\\u0000", "\x00").replace('\\"', '"').replace("\\\\", "\\")


@settings(max_examples=400)
@given(
    stream=st.lists(st.tuples(st.integers(0, 6), _events, st.sampled_from([0, 0, 0, 1, 2, 3])), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    done=st.booleans(),
)
def test_a_batch_reads_as_its_events_one_by_one(
    stream: list[tuple[int, dict[str, Any], int]], cuts: list[int], done: bool
) -> None:
    datas = []
    for repeat, payload, spelling in stream:
        datas += [_text(payload, spelling)] * (1 + repeat % 3)  # the same text again: a template's own
    if done:
        datas.append("[DONE]")
    one_by_one = ChatCompletionsAccumulator()
    for data in datas:
        one_by_one.add(SSEEvent(None, data))
    batched = ChatCompletionsAccumulator()
    bounds = [0, *sorted(min(c, len(datas)) for c in cuts), len(datas)]
    for start, end in itertools.pairwise(bounds):
        batched.add_data(datas[start:end])
    assert orjson.dumps(batched.result()) == orjson.dumps(one_by_one.result())
    assert (batched.terminal, batched.error) == (one_by_one.terminal, one_by_one.error)
    assert batched.internal_errors == one_by_one.internal_errors == 0


def test_a_long_stream_of_usual_chunks_reads_as_its_events_one_by_one() -> None:
    datas = [orjson.dumps(_usual(f"tok{i} é", "fp", False)).decode() for i in range(600)]
    datas[300] = orjson.dumps(_usual('say "hi"\n', "fp", False)).decode()
    one_by_one = ChatCompletionsAccumulator()
    for data in datas:
        one_by_one.add(SSEEvent(None, data))
    batched = ChatCompletionsAccumulator()
    batched.add_data(datas)
    assert orjson.dumps(batched.result()) == orjson.dumps(one_by_one.result())
    assert batched.result()["choices"][0]["message"]["content"].startswith("tok0 étok1 é")  # type: ignore[index]
