"""The verdict's rules on records made in the test (``judge_rollout`` is pure): the edges each check's rule
in docs/attachment.md draws. The checks firing from real calls are tests/integration/test_health_through_proxy.py."""

from __future__ import annotations

from typing import Any

from otel_capture._health import REPORTED_CHECKS, UNHEALTHY_CHECKS, RolloutEvidence, judge_rollout
from otel_capture._records import ModelCallRecord

ANSWER = {"choices": [{"message": {"content": "hi"}}]}


def record(n: int, **fields: Any) -> ModelCallRecord:
    values: dict[str, Any] = {
        "model_call_id": f"c{n}",
        "call_index": n,
        "model": "m",
        "status_code": 200,
        "started_at": 100.0 + n,
        "tokens_in": 5,
        "tokens_out": 3,
        "finish_reason": "stop",
        **fields,
    }
    return ModelCallRecord(**values)


def judged(*records: ModelCallRecord, **evidence: Any) -> dict[str, Any]:
    return judge_rollout(RolloutEvidence("r", records, **evidence))


def names(result: dict[str, Any]) -> list[str]:
    return [check["name"] for check in result["checks"]]


def test_the_check_names_are_the_issues() -> None:
    assert UNHEALTHY_CHECKS == (
        "last_call_failed",
        "zero_completion_tokens",
        "runaway_generation",
        "usage_missing",
        "token_mismatch",
        "tokens_missing",
        "lost_calls",
        "in_flight",
        "duplicate_call",
    )
    assert REPORTED_CHECKS == (
        "weight_version_changed",
        "several_writers",
        "refused_calls",
        "context_overflow",
    )


def test_nothing_captured_is_unobserved_and_a_lost_call_alone_is_not() -> None:
    assert judged() == {"verdict": "unobserved", "checks": []}
    lost = judged(lost=[("c9", "capture_error: disk full")])
    assert lost["verdict"] == "unhealthy" and lost["checks"][0]["calls"] == ["c9"]
    assert judged(in_flight=["c7"])["verdict"] == "unhealthy"


def test_the_last_call_is_judged_per_model_in_start_order() -> None:
    failed_then_retried = judged(record(0, status_code=500), record(1))
    assert failed_then_retried == {"verdict": "healthy", "checks": []}
    # a later call to another model does not hide the policy's failed last call
    judge_last = judged(record(0), record(1, status_code=500, model="policy"), record(2, model="judge"))
    assert names(judge_last) == ["last_call_failed"] and judge_last["checks"][0]["calls"] == ["c1"]
    # written in another order than they started: the start time decides
    late_line = judged(record(1, started_at=105.0), record(0, status_code=500, started_at=101.0))
    assert late_line["verdict"] == "healthy"


def test_runaway_needs_the_requests_own_limit() -> None:
    at_limit = record(0, finish_reason="length", tokens_out=16, request={"max_tokens": 16})
    assert names(judged(at_limit)) == ["runaway_generation"]
    responses = record(0, finish_reason="length", tokens_out=None, request={"max_output_tokens": 64})
    assert "runaway_generation" in names(judged(responses))
    no_limit = record(0, finish_reason="length", tokens_out=4000, request={"messages": []})
    assert judged(no_limit)["verdict"] == "healthy"  # the context ran out, not a limit the request set
    under = record(0, finish_reason="length", tokens_out=10, request={"max_tokens": 16})
    assert judged(under)["verdict"] == "healthy"


def test_usage_and_zero_tokens_are_judged_on_answered_calls_only() -> None:
    assert names(judged(record(0, tokens_in=None, tokens_out=None))) == ["usage_missing"]
    assert names(judged(record(0, tokens_out=0))) == ["zero_completion_tokens"]
    failed = record(0, status_code=502, tokens_in=None, tokens_out=None)
    assert names(judged(failed)) == ["last_call_failed"]  # a failed call has no usage to miss


def test_context_overflow_is_kept_apart_and_recognised_by_the_upstreams_words() -> None:
    anthropic = {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long"}}
    openai = {"error": {"code": "context_length_exceeded", "message": "This model's maximum..."}}
    for body in (anthropic, openai):
        result = judged(record(0), record(1, status_code=400, response=body))
        assert result["verdict"] == "healthy" and names(result) == ["context_overflow"]
    other_400 = judged(record(0), record(1, status_code=400, response={"error": {"message": "bad role"}}))
    assert names(other_400) == ["last_call_failed"]
    local = record(
        1, status_code=413, response={"error": {"message": "context length"}}, response_source="local"
    )
    assert names(judged(record(0), local)) == ["last_call_failed"]  # the proxy's own answer is no overflow


def test_writers_proxy_workers_are_one_server_in_process_servers_are_processes() -> None:
    def by(host: str, pid: int, upstream: str | None) -> dict[str, Any]:
        if upstream is None:
            return {"host": host, "pid": pid, "layer": "in_process"}
        return {"host": host, "pid": pid, "layer": "proxy", "upstream": upstream}

    workers = judged(
        record(0, writer=by("a", 1, "http://v:8000")), record(1, writer=by("a", 2, "http://v:8000"))
    )
    assert workers["checks"] == []
    spread = judged(record(0, writer=by("a", 1, None)), record(1, writer=by("b", 1, None)), record(2))
    assert spread["verdict"] == "healthy" and names(spread) == ["several_writers"]
    assert spread["checks"][0]["calls"] == ["c0", "c1"]


def test_duplicates_by_call_id_or_by_one_upstream_answer() -> None:
    assert names(judged(record(0), record(0))) == ["duplicate_call"]
    proxy = {"host": "a", "pid": 1, "layer": "proxy", "upstream": "http://v"}
    other = {**proxy, "upstream": "http://w"}
    same = judged(
        record(0, writer=proxy, upstream_request_id="x"), record(1, writer=proxy, upstream_request_id="x")
    )
    assert names(same) == ["duplicate_call"] and same["checks"][0]["calls"] == ["c0", "c1"]
    apart = judged(
        record(0, writer=proxy, upstream_request_id="x"), record(1, writer=other, upstream_request_id="x")
    )
    assert apart["verdict"] == "healthy"  # two upstreams may number their requests alike


def test_refused_calls_are_reported_and_a_rollout_ending_on_one_failed() -> None:
    refused = {"status_code": 503, "response_source": "local", "local_response_reason": "proxy_over_capacity"}
    retried = judged(record(0, **refused), record(1))
    assert retried["verdict"] == "healthy" and names(retried) == ["refused_calls"]
    gave_up = judged(record(0), record(1, **refused))
    assert gave_up["verdict"] == "unhealthy" and names(gave_up) == ["last_call_failed", "refused_calls"]


def test_unhealthy_checks_come_first_in_their_order_then_the_reported_ones() -> None:
    result = judged(
        record(0, tokens_missing="logprobs asked, none in the answer", weight_version_at_end="8"),
        record(1, tokens_out=0, token_mismatch="3 ids, usage 2"),
        lost=[("c5", "lost")],
    )
    assert names(result) == [
        "zero_completion_tokens",
        "token_mismatch",
        "tokens_missing",
        "lost_calls",
        "weight_version_changed",
    ]
