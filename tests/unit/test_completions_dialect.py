"""The legacy ``/v1/completions`` dialect (issue 22 item 5): reassembly, tokens, semconv, checked against the
official openai SDK's ``Completion`` types.

``tests/fixtures/vllm/completions_return_token_ids.{sse,json}`` are one call (``prompt`` as 6 token ids,
``n=2``, ``max_tokens=3``, ``logprobs=1``, ``return_token_ids``) as vLLM answers it streamed and not, built
field by field from vLLM's ``CompletionResponse``/``CompletionStreamResponse`` and their choices
(``vllm/entrypoints/openai/completion/protocol.py`` at commit d5dba2d7b0ab9b98096560c69db7126b54b14d79)
and the order of the chunks in ``completion_stream_generator`` (``completion/serving.py`` at
cc139d8ea6ff4db984778a3e77e95e1d1c7f1362): per engine step one chunk per choice with that step's text,
log-probs, ``token_ids``, the first carrying ``prompt_token_ids``, the last ``finish_reason``; then the usage
chunk and ``[DONE]``. The openai SDK has no accumulator for completions: its ``Completion`` model is the
reference for the shape of the reassembled object.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import Completion
from support import FIXTURES_ROOT

from otel_capture._dialects import DIALECT_PATHS, DIALECTS
from otel_capture._dialects.completions import completions_input, legacy_log_probs
from otel_capture._dialects.reassembly import accumulator_for
from otel_capture._dialects.sse import SSEDecoder
from otel_capture._records import tokens_line
from otel_capture._telemetry import content_attributes, response_attributes

JsonDict = dict[str, Any]
VLLM = FIXTURES_ROOT / "vllm"
STREAM = (VLLM / "completions_return_token_ids.sse").read_bytes()
BODY: JsonDict = json.loads((VLLM / "completions_return_token_ids.json").read_text())
PROMPT = [2, 651, 6037, 576, 6081, 603]


def reassemble(raw: bytes) -> tuple[JsonDict, str | None]:
    accumulator = accumulator_for("completions")
    decoder = SSEDecoder()
    for event in decoder.feed(raw) + decoder.close():
        accumulator.add(event)
    assert accumulator.internal_errors == 0
    result = accumulator.result()
    assert result is not None
    return result, accumulator.terminal


def line(response: JsonDict) -> JsonDict:
    raw = tokens_line(response, rollout_id="r", model_call_id="c")
    assert raw is not None
    found: JsonDict = json.loads(raw)
    return found


def test_the_dialect_is_registered_with_its_path_and_operation() -> None:
    assert DIALECT_PATHS["/v1/completions"] == "completions"
    spec = DIALECTS["completions"]
    assert (spec.operation_name, spec.provider_name, spec.openai_api_type) == (
        "text_completion",
        "openai",
        None,
    )


def test_the_fixture_body_is_an_sdk_completion() -> None:
    completion = Completion.model_validate(BODY)
    assert [c.text for c in completion.choices] == [" Paris is the", " Lyon, France"]


def test_the_reassembled_stream_is_the_sdk_completion_of_the_same_call() -> None:
    streamed, terminal = reassemble(STREAM)
    assert terminal == "completed"
    ours, theirs = Completion.model_validate(streamed), Completion.model_validate(BODY)
    fields = {"index", "text", "logprobs", "finish_reason"}
    assert [c.model_dump(include=fields) for c in ours.choices] == [
        c.model_dump(include=fields) for c in theirs.choices
    ]
    assert (ours.id, ours.model, ours.created, ours.usage) == (
        theirs.id,
        theirs.model,
        theirs.created,
        theirs.usage.model_copy(update={"prompt_tokens_details": None}) if theirs.usage else None,
    )
    # vLLM's own fields, as the non-streaming body has them
    for mine, body in zip(streamed["choices"], BODY["choices"], strict=True):
        for key in ("token_ids", "prompt_token_ids", "stop_reason"):
            assert mine[key] == body[key]


def test_a_streamed_call_gives_the_tokens_line_of_the_same_call_not_streamed() -> None:
    streamed, _ = reassemble(STREAM)
    assert line(streamed) == line(BODY)
    found = line(BODY)
    assert found["prompt_token_ids"] == PROMPT
    assert found["generations"] == [
        {"index": 0, "token_ids": [9079, 603, 573], "log_probs": [-0.0625, -0.8125, -1.25]},
        {"index": 1, "token_ids": [55433, 235269, 6081], "log_probs": [-2.5, -0.375, -0.5]},
    ]


def test_a_cut_stream_keeps_what_it_carried() -> None:
    events = STREAM.split(b"\n\n")
    cut = b"\n\n".join(events[:3]) + b"\n\n"  # step 0 of both choices, step 1 of choice 0
    streamed, terminal = reassemble(cut)
    assert terminal is None
    assert [c["text"] for c in streamed["choices"]] == [" Paris is", " Lyon"]
    assert [c["finish_reason"] for c in streamed["choices"]] == [None, None]
    assert line(streamed)["generations"][0] == {
        "index": 0,
        "token_ids": [9079, 603],
        "log_probs": [-0.0625, -0.8125],
    }


def test_legacy_log_probs_without_token_ids_and_with_ids_as_tokens() -> None:
    body = json.loads(json.dumps(BODY))
    for choice in body["choices"]:
        del choice["token_ids"], choice["prompt_token_ids"]
        choice["logprobs"]["tokens"] = ["token_id:1", "token_id:2", "token_id:3"]
    found = line(body)
    assert found["prompt_token_ids"] is None
    assert found["generations"][0] == {
        "index": 0,
        "token_ids": [1, 2, 3],
        "log_probs": [-0.0625, -0.8125, -1.25],
    }


def test_echo_leaves_the_prompt_entries_out_of_the_generated_log_probs() -> None:
    # echo: the lists start with the prompt's tokens, the first without a log-prob
    logprobs = {"tokens": ["a", "b", "c", "d"], "token_logprobs": [None, -1.0, -2.0, -3.0]}
    assert legacy_log_probs(logprobs, [7, 8], None) == (None, [-2.0, -3.0])
    assert legacy_log_probs(logprobs, None, 3) == (None, [-3.0])
    assert legacy_log_probs(logprobs, None, None) == (None, None)  # never prompt and output mixed


def test_choices_of_several_prompts_carry_their_own_prompt_ids() -> None:
    body = json.loads(json.dumps(BODY))
    body["choices"][1]["prompt_token_ids"] = [2, 9]
    found = line(body)
    assert found["prompt_token_ids"] is None
    assert [g["prompt_token_ids"] for g in found["generations"]] == [PROMPT, [2, 9]]


@pytest.mark.parametrize(
    ("prompt", "parts"),
    [
        ("The capital of France is", [[{"type": "text", "content": "The capital of France is"}]]),
        (["a", "b"], [[{"type": "text", "content": "a"}], [{"type": "text", "content": "b"}]]),
        (PROMPT, [[{"type": "token_ids", "content": "6 token ids"}]]),
        (
            [PROMPT, [1, 2]],
            [
                [{"type": "token_ids", "content": "6 token ids"}],
                [{"type": "token_ids", "content": "2 token ids"}],
            ],
        ),
    ],
)
def test_the_prompt_is_one_user_message_per_prompt(prompt: Any, parts: list[Any]) -> None:
    assert completions_input({"prompt": prompt}) == ([], [{"role": "user", "parts": p} for p in parts])


def test_span_attributes_of_a_completion() -> None:
    attributes = response_attributes(BODY, "completions")
    assert attributes["gen_ai.response.finish_reasons"] == ["length", "length"]
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (6, 6)
    content = content_attributes("completions", {"prompt": "Hi"}, BODY, 10_000)
    assert json.loads(content["gen_ai.output.messages"])[1] == {
        "role": "assistant",
        "parts": [{"type": "text", "content": " Lyon, France"}],
        "finish_reason": "length",
    }
    assert json.loads(content["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "Hi"}]}
    ]


def test_llama_cpp_s_chat_shaped_log_probs_are_joined_too() -> None:
    # llama.cpp's /v1/completions sends logprobs.content[] (as its Chat does), one entry per streamed token;
    # the shape as its server answered the tiny model (tests/e2e/test_tiny_model_completions.py checks it)
    def entry(token_id: int, token: str, logprob: float) -> JsonDict:
        return {
            "id": token_id,
            "token": token,
            "bytes": list(token.encode()),
            "logprob": logprob,
            "top_logprobs": [],
        }

    steps = [entry(506, " the", -1.59), entry(5279, " capital", -0.65)]
    chunks = [
        {
            "id": "c",
            "object": "text_completion",
            "choices": [
                {"index": 0, "text": s["token"], "finish_reason": None, "logprobs": {"content": [s]}}
            ],
        }
        for s in steps
    ]
    chunks.append(
        {
            "id": "c",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8},
        }
    )
    raw = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    streamed, terminal = reassemble(raw)
    assert terminal == "completed"
    body = {
        "id": "c",
        "object": "text_completion",
        "choices": [
            {"index": 0, "text": " the capital", "finish_reason": "length", "logprobs": {"content": steps}}
        ],
    }
    assert streamed["choices"][0]["logprobs"] == body["choices"][0]["logprobs"]
    assert (
        line(streamed)["generations"]
        == line(body)["generations"]
        == [{"index": 0, "token_ids": [506, 5279], "log_probs": [-1.59, -0.65]}]
    )


def test_llama_cpp_s_native_completions_stream_ends_at_its_stop_event() -> None:
    # llama.cpp serves its own API on /completions (without /v1): not OpenAI's shape, but not a cut stream
    raw = (
        b'data: {"index":0,"content":",","tokens":[236764],"stop":false}\n\n'
        b'data: {"index":0,"content":"","tokens":[],"stop":true,"tokens_predicted":1}\n\n'
    )
    _, terminal = reassemble(raw)
    assert terminal == "completed"
