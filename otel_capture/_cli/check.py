"""``otel-capture check DIR``: verify a capture directory and say what is damaged: the answer first, in
plain words (:func:`check_answer`), then one line per problem.

Damage is a line that is not a valid record, a torn tail (contract D7), or an entry named like a rollout's
file that is not a regular file of its own (skipped, never followed or waited on) (contract D25). An
incomplete marker is not damage, it is a capture failure recorded as it should be: it is reported, and
fails the check only with ``strict``.

A loss that is *not yet* in its rollout's marker fails the check (contract D14): the check is a separate
process, so it reads every writer's loss reserve on disk and names each loss still pending there.

Model calls served without a rollout id (never recorded) are reported too: the serving processes count
them in the directory (:mod:`otel_capture._store.uncorrelated`); they fail the check only with ``strict``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .._records import InvalidLine
from .._settings import WriterSettings
from .._store import (
    CAPTURE_SUFFIX,
    INCOMPLETE_SUFFIX,
    LIBC_SYNCFS,
    TOKENS_SUFFIX,
    CaptureStore,
    Loss,
    choose_sync,
    pending_losses,
    read_available_model_call_records,
    read_uncorrelated,
)
from .show import torn_tail


@dataclass
class RolloutCheck:
    rollout_id: str
    records: int = 0
    invalid: list[InvalidLine] = field(default_factory=list)
    torn_tail: InvalidLine | None = None
    torn_bytes: int | None = None
    """The torn tail's size in bytes, as ``show`` reports it (``None`` when it could not be measured)."""
    incomplete: bool = False
    error: str | None = None
    entries: list[tuple[str, str]] = field(default_factory=list)
    """``(file name, what it is)`` of this rollout's entries that are not regular files of their own."""
    unreported: list[Loss] = field(default_factory=list)
    """Losses in a writer's loss reserve that the rollout's marker does not have yet."""
    tokens_missing: list[tuple[int, str]] = field(default_factory=list)
    """``(call_index, reason)`` of the calls answered without the token ids or log-probs they asked for:
    not damage (the records are sound), but not trainable as asked (``docs/tokens.md``)."""

    @property
    def damaged(self) -> bool:
        return (
            bool(self.invalid)
            or self.torn_tail is not None
            or self.error is not None
            or bool(self.entries)
            or bool(self.unreported)
        )


def check_capture_dir(store: CaptureStore) -> list[RolloutCheck]:
    """One report per rollout in the directory. Never raises for a damaged file: it reports it."""
    damaged: dict[str, list[tuple[str, str]]] = {}
    for name, what in store.damaged_entries():
        damaged.setdefault(_rollout_of(name), []).append((name, what))
    readable = set(store.rollout_ids())
    unreported: dict[str, list[Loss]] = {}
    for loss in pending_losses(store.root):
        unreported.setdefault(loss.rollout_id, []).append(loss)
    results = []
    for rollout_id in sorted(readable | set(damaged) | set(unreported)):
        result = RolloutCheck(
            rollout_id, entries=damaged.get(rollout_id, []), unreported=unreported.get(rollout_id, [])
        )
        results.append(result)
        if rollout_id not in readable:
            result.incomplete = bool(result.unreported)
            continue
        try:
            available = read_available_model_call_records(store, rollout_id)
        except (OSError, ValueError) as exc:  # unreadable file, or a file name that is not a valid id
            result.error = f"{type(exc).__name__}: {exc}"
        else:
            result.records = len(available.records)
            result.invalid = list(available.invalid)
            result.torn_tail = available.torn_tail_line
            if result.torn_tail is not None:  # rare: measured as show measures it
                measured = torn_tail(store, rollout_id)
                result.torn_bytes = measured.size if measured is not None else None
            result.incomplete = available.incomplete
            result.tokens_missing = [
                (r.call_index, r.tokens_missing) for r in available.records if r.tokens_missing is not None
            ]
    return results


def _rollout_of(name: str) -> str:
    for suffix in (CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def format_check(results: list[RolloutCheck]) -> list[str]:
    """Human-readable lines: one per problem, then a summary line."""
    lines = []
    for result in results:
        for bad in result.invalid:
            lines.append(f"{result.rollout_id}: line {bad.line_number}: damaged: {bad.reason}")
        if result.torn_tail is not None:
            lines.append(
                f"{result.rollout_id}: line {result.torn_tail.line_number}: torn tail{_size(result.torn_bytes)} "
                "(a writer died mid-write)"
            )
        if result.error is not None:
            lines.append(f"{result.rollout_id}: unreadable: {result.error}")
        for name, what in result.entries:
            consequence = "read, never appended to" if what.startswith("a regular file") else "skipped"
            lines.append(f"{result.rollout_id}: {name}: {what}: {consequence}")
        name = result.rollout_id or "(rollout unknown)"
        for loss in result.unreported:
            lines.append(f"{name}: lost, not yet in the incomplete marker: {loss.describe()}")
        if result.incomplete:
            lines.append(
                f"{result.rollout_id}: incomplete: at least one call was not captured (see the .capture.incomplete marker)"
            )
        for call_index, reason in result.tokens_missing:
            lines.append(f"{result.rollout_id}: call {call_index}: tokens missing: {reason}")
    damaged = sum(r.damaged for r in results)
    incomplete = sum(r.incomplete for r in results)
    records = sum(r.records for r in results)
    summary = f"{len(results)} rollout(s), {records} record(s); {damaged} damaged, {incomplete} incomplete"
    without_tokens = sum(bool(r.tokens_missing) for r in results)
    if without_tokens:
        summary += f"; {without_tokens} with calls missing the tokens they asked for"
    lines.append(summary)
    return lines


def _size(size: int | None) -> str:
    return "" if size is None else f", {size} bytes with no newline"


def sync_report(directory: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> str:
    """The sync a writer started now on ``directory`` would use, and why (the filesystem's type, or
    ``OTEL_CAPTURE_SYNC``) (contract D4)."""
    sync = WriterSettings.from_environ(environ, directory=directory).sync  # the settings' one reading
    allowed = sync != "fsync" and LIBC_SYNCFS is not None
    return choose_sync(Path(directory), syncfs_allowed=allowed).describe()


def uncorrelated_line(store: CaptureStore) -> str | None:
    """The line that says how many model calls were served without a rollout id, or ``None``: none were."""
    summary = read_uncorrelated(store.root)
    return summary.describe() if summary.calls else None


def _names(rollout_ids: list[str], shown: int = 5) -> str:
    listed = ", ".join(rid or "(rollout unknown)" for rid in rollout_ids[:shown])
    return listed + (f" and {len(rollout_ids) - shown} more" if len(rollout_ids) > shown else "")


def _damage_kinds(damaged: list[RolloutCheck]) -> str:
    kinds = [
        (any(r.invalid for r in damaged), "lines that are not records"),
        (any(r.torn_tail is not None for r in damaged), "a torn last line (a writer died mid-write)"),
        (any(r.error is not None for r in damaged), "a file that cannot be read"),
        (any(r.entries for r in damaged), "an entry that is not a regular file of its own"),
        (any(r.unreported for r in damaged), "lost calls not yet marked (a full filesystem?)"),
    ]
    return ", ".join(what for present, what in kinds if present)


def check_answer(results: list[RolloutCheck], uncorrelated: str | None, *, strict: bool) -> str:
    """The first line ``check`` prints: the answer in plain words, ``ok: ...`` or ``NOT OK: ...`` (what is
    wrong, in which rollouts), as the exit status says it; the details follow it."""
    damaged = [r for r in results if r.damaged]
    incomplete = [r.rollout_id for r in results if r.incomplete]
    without_tokens = [r.rollout_id for r in results if r.tokens_missing]
    records = sum(r.records for r in results)
    notes = []
    if incomplete:
        notes.append(f"{len(incomplete)} rollout(s) incomplete, a call not captured ({_names(incomplete)})")
    if without_tokens:
        notes.append(
            f"{len(without_tokens)} rollout(s) with calls missing the token ids or log-probs they asked for "
            f"({_names(without_tokens)})"
        )
    if uncorrelated is not None:
        notes.append("model calls served without a rollout id, not recorded")
    if damaged:
        names = _names([r.rollout_id for r in damaged])
        answer = (
            f"NOT OK: {len(damaged)} of {len(results)} rollout(s) damaged ({names}): {_damage_kinds(damaged)}"
        )
        return "; ".join([answer, *notes]) + "; details below"
    if strict and (incomplete or uncorrelated is not None):
        return "NOT OK (--strict): " + "; ".join(notes) + "; details below"
    answer = f"ok: {len(results)} rollout(s), {records} record(s), nothing damaged"
    return answer + (f"; but {'; '.join(notes)}; details below" if notes else "")
