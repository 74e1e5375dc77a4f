"""Properties of the token integrity rules (``docs/tokens.md``, "Odd entries" and "Token integrity"): whatever
an answer's token lists hold, the tokens line is strict JSON with one entry per entry sent (odd ones
``null``), and reading them, checking them and judging what is missing never raise."""

from __future__ import annotations

import math
from typing import Any

import orjson
from hypothesis import given
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
