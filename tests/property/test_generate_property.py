"""The generate dialect's reassembly, tokens and record facts never raise on what a server could send:
chunks of vLLM's and SGLang's keys with values of any JSON type, and any cut of a real-shaped stream."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_capture._dialects.derive import derive_call_facts
from otel_capture._dialects.reassembly import accumulator_for
from otel_capture._dialects.sse import SSEEvent
from otel_capture._dialects.table import DIALECTS
from otel_capture._dialects.tokens import extract_tokens

_KEYS = [
    "request_id", "model", "usage", "prompt_token_ids", "output_mode", "choices", "index", "finish_reason",
    "stop_reason", "token_ids", "logprobs", "content", "logprob", "token_id", "text", "sampling_mask",
    "weight_versions", "error", "output_ids", "meta_info", "completion_tokens", "prompt_tokens",
    "output_token_logprobs", "output_top_logprobs", "cached_tokens", "id", "type",
]  # fmt: skip
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.floats(allow_nan=False),
    st.text(max_size=4),
)
_json: Any = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.sampled_from(_KEYS), children, max_size=6)
    ),
    max_leaves=30,
)
_payloads = st.dictionaries(st.sampled_from(_KEYS), _json, max_size=8)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(payloads=st.lists(st.tuples(st.sampled_from([None, "error"]), _payloads), max_size=20))
def test_generate_garbage_never_raises(payloads: list[tuple[str | None, dict[str, Any]]]) -> None:
    accumulator = accumulator_for("generate")
    for name, payload in payloads:
        assert accumulator.add(SSEEvent(name, orjson.dumps(payload).decode())) in (True, False)
    accumulator.add(SSEEvent(None, "[DONE]"))
    result = accumulator.result()
    assert accumulator.internal_errors == 0
    assert result is None or isinstance(orjson.dumps(result), bytes)
    for body in [result, *(payload for _, payload in payloads)]:
        if isinstance(body, dict):
            extract_tokens(body, {"token_ids": [1, 2], "input_ids": body.get("token_ids")})
            DIALECTS["generate"].finish_reasons(body)
            DIALECTS["generate"].output_messages(body)


@given(response=_payloads, request=_payloads)
def test_generate_facts_never_raise_beyond_gyms_own(
    response: dict[str, Any], request: dict[str, Any]
) -> None:
    """Gym's rules may raise on shapes Gym trips over (then the line is damaged for Gym too); the generate
    additions raise on nothing that Gym's rules accept."""
    try:
        derive_call_facts(response, request)
    except (TypeError, AttributeError):
        return
    derive_call_facts(response, request, "generate")
