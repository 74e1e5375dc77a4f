"""Tokens expected but absent (issue 22 item 3): which requests ask for token ids or log-probs, and when an
answer lacks them (in no choice, or not in some). Bodies are the vLLM-shaped fixtures
(``tests/fixtures/vllm``) with the tokens taken out, as a server that ignores the ask answers."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from support import FIXTURES_ROOT

from otel_capture._dialects.missing import tokens_missing

JsonDict = dict[str, Any]
VLLM = FIXTURES_ROOT / "vllm"
CHAT: JsonDict = json.loads((VLLM / "chat_return_token_ids.json").read_text())
COMPLETION: JsonDict = json.loads((VLLM / "completions_return_token_ids.json").read_text())
CHAT_ASK = {"messages": [], "n": 2, "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
COMPLETION_ASK = {"prompt": [1, 2], "n": 2, "logprobs": 1, "return_token_ids": True}


def without(body: JsonDict, *keys: str) -> JsonDict:
    body = copy.deepcopy(body)
    for key in keys:
        body.pop(key, None)
        for choice in body.get("choices", []):
            choice.pop(key, None)
    return body


def test_a_full_answer_misses_nothing() -> None:
    assert tokens_missing(CHAT_ASK, CHAT, "chat") is None
    assert tokens_missing(COMPLETION_ASK, COMPLETION, "completions") is None


def test_nothing_asked_nothing_missing() -> None:
    bare = without(CHAT, "logprobs", "token_ids", "prompt_token_ids")
    assert tokens_missing({"messages": []}, bare, "chat") is None
    assert tokens_missing({"messages": [], "logprobs": False, "top_logprobs": 0}, bare, "chat") is None
    assert tokens_missing({"logprobs": True}, {"content": [], "stop_reason": "end_turn"}, "messages") is None


def test_log_probs_asked_and_none_returned() -> None:
    # vLLM with top_logprobs null (NeMo RL#2845): logprobs asked, none in the answer
    reason = tokens_missing({"messages": [], "logprobs": True}, without(CHAT, "logprobs"), "chat")
    assert reason == "log-probs asked for (logprobs=true), none in the response"


def test_token_ids_and_prompt_ids_stripped_by_a_router() -> None:
    reason = tokens_missing(CHAT_ASK, without(CHAT, "token_ids", "prompt_token_ids"), "chat")
    assert reason is not None
    # the log-probs carry no ids of their own: the generated ids are missing, and the prompt's
    assert "token ids asked for (return_token_ids), none in the response" in reason
    assert "prompt token ids asked for (return_token_ids), none in the response" in reason
    assert "log-probs" not in reason


def test_one_choice_without_its_log_probs_is_named() -> None:
    body = copy.deepcopy(COMPLETION)
    del body["choices"][1]["logprobs"]  # one choice of two lost its log-probs
    reason = tokens_missing(COMPLETION_ASK, body, "completions")
    assert reason == "log-probs asked for (logprobs=1), none for choice 1"
    # fewer than the usage counts is a token_mismatch (test_token_mismatch.py), not tokens missing
    body = copy.deepcopy(COMPLETION)
    body["choices"][1]["logprobs"]["token_logprobs"].pop()
    assert tokens_missing(COMPLETION_ASK, body, "completions") is None


def test_completions_logprobs_zero_asks_too() -> None:
    reason = tokens_missing({"prompt": "x", "logprobs": 0}, without(COMPLETION, "logprobs"), "completions")
    assert reason == "log-probs asked for (logprobs=0), none in the response"


def test_responses_include_asks_for_output_text_log_probs() -> None:
    response = {
        "object": "response",
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "hi", "logprobs": []}]}],
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }
    request = {"input": "hi", "include": ["message.output_text.logprobs"]}
    assert tokens_missing(request, response, "responses") == (
        "log-probs asked for (include=message.output_text.logprobs), none in the response"
    )
    response["output"][0]["content"][0]["logprobs"] = [{"token": "hi", "logprob": -0.5, "top_logprobs": []}]
    assert tokens_missing(request, response, "responses") is None


def test_responses_reasoning_tokens_are_not_counted_against_output_text_log_probs() -> None:
    response = {
        "output": [
            {"type": "reasoning", "summary": []},
            {
                "type": "message",
                "content": [{"type": "output_text", "text": "hi", "logprobs": [{"logprob": -1.0}]}],
            },
        ],
        "usage": {"input_tokens": 3, "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 4}},
    }
    assert tokens_missing({"include": ["message.output_text.logprobs"]}, response, "responses") is None


@pytest.mark.parametrize("dialect", ["chat", "completions"])
def test_prompt_log_probs_asked_and_absent(dialect: str) -> None:
    body = CHAT if dialect == "chat" else COMPLETION
    reason = tokens_missing({"prompt_logprobs": 1}, body, dialect)
    assert reason == "prompt log-probs asked for (prompt_logprobs=1), none in the response"
    present = copy.deepcopy(body)
    present["prompt_logprobs"] = [None, {"651": {"logprob": -3.0}}]
    assert tokens_missing({"prompt_logprobs": 1}, present, dialect) is None


def test_sglang_return_logprob() -> None:
    assert tokens_missing({"return_logprob": True}, without(CHAT, "logprobs"), "chat") == (
        "log-probs asked for (return_logprob), none in the response"
    )


def test_odd_bodies_are_no_error() -> None:
    assert tokens_missing({"logprobs": True}, {"choices": "no"}, "chat") == (
        "log-probs asked for (logprobs=true), none in the response"
    )
    assert tokens_missing(None, CHAT, "chat") is None
    assert tokens_missing(CHAT_ASK, None, "chat") is None


@pytest.mark.parametrize(
    ("ask", "dialect", "named"),
    [
        ({"return_token_ids": True}, "chat", "return_token_ids"),
        ({"logprobs": True}, "chat", "logprobs=true"),
        ({"top_logprobs": 2}, "chat", "top_logprobs=2"),
        ({"logprobs": 0}, "completions", "logprobs=0"),
        ({"include": ["message.output_text.logprobs"]}, "responses", "include="),
        ({"return_logprob": True}, "generate", "return_logprob"),
        ({"prompt_logprobs": 1}, "chat", "prompt_logprobs=1"),
    ],
)
def test_each_way_of_asking_alone_is_heard(ask: JsonDict, dialect: str, named: str) -> None:
    """Every key that asks for tokens is heard when it is the request's only one (an answer without any
    tokens then misses what it asked for), whatever quick look lets most requests go unread."""
    bare = without(CHAT, "logprobs", "token_ids", "prompt_token_ids", "prompt_logprobs")
    if dialect == "responses":
        bare = {"output": [{"type": "message", "content": [{"type": "output_text", "text": "x"}]}]}
    missing = tokens_missing({"model": "m", **ask}, bare, dialect)
    assert missing is not None and named in missing
