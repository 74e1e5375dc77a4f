"""Rollout health: per rollout a verdict a trainer can act on, from named checks over its captured calls.

The verdict is ``healthy``, ``unhealthy`` (a check of :data:`UNHEALTHY_CHECKS` fired) or ``unobserved``
(nothing was captured for it: no record, no lost call, no call in flight). Checks of :data:`REPORTED_CHECKS`
are listed with the verdict and never make it unhealthy. Each check's exact rule is in
``docs/attachment.md``, "Rollout health"; NeMo Gym's ``gym eval`` health checks are the model.

:func:`judge_rollout` is pure (records and the lost and in-flight calls in, the verdict out): the
attachment (:mod:`otel_capture._attach`) calls it on a frozen snapshot. :func:`rollout_health` and
:func:`health_summary` read capture directories as they are (nothing frozen, nothing changed), for
``otel-capture health`` and for a trainer that asks before attaching.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ._correlation import validate_rollout_id
from ._records import ModelCallRecord
from ._store import CaptureStore, read_available_model_call_records

__all__ = [
    "REPORTED_CHECKS",
    "UNHEALTHY_CHECKS",
    "RolloutEvidence",
    "health_summary",
    "judge_rollout",
    "rollout_health",
]

_logger = logging.getLogger(__name__)

Verdict = Literal["healthy", "unhealthy", "unobserved"]

UNHEALTHY_CHECKS = (
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
"""Checks that make a rollout unhealthy, in the order they are listed."""
REPORTED_CHECKS = ("weight_version_changed", "several_writers", "refused_calls", "context_overflow")
"""Checks reported with the verdict that never make a rollout unhealthy."""

_NAMED = 20  # calls a detail names before "and N more"
# An upstream's explicit rejection of a prompt over the model's context: OpenAI's error code, vLLM's and
# SGLang's "maximum context length", Anthropic's "prompt is too long", llama.cpp's "context size".
_CONTEXT_OVERFLOW = re.compile(
    r"context_length_exceeded|maximum context length|context length|context window|context size"
    r"|prompt is too long",
    re.IGNORECASE,
)
# The request's own limit on generated tokens, by the key each dialect spells it with.
_LIMIT_KEYS = ("max_completion_tokens", "max_tokens", "max_output_tokens", "max_new_tokens")
_LENGTH_STOPS = frozenset({"length", "max_tokens", "max_output_tokens"})


@dataclass(frozen=True)
class RolloutEvidence:
    """What a rollout's verdict is judged from: its records (every directory's), the calls a marker or a
    loss reserve names as not captured (``(model_call_id, reason)``), and the calls in flight."""

    rollout_id: str
    records: Sequence[ModelCallRecord] = ()
    lost: Sequence[tuple[str, str]] = ()
    in_flight: Sequence[str] = ()
    notes: list[str] = field(default_factory=list)  # directories that could not be read


def _check(name: str, calls: Iterable[str | None], detail: str) -> dict[str, Any]:
    return {"name": name, "calls": [c for c in calls if c], "detail": detail}


def _some(items: Sequence[str]) -> str:
    more = f"; and {len(items) - _NAMED} more" if len(items) > _NAMED else ""
    return "; ".join(items[:_NAMED]) + more


def _model_of(record: ModelCallRecord) -> str:
    if record.model:
        return record.model
    model = record.request.get("model") if record.request else None
    return model if isinstance(model, str) else ""


def _error_text(record: ModelCallRecord) -> str:
    parts: list[str] = []
    response = record.response or {}
    for key in ("error", "message", "detail"):
        value = response.get(key)
        if isinstance(value, dict):
            parts.extend(str(value.get(k, "")) for k in ("code", "type", "message"))
        elif isinstance(value, str):
            parts.append(value)
    if record.response_raw:
        parts.append(record.response_raw[:4000])
    return " ".join(parts)


def context_overflow(record: ModelCallRecord) -> bool:
    """The upstream rejected the call because the prompt does not fit the model's context: a 4xx answer
    (not a local one) whose error names the context length (:data:`_CONTEXT_OVERFLOW`)."""
    status = record.status_code
    if status is None or not 400 <= status < 500 or record.response_source == "local":
        return False
    return bool(_CONTEXT_OVERFLOW.search(_error_text(record)))


def _token_limit(record: ModelCallRecord) -> int | None:
    request = record.request or {}
    for key in _LIMIT_KEYS:
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    options = request.get("sampling_params")  # SGLang's /generate
    if isinstance(options, dict):
        value = options.get("max_new_tokens")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _runaway(record: ModelCallRecord) -> bool:
    if record.failed or record.finish_reason not in _LENGTH_STOPS:
        return False
    limit = _token_limit(record)
    if limit is None:
        return False  # stopped by the context, not by a limit the request set
    return record.tokens_out is None or record.tokens_out >= limit


def _last_call_failed(records: Sequence[ModelCallRecord]) -> dict[str, Any] | None:
    last: dict[str, ModelCallRecord] = {}
    order = sorted(
        enumerate(records),
        key=lambda pair: (pair[1].started_at if pair[1].started_at is not None else float("inf"), pair[0]),
    )
    for _, record in order:
        if not context_overflow(record):  # kept apart: a full context is not a failed call
            last[_model_of(record)] = record
    failed = [r for r in last.values() if r.failed]
    if not failed:
        return None
    details = [
        f"{r.model_call_id}: {_model_of(r) or 'model unknown'}, status {r.status_code}"
        + (f", {r.error_category}" if r.error_category else "")
        + (" (refused for capacity)" if r.refused else "")
        for r in failed
    ]
    return _check("last_call_failed", (r.model_call_id for r in failed), _some(details))


def _writer_key(writer: Mapping[str, Any]) -> tuple[str, ...]:
    """The model server a writer stands for: the upstream a proxy forwards to (one server behind any
    number of proxy workers), else the process the capture runs in."""
    host = str(writer.get("host"))
    if writer.get("layer") == "proxy":
        return (host, "proxy", str(writer.get("upstream")))
    return (host, "in_process", str(writer.get("pid")))


def _describe_writer(key: tuple[str, ...]) -> str:
    host, layer, what = key
    return f"{host} proxy to {what}" if layer == "proxy" else f"{host} pid {what} (in process)"


def _calls_where(
    records: Sequence[ModelCallRecord], name: str, rule: Any, what: str
) -> dict[str, Any] | None:
    hits = [r for r in records if rule(r)]
    if not hits:
        return None
    return _check(name, (r.model_call_id for r in hits), f"{len(hits)} call(s) {what}")


def _answer_key(record: ModelCallRecord) -> tuple[str, str] | None:
    """One upstream answer: the upstream's request id, scoped to the upstream that gave it (two servers
    may count their requests alike)."""
    if not record.upstream_request_id:
        return None
    upstream = (record.writer or {}).get("upstream")
    return (str(upstream), record.upstream_request_id)


def _duplicates(records: Sequence[ModelCallRecord]) -> dict[str, Any] | None:
    ids = Counter(r.model_call_id for r in records if r.model_call_id)
    answers = Counter(key for key in map(_answer_key, records) if key is not None)
    twice = [mcid for mcid, n in ids.items() if n > 1]
    replayed = {key for key, n in answers.items() if n > 1}
    if not (twice or replayed):
        return None
    calls = list(twice)
    calls += [r.model_call_id for r in records if _answer_key(r) in replayed and r.model_call_id]
    details = [f"model_call_id {mcid} recorded {ids[mcid]} times" for mcid in twice]
    details += [f"upstream request {rid} ({up}) recorded {answers[up, rid]} times" for up, rid in replayed]
    return _check("duplicate_call", dict.fromkeys(calls), _some(details))


def _record_checks(records: Sequence[ModelCallRecord]) -> list[dict[str, Any]]:
    answered = [r for r in records if r.status_code is not None and not r.failed]
    found = [
        _last_call_failed(records),
        _calls_where(answered, "zero_completion_tokens", lambda r: r.tokens_out == 0, "answered 0 tokens"),
        _calls_where(
            records, "runaway_generation", _runaway, "stopped by the length limit at the request's own limit"
        ),
        _calls_where(
            answered,
            "usage_missing",
            lambda r: r.tokens_in is None or r.tokens_out is None,
            "answered without usage (prompt or completion tokens unknown)",
        ),
    ]
    mismatched = [r for r in records if r.token_mismatch]
    if mismatched:
        details = [f"{r.model_call_id}: {r.token_mismatch}" for r in mismatched]
        found.append(_check("token_mismatch", (r.model_call_id for r in mismatched), _some(details)))
    missing = [r for r in records if r.tokens_missing]
    if missing:
        details = [f"{r.model_call_id}: {r.tokens_missing}" for r in missing]
        found.append(_check("tokens_missing", (r.model_call_id for r in missing), _some(details)))
    found.append(_duplicates(records))
    return [check for check in found if check is not None]


def _reported_checks(records: Sequence[ModelCallRecord]) -> list[dict[str, Any]]:
    found = [
        _calls_where(
            records,
            "weight_version_changed",
            lambda r: r.weight_version_at_end is not None,
            "ran across a weight update",
        )
    ]
    writers: dict[tuple[str, ...], ModelCallRecord] = {}
    for record in records:
        if record.writer:
            writers.setdefault(_writer_key(record.writer), record)
    if len(writers) > 1:
        described = "; ".join(_describe_writer(key) for key in writers)
        firsts = (r.model_call_id for r in writers.values())
        found.append(_check("several_writers", firsts, f"{len(writers)} model servers: {described}"))
    refused = [r for r in records if r.refused]
    if refused:
        later = sum(1 for r in records if not r.refused)
        detail = f"{len(refused)} call(s) refused for capacity (503, Retry-After); {later} other call(s)"
        found.append(_check("refused_calls", (r.model_call_id for r in refused), detail))
    found.append(
        _calls_where(
            records, "context_overflow", context_overflow, "rejected: the prompt is over the context"
        )
    )
    return [check for check in found if check is not None]


def judge_rollout(evidence: RolloutEvidence) -> dict[str, Any]:
    """``{"verdict", "checks": [{"name", "calls", "detail"}]}`` for one rollout: the checks that fired,
    unhealthy ones first (:data:`UNHEALTHY_CHECKS` order), then the reported ones."""
    records = list(evidence.records)
    checks = _record_checks(records)
    if evidence.lost:
        lost = [f"{mcid or '?'}: {reason}" for mcid, reason in evidence.lost]
        checks.append(_check("lost_calls", (mcid for mcid, _ in evidence.lost), _some(lost)))
    if evidence.in_flight:
        detail = f"{len(evidence.in_flight)} call(s) begun and not recorded"
        checks.append(_check("in_flight", evidence.in_flight, detail))
    checks.sort(key=lambda check: UNHEALTHY_CHECKS.index(check["name"]))
    checks += _reported_checks(records)
    verdict: Verdict
    if not (records or evidence.lost or evidence.in_flight):
        verdict = "unobserved"
    elif any(check["name"] in UNHEALTHY_CHECKS for check in checks):
        verdict = "unhealthy"
    else:
        verdict = "healthy"
    return {"verdict": verdict, "checks": checks}


def _as_stores(stores: Any) -> list[CaptureStore]:
    if isinstance(stores, (CaptureStore, str, os.PathLike)):
        stores = [stores]
    return [s if isinstance(s, CaptureStore) else CaptureStore(s) for s in stores]


def _evidence(stores: Sequence[CaptureStore], rollout_id: str) -> RolloutEvidence:
    records: list[ModelCallRecord] = []
    lost: list[tuple[str, str]] = []
    in_flight: dict[str, None] = {}
    notes: list[str] = []
    for store in stores:
        try:
            available = read_available_model_call_records(store, rollout_id)
            records.extend(available.records)
            if available.incomplete:
                lost.extend((c.model_call_id, c.reason) for c in store.incomplete_calls(rollout_id))
            in_flight.update(dict.fromkeys(store.calls_in_flight(rollout_id)))
        except Exception as exc:  # one unreadable directory is a note, never a crash
            _logger.warning("cannot read rollout %s in %s: %s", rollout_id, store.root, exc)
            notes.append(f"{store.root}: {type(exc).__name__}: {exc}")
    return RolloutEvidence(rollout_id, records, lost, list(in_flight), notes)


def rollout_health(
    stores: CaptureStore | str | os.PathLike[str] | Iterable[CaptureStore | str | os.PathLike[str]],
    rollout_id: str,
) -> dict[str, Any]:
    """The health of one rollout, read from every directory as it is now (:func:`judge_rollout`)."""
    validate_rollout_id(rollout_id)
    return judge_rollout(_evidence(_as_stores(stores), rollout_id))


def health_summary(
    stores: CaptureStore | str | os.PathLike[str] | Iterable[CaptureStore | str | os.PathLike[str]],
    rollout_ids: Iterable[str] | None = None,
) -> dict[str, Any]:
    """``{"checked", "healthy", "unhealthy", "unobserved", "rollouts": {id: verdict}}`` for ``rollout_ids``
    (each validated), or for every rollout with captures in any directory (retired ones left out)."""
    targets = _as_stores(stores)
    if rollout_ids is None:
        found: set[str] = set()
        for store in targets:
            if store.root.is_dir():
                found.update(rid for rid, state in store.list_rollouts().items() if state != "retired")
        ids = sorted(found)
    else:
        ids = list(dict.fromkeys(validate_rollout_id(rid) for rid in rollout_ids))
    rollouts = {rid: rollout_health(targets, rid) for rid in ids}
    counts = Counter(result["verdict"] for result in rollouts.values())
    return {
        "checked": len(rollouts),
        "healthy": counts["healthy"],
        "unhealthy": counts["unhealthy"],
        "unobserved": counts["unobserved"],
        "rollouts": rollouts,
    }
