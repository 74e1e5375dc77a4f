"""Token integrity per call (issue 31 item 2): odd entries are ``null`` and the rest kept, vLLM's
``"token_id:N"`` decoded, echo and ``best_of`` read right, and the invariants checked (``token_mismatch``),
over the cases in ``tests/fixtures/token_integrity/``: real vLLM 0.32.0 answers with the one field each case
is about edited (``derive.py`` there), streamed and not, through :class:`InFlightCall` as the middleware
drives it (the record line and the tokens line a user reads), and the pure functions alone."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from support import FIXTURES_ROOT, RECORDED, sse_chunks

from otel_capture._capture.call import InFlightCall, parse_object
from otel_capture._dialects.mismatch import token_mismatch
from otel_capture._dialects.missing import tokens_missing
from otel_capture._dialects.reassembly import accumulator_for
from otel_capture._dialects.sse import SSEDecoder
from otel_capture._dialects.stream import loads_nonstandard
from otel_capture._dialects.token_values import id_list, log_prob, log_prob_list, spelled_ids, token_id
from otel_capture._dialects.tokens import extract_tokens
from otel_capture._records import tokens_line
from otel_capture._records.codec import decode_record_line, encode_record_line
from otel_capture._settings import CaptureSettings

JsonDict = dict[str, Any]
CASES = FIXTURES_ROOT / "token_integrity"
VLLM_RECORDED = RECORDED / "vllm_0.32.0_cpu"
CHAT: JsonDict = json.loads((VLLM_RECORDED / "chat_completions.json").read_text())
COMPLETION: JsonDict = json.loads((VLLM_RECORDED / "completions.json").read_text())
CHAT_IDS: list[int] = CHAT["choices"][0]["token_ids"]
CHAT_LOG_PROBS: list[float] = [e["logprob"] for e in CHAT["choices"][0]["logprobs"]["content"]]
COMPLETION_LOG_PROBS: list[float] = COMPLETION["choices"][0]["logprobs"]["token_logprobs"]
BUILT = FIXTURES_ROOT / "vllm"  # n=2, built from vLLM's protocol definitions
BUILT_CHAT: JsonDict = json.loads((BUILT / "chat_return_token_ids.json").read_text())
BUILT_COMPLETION: JsonDict = json.loads((BUILT / "completions_return_token_ids.json").read_text())


def _dialect(case: str) -> str:
    return "chat" if case.startswith("chat") else "completions"


def run(
    case: str, *, stream: bool, sse: bytes | None = None
) -> tuple[JsonDict, JsonDict | None, InFlightCall]:
    """One case through :class:`InFlightCall` as the middleware drives it: the record line and the tokens
    line, as a user reads them from the files."""
    request = json.loads((CASES / f"{case}.request.json").read_text())
    call = InFlightCall(_dialect(case), "r", CaptureSettings())  # type: ignore[arg-type]  # a dialect name
    if stream:
        request["stream"] = True
        call.set_request(json.dumps(request).encode())
        call.on_response_start(200, "text/event-stream; charset=utf-8")
        for chunk in sse_chunks(sse if sse is not None else (CASES / f"{case}.sse").read_bytes()):
            call.on_body(chunk)
    else:
        call.set_request(json.dumps(request).encode())
        call.on_response_start(200, "application/json")
        call.on_body((CASES / f"{case}.json").read_bytes())
    call.finish()
    line = call.line(1, 2)
    record = json.loads(line)  # strict JSON: a NaN would make the line unreadable
    decode_record_line(line.strip(), 0)  # and the readers (NeMo Gym's model) take it
    raw_tokens = tokens_line(call.response_obj, rollout_id="r", model_call_id=call.model_call_id)
    return record, None if raw_tokens is None else json.loads(raw_tokens), call


def test_the_cases_are_what_derive_makes() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("derive", CASES / "derive.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    files = module.derive()
    assert files == {name: (CASES / name).read_text() for name in files}
    on_disk = {p.name for p in CASES.iterdir() if p.name not in ("derive.py", "README.md", "__pycache__")}
    assert on_disk == set(files)


# -- odd entries: null, and the rest kept ----------------------------------------------------------------

BOTH = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])


@BOTH
@pytest.mark.parametrize("case", ["chat_null_log_prob", "chat_nan_log_prob"])
def test_a_null_or_nan_log_prob_is_null_and_the_rest_of_the_choice_is_kept(case: str, stream: bool) -> None:
    record, tokens, _ = run(case, stream=stream)
    assert record["error_category"] is None  # a NaN body was a capture_parse_error
    assert tokens is not None
    (generation,) = tokens["generations"]
    assert generation["token_ids"] == CHAT_IDS
    assert generation["log_probs"] == [*CHAT_LOG_PROBS[:3], None, *CHAT_LOG_PROBS[4:]]
    assert tokens["prompt_token_ids"] == CHAT["prompt_token_ids"]
    assert "tokens_missing" not in record  # it was no "none in the response"
    assert (
        record["token_mismatch"] == "generation 0: 1 of 16 log-probs null, NaN or infinite (written as null)"
    )
    response = record["response"]
    assert response["choices"][0]["logprobs"]["content"][3]["logprob"] is None
    if case == "chat_nan_log_prob" and not stream:
        # the body as sent (NaN and all) is kept beside the re-encoded one
        assert record["response_raw"] == (CASES / f"{case}.json").read_text()


@BOTH
def test_vllm_token_id_tokens_are_decoded(stream: bool) -> None:
    record, tokens, _ = run("chat_token_id_tokens", stream=stream)
    assert tokens is not None
    assert tokens["generations"] == [{"index": 0, "token_ids": CHAT_IDS, "log_probs": CHAT_LOG_PROBS}]
    assert tokens["prompt_token_ids"] is None  # not asked for (no return_token_ids): none invented
    assert "tokens_missing" not in record and "token_mismatch" not in record


# -- echo and best_of ------------------------------------------------------------------------------------


@BOTH
def test_echo_without_return_token_ids_keeps_the_output_log_probs(stream: bool) -> None:
    record, tokens, _ = run("completions_echo", stream=stream)
    assert tokens is not None
    # the prompt's five entries are told apart by the usage (prompt_tokens 5, completion_tokens 16)
    assert tokens["generations"] == [{"index": 0, "token_ids": None, "log_probs": COMPLETION_LOG_PROBS}]
    assert "tokens_missing" not in record and "token_mismatch" not in record


def test_echo_in_a_stream_without_usage_says_why_the_log_probs_are_not_kept() -> None:
    sse = (CASES / "completions_echo.sse").read_bytes()
    without_usage = b"".join(c for c in sse_chunks(sse) if b'"choices":[]' not in c)
    record, tokens, _ = run("completions_echo", stream=True, sse=without_usage)
    assert tokens is None  # never a list that mixes the prompt's log-probs with the output's
    assert record["tokens_missing"] == (
        "log-probs asked for (logprobs=2), sent with echo's prompt entries that neither token ids nor a"
        " usage tell apart from the output's"
    )


def test_best_of_usage_counting_the_candidates_is_no_mismatch_nor_missing() -> None:
    record, tokens, _ = run("completions_best_of", stream=False)
    assert tokens is not None and len(tokens["generations"][0]["token_ids"]) == 16  # usage: 32
    assert "tokens_missing" not in record and "token_mismatch" not in record
    # more ids than even best_of's usage counts is one
    request = json.loads((CASES / "completions_best_of.request.json").read_text())
    body = json.loads((CASES / "completions_best_of.json").read_text())
    body["usage"]["completion_tokens"] = 15
    assert (
        token_mismatch(request, body, "completions")
        == "output: 16 token ids for 15 completion tokens (usage)"
    )


# -- the invariants ----------------------------------------------------------------------------------------


def test_an_id_lost_is_a_mismatch_against_the_log_probs_and_the_usage() -> None:
    record, tokens, _ = run("chat_short_token_ids", stream=False)
    assert record["token_mismatch"] == (
        "generation 0: 16 log-probs for 15 token ids; output: 15 token ids for 16 completion tokens (usage)"
    )
    assert "tokens_missing" not in record  # they were sent, one short: not "missing"
    assert tokens is not None and tokens["generations"][0]["token_ids"] == CHAT_IDS[:-1]


def test_an_id_lost_from_a_stream_is_a_mismatch_against_the_log_probs() -> None:
    record, tokens, _ = run("chat_short_token_ids", stream=True)
    # the recorded stream has no usage: only the log-probs tell
    assert record["token_mismatch"] == "generation 0: 16 log-probs for 15 token ids"
    assert tokens is not None and tokens["generations"][0]["token_ids"] == CHAT_IDS[:4] + CHAT_IDS[5:]


def test_prompt_ids_against_the_usage() -> None:
    record, tokens, _ = run("chat_short_prompt_ids", stream=False)
    assert record["token_mismatch"] == "prompt: 12 token ids for 13 prompt tokens (usage)"
    assert tokens is not None and tokens["prompt_token_ids"] == CHAT["prompt_token_ids"][1:]


@pytest.mark.parametrize("dialect", ["chat", "completions"])
def test_real_vllm_answers_keep_every_invariant(dialect: str) -> None:
    name = "chat_completions" if dialect == "chat" else "completions"
    request = json.loads((VLLM_RECORDED / f"{name}.request.json").read_text())
    body = json.loads((VLLM_RECORDED / f"{name}.json").read_text())
    assert token_mismatch(request, body, dialect) is None


def test_several_choices_add_up_to_the_usage() -> None:
    ask = {"n": 2, "logprobs": True, "return_token_ids": True}
    assert token_mismatch(ask, BUILT_CHAT, "chat") is None
    body = copy.deepcopy(BUILT_CHAT)
    body["usage"]["completion_tokens"] += 1
    have = sum(len(c["token_ids"]) for c in BUILT_CHAT["choices"])
    assert token_mismatch(ask, body, "chat") == (
        f"output: {have} token ids for {have + 1} completion tokens (usage)"
    )


def test_several_prompts_count_each_prompt_once() -> None:
    # prompts [A, B], n=1: choice i answers prompt i; usage.prompt_tokens is both prompts
    body = copy.deepcopy(BUILT_COMPLETION)
    body["choices"][1]["prompt_token_ids"] = [2, 9]
    six = len(BUILT_COMPLETION["choices"][0]["prompt_token_ids"])
    body["usage"]["prompt_tokens"] = six + 2
    ask = {"prompt": [[1], [2]], "logprobs": 1, "return_token_ids": True}
    assert token_mismatch(ask, body, "completions") is None
    body["usage"]["prompt_tokens"] = six
    assert token_mismatch(ask, body, "completions") == (
        f"prompt: {six + 2} token ids for {six} prompt tokens (usage)"
    )


def test_log_probs_without_ids_count_against_the_usage() -> None:
    # OpenAI's shape: log-probs, no ids
    body = copy.deepcopy(CHAT)
    del body["choices"][0]["token_ids"], body["prompt_token_ids"]
    body["choices"][0]["logprobs"]["content"].pop()
    assert token_mismatch({"logprobs": True}, body, "chat") == (
        "output: 15 generated tokens (token ids, else log-probs) for 16 completion tokens (usage)"
    )


def test_a_choice_without_its_tokens_is_missing_not_a_mismatch() -> None:
    ask = {"n": 2, "logprobs": True, "return_token_ids": True}
    body = copy.deepcopy(BUILT_CHAT)
    del body["choices"][1]["token_ids"]
    body["choices"][1]["logprobs"] = None
    assert token_mismatch(ask, body, "chat") is None
    assert tokens_missing(ask, body, "chat") == (
        "token ids asked for (return_token_ids), none for choice 1; "
        "log-probs asked for (logprobs=true), none for choice 1"
    )


def test_odd_ids_are_named() -> None:
    body = copy.deepcopy(CHAT)
    body["choices"][0]["token_ids"][2] = "x"
    body["prompt_token_ids"][0] = -0.5
    found = extract_tokens(body)
    assert found is not None
    assert found["generations"][0]["token_ids"][2] is None
    assert found["prompt_token_ids"][0] is None
    assert token_mismatch({}, body, "chat") == (
        "prompt: 1 of 13 token ids not an id (written as null); "
        "generation 0: 1 of 16 token ids not an id (written as null)"
    )


# -- the pure pieces -----------------------------------------------------------------------------------


def test_token_id_reads_the_spellings_and_nothing_else() -> None:
    assert token_id(7) == 7 and token_id("token_id:236761") == 236761
    for odd in (
        True,
        None,
        1.0,
        -1,
        2**63,
        "7",
        "token_id:",
        "token_id:-1",
        "token_id:٣",
        "token_id:" + "9" * 5000,
    ):
        assert token_id(odd) is None, odd
    assert id_list(["token_id:1", 2, None]) == [1, 2, None]
    assert id_list(["a", "b"]) is None and id_list([]) == [] and id_list("x") is None
    assert spelled_ids(["a", "token_id:3"]) == [None, 3] and spelled_ids([1, "token_id:2"]) == [None, 2]
    assert spelled_ids(["7", "a"]) is None  # a token "7" is the text 7
    # log-prob entries: an entry's id, else its spelled token; odd entries null, the rest kept
    entries = [{"id": 5, "logprob": -1.0}, {"token": "token_id:6", "logprob": None}, 3, {"logprob": -2}]
    found = extract_tokens({"choices": [{"index": 0, "logprobs": {"content": entries}}]})
    assert found is not None
    assert found["generations"] == [
        {"index": 0, "token_ids": [5, 6, None, None], "log_probs": [-1.0, None, None, -2.0]}
    ]


def test_log_prob_is_a_finite_number_or_none() -> None:
    assert log_prob(-0.5) == -0.5 and log_prob(0) == 0.0
    for odd in (None, math.nan, math.inf, -math.inf, True, "-0.5", 10**400):
        assert log_prob(odd) is None, odd
    assert log_prob_list([math.nan, math.nan]) == [None, None]  # all NaN: kept, all null


def test_python_json_nan_and_infinity_are_read_strict_json_is_unchanged() -> None:
    assert loads_nonstandard('{"a": NaN, "b": -Infinity}') is not None
    assert loads_nonstandard('{"a": 1') is None and loads_nonstandard("{'NaN'}") is None
    parsed = parse_object(b'{"logprob": NaN, "x": Infinity, "big": 123456789012345678901234567890}')
    assert parsed is not None and math.isnan(parsed["logprob"]) and parsed["x"] == math.inf
    assert parsed["big"] == 1.2345678901234568e29  # as orjson reads it: a line can still be written
    assert encode_record_line({"response": parsed}) == (
        b'{"response":{"logprob":null,"x":null,"big":1.2345678901234568e+29}}\n'
    )


def test_openai_log_probs_keep_the_invariants_with_hidden_reasoning_and_tool_calls() -> None:
    # a real OpenAI stream with log-probs (recorded by openai-python): as many as its completion tokens
    raw = (
        RECORDED / "openai-python/chat_completions_sse/content_logprobs_events.83b060bae42e.sse"
    ).read_bytes()
    decoder, accumulator = SSEDecoder(), accumulator_for("chat")
    for event in decoder.feed(raw) + decoder.close():
        accumulator.add(event)
    answer = accumulator.result()
    assert answer is not None and answer["usage"]["completion_tokens"] == 2
    assert token_mismatch({"logprobs": True}, answer, "chat") is None
    # OpenAI's log-probs leave out the reasoning it does not show, and do not cover tool calls
    hidden = copy.deepcopy(answer)
    hidden["usage"]["completion_tokens"] = 10
    assert token_mismatch({"logprobs": True}, hidden, "chat") == (
        "output: 2 generated tokens (token ids, else log-probs) for 10 completion tokens (usage)"
    )
    hidden["usage"]["completion_tokens_details"] = {"reasoning_tokens": 8}
    assert token_mismatch({"logprobs": True}, hidden, "chat") is None
    tools = copy.deepcopy(answer)
    tools["usage"]["completion_tokens"] = 30
    tools["choices"][0]["message"]["tool_calls"] = [{"id": "c", "type": "function"}]
    assert token_mismatch({"logprobs": True}, tools, "chat") is None


def test_echo_with_token_id_tokens_keeps_the_output_ids() -> None:
    # echo and return_tokens_as_token_ids: the ids are the spelled tokens after the prompt's
    body = json.loads((CASES / "completions_echo.json").read_text())
    logprobs = body["choices"][0]["logprobs"]
    prompt_ids = COMPLETION["choices"][0]["prompt_token_ids"]
    output_ids = COMPLETION["choices"][0]["token_ids"]
    logprobs["tokens"] = [f"token_id:{i}" for i in prompt_ids + output_ids]
    found = extract_tokens(body)
    assert found is not None
    assert found["generations"] == [{"index": 0, "token_ids": output_ids, "log_probs": COMPLETION_LOG_PROBS}]
    assert token_mismatch({"echo": True, "logprobs": 2}, body, "completions") is None
