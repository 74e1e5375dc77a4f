"""Properties of the token integrity rules (``docs/tokens.md``, "Odd entries" and "Token integrity"): whatever
an answer's token lists hold, the tokens line is strict JSON with one entry per entry sent (odd ones
``null``), and reading them, checking them and judging what is missing never raise."""

from __future__ import annotations

import math
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_capture._dialects.mismatch import token_mismatch
from otel_capture._dialects.missing import tokens_missing
from otel_capture._dialects.tokens import extract_tokens
from otel_capture._records import tokens_line

_ENTRY = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.booleans(),
    st.text(max_size=12),
    st.sampled_from(["token_id:7", "token_id:", "token_id:-3", "token_id:٣", "token_id:" + "9" * 30]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_USAGE = st.one_of(
    st.none(),
    st.fixed_dictionaries({"prompt_tokens": _ENTRY, "completion_tokens": _ENTRY}),
)


@st.composite
def _chat_answer(draw: st.DrawFn) -> dict[str, Any]:
    choices = []
    for index in range(draw(st.integers(min_value=0, max_value=3))):
        content = [
            draw(st.one_of(st.fixed_dictionaries({"token": _ENTRY, "logprob": _ENTRY, "id": _ENTRY}), _ENTRY))
            for _ in range(draw(st.integers(min_value=0, max_value=6)))
        ]
        choice: dict[str, Any] = {"index": draw(st.one_of(st.just(index), _ENTRY, st.just(2**70)))}
        if draw(st.booleans()):
            choice["token_ids"] = draw(st.lists(_ENTRY, max_size=6))
        if draw(st.booleans()):
            choice["logprobs"] = {"content": content}
        else:
            choice["logprobs"] = {"token_logprobs": draw(st.lists(_ENTRY, max_size=6)), "tokens": content}
        choices.append(choice)
    return {
        "choices": choices,
        "prompt_token_ids": draw(st.one_of(st.none(), st.lists(_ENTRY, max_size=5))),
        "usage": draw(_USAGE),
    }


_REQUEST = st.fixed_dictionaries(
    {},
    optional={
        "n": _ENTRY,
        "best_of": _ENTRY,
        "echo": _ENTRY,
        "logprobs": _ENTRY,
        "return_token_ids": _ENTRY,
        "top_logprobs": _ENTRY,
    },
)


@given(_chat_answer(), _REQUEST, st.sampled_from(["chat", "completions", "responses"]))
def test_any_token_lists_give_a_strict_json_line_and_no_error(
    answer: dict[str, Any], request: dict[str, Any], dialect: str
) -> None:
    found = extract_tokens(answer)
    tokens_missing(request, answer, dialect)
    mismatch = token_mismatch(request, answer, dialect)
    raw = tokens_line(answer, rollout_id="r", model_call_id="c")
    if found is None:
        assert raw is None
        return
    assert raw is not None
    line = orjson.loads(raw)  # strict JSON: no NaN, no Infinity
    for generation in line["generations"]:
        for value in generation["log_probs"] or []:
            assert value is None or math.isfinite(value)
        for value in generation["token_ids"] or []:
            assert value is None or (isinstance(value, int) and not isinstance(value, bool))
    nulls = any(
        None in (generation[key] or [])
        for generation in line["generations"]
        for key in ("token_ids", "log_probs")
    ) or None in (line["prompt_token_ids"] or [])
    if nulls:
        assert mismatch is not None and "(written as null)" in mismatch  # every odd entry is said


# Where an answer may carry tokens (each read by some shape of extract_tokens), and a value for it: with tokens,
# null, or odd. "none": an answer of neutral keys only, the usual answer the quick look lets go unread.
_PLACES = st.sampled_from(
    [
        "none",
        "prompt_token_ids",
        "output",
        "meta_info",
        "choice.token_ids",
        "choice.prompt_token_ids",
        "choice.logprobs",
        "choice.legacy",
        "choice.odd",
    ]
)
_CARRIED = {
    "prompt_token_ids": st.one_of(st.none(), st.lists(_ENTRY, max_size=3)),
    "output": st.one_of(
        st.none(),
        st.just([{"type": "message", "content": [{"logprobs": [{"token": "a", "logprob": -1.0}]}]}]),
        st.just([{"generation_token_ids": [1, 2], "generation_log_probs": [-0.1, -0.2]}]),
    ),
    "meta_info": st.one_of(st.none(), st.just({"output_token_logprobs": [[-0.5, 7, None]]})),
    "choice.token_ids": st.one_of(st.none(), st.lists(_ENTRY, max_size=3)),
    "choice.prompt_token_ids": st.one_of(st.none(), st.lists(_ENTRY, max_size=3)),
    "choice.logprobs": st.one_of(
        st.none(), st.just({"content": [{"token": "a", "logprob": -0.5, "id": 3}]}), _ENTRY
    ),
    "choice.legacy": st.just({"token_logprobs": [None, -0.5], "tokens": ["token_id:4", "token_id:5"]}),
    "choice.odd": _ENTRY,
}


@st.composite
def _any_answer(draw: st.DrawFn) -> dict[str, Any]:
    """An answer of neutral keys (a model, a usage, a text, choices with a message), with tokens, or a null
    or odd value, in at most one of the places a shape reads them from."""
    answer: dict[str, Any] = {"model": "m", "usage": draw(_USAGE)}
    if draw(st.booleans()):
        answer["choices"] = [
            {"index": i, "message": {"role": "assistant", "content": "x"}}
            for i in range(draw(st.integers(min_value=0, max_value=2)))
        ]
    place = draw(_PLACES)
    if place == "none":
        return answer
    value = draw(_CARRIED[place])
    if not place.startswith("choice."):
        answer[place] = value
        if place == "meta_info":
            answer["output_ids"] = [7]
        return answer
    choices = answer.setdefault("choices", [])
    if place == "choice.odd":  # a choice that is not an object
        choices.append(value)
        return answer
    choice: dict[str, Any] = {"index": len(choices)}
    choice[place.removeprefix("choice.").replace("legacy", "logprobs")] = value
    choices.append(choice)
    return answer


@settings(max_examples=300)
@given(_any_answer(), _REQUEST, st.sampled_from(["chat", "completions", "responses", "generate"]))
def test_an_answer_skipped_unread_has_no_tokens(
    answer: dict[str, Any], request: dict[str, Any], dialect: str
) -> None:
    """The quick look that lets most answers go unread (no key any shape reads tokens from) never hides
    tokens, nor a missing or mismatched token, that reading the whole answer finds."""
    from otel_capture._dialects import tokens as module

    quick = (extract_tokens(answer), tokens_missing(request, answer, dialect))
    original = module._carries_none
    module._carries_none = lambda response: False  # every answer read in full
    try:
        full = (extract_tokens(answer), tokens_missing(request, answer, dialect))
    finally:
        module._carries_none = original
    assert quick == full
