"""The token family's pure extraction: response dict in, ``<id>.tokens.jsonl`` line out."""

from __future__ import annotations

import json

from support import RECORDED, recorded_json

from otel_capture import extract_tokens
from otel_capture._records import tokens_line


def test_vllm_chat_with_return_token_ids_and_logprobs() -> None:
    response = {
        "model": "qwen",
        "prompt_token_ids": [101, 102, 103],
        "choices": [
            {
                "index": 0,
                "token_ids": [7, 8],
                "logprobs": {"content": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -2}]},
            },
            {"index": 1, "token_ids": [9], "logprobs": None},
        ],
    }
    line = tokens_line(response, rollout_id="r", model_call_id="c")
    assert line is not None and line.endswith(b"\n")
    assert json.loads(line) == {
        "schema_version": 1,
        "rollout_id": "r",
        "model_call_id": "c",
        "model": "qwen",
        "prompt_token_ids": [101, 102, 103],
        "generations": [
            {"index": 0, "token_ids": [7, 8], "log_probs": [-0.1, -2.0]},
            {"index": 1, "token_ids": [9], "log_probs": None},
        ],
    }


def test_llama_cpp_logprob_ids_and_vllm_token_id_strings_give_ids() -> None:
    llama = {"choices": [{"logprobs": {"content": [{"id": 5, "token": "x", "logprob": -1.0}]}}]}
    assert extract_tokens(llama) == {
        "prompt_token_ids": None,
        "generations": [{"index": 0, "token_ids": [5], "log_probs": [-1.0]}],
    }
    vllm = {"choices": [{"logprobs": {"content": [{"token": "token_id:42", "logprob": -0.5}]}}]}
    assert extract_tokens(vllm)["generations"][0]["token_ids"] == [42]  # type: ignore[index]


def test_responses_logprobs_and_nemo_gym_vllm_output_items() -> None:
    responses = {
        "output": [
            {"type": "reasoning"},
            {
                "type": "message",
                "content": [{"type": "output_text", "logprobs": [{"token": "h", "logprob": -0.25}]}],
            },
        ]
    }
    assert extract_tokens(responses) == {
        "prompt_token_ids": None,
        "generations": [{"index": 1, "token_ids": None, "log_probs": [-0.25]}],
    }
    gym = {
        "output": [
            {
                "type": "message",
                "prompt_token_ids": [1, 2],
                "generation_token_ids": [3],
                "generation_log_probs": [-1],
            }
        ]
    }
    assert extract_tokens(gym) == {
        "prompt_token_ids": [1, 2],
        "generations": [{"index": 0, "token_ids": [3], "log_probs": [-1.0]}],
    }


def test_the_openai_logprobs_of_a_recorded_stream_reassembled() -> None:
    from otel_capture._dialects.reassembly import accumulator_for
    from otel_capture._dialects.sse import SSEDecoder

    raw = (
        RECORDED / "openai-python/chat_completions_sse/content_logprobs_events.83b060bae42e.sse"
    ).read_bytes()
    accumulator = accumulator_for("chat")
    for event in SSEDecoder().feed(raw):
        accumulator.add(event)
    found = extract_tokens(accumulator.result())
    assert found is not None and found["generations"][0]["log_probs"][0] == -0.0025094282


def test_no_token_data_no_line() -> None:
    for response in (
        None,
        {},
        json.loads(recorded_json("messages")),
        json.loads(recorded_json("chat")),
        {"choices": "x"},
    ):
        assert tokens_line(response, rollout_id="r", model_call_id="c") is None
    nothing = {
        "prompt_token_ids": [True, "a"],
        "choices": [{"token_ids": ["a"], "logprobs": {"content": []}}],
    }
    assert extract_tokens(nothing) is None  # lists with no id in them are no ids


def test_odd_entries_are_null_and_the_rest_kept() -> None:
    # an odd entry (a bool, a text, a log-prob that is no number) no longer costs its whole list
    # (docs/tokens.md, "Odd entries"); a list without a single id is still no ids
    weird = {
        "prompt_token_ids": [1, True],
        "choices": [{"token_ids": ["a"], "logprobs": {"content": [{"logprob": "x"}]}}],
    }
    assert extract_tokens(weird) == {
        "prompt_token_ids": [1, None],
        "generations": [{"index": 0, "token_ids": None, "log_probs": [None]}],
    }


def test_vllm_responses_ids_from_input_and_output_messages() -> None:
    # vLLM's Responses answer with enable_response_messages: the ids come as raw_message_tokens entries
    response = {
        "model": "gemma",
        "output": [
            {
                "type": "message",
                "content": [
                    {
                        "type": "output_text",
                        "logprobs": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0}],
                    }
                ],
            }
        ],
        "input_messages": [{"type": "raw_message_tokens", "message": "<prompt>", "tokens": [2, 105, 7]}],
        "output_messages": [{"type": "raw_message_tokens", "message": "ab", "tokens": [64, 65]}],
    }
    assert extract_tokens(response) == {
        "prompt_token_ids": [2, 105, 7],
        "generations": [{"index": 0, "token_ids": [64, 65], "log_probs": [-0.5, -1.0]}],
    }
    without_logprobs = {**response, "output": [{"type": "reasoning"}, {"type": "message", "content": []}]}
    assert extract_tokens(without_logprobs) == {
        "prompt_token_ids": [2, 105, 7],
        "generations": [{"index": 1, "token_ids": [64, 65], "log_probs": None}],
    }
    # an entry that is not raw_message_tokens (or not ids) is not guessed at
    odd = {**without_logprobs, "input_messages": [{"type": "other"}], "output_messages": [{"tokens": "x"}]}
    assert extract_tokens(odd) is None
