"""``otel-capture check DIR``: verify a capture directory and say what is damaged: the answer first, in
plain words (:func:`check_answer`), then one line per problem.

Damage is a line that is not a valid record, a torn tail (contract D7), or an entry named like a rollout's
file that is not a regular file of its own (skipped, never followed or waited on) (contract D25). An
incomplete marker is not damage, it is a capture failure recorded as it should be: it is reported, and
fails the check only with ``strict``.

A loss that is *not yet* in its rollout's marker fails the check (contract D14): the check is a separate
process, so it reads every writer's loss reserve on disk, and this node's node-local reserve for the
directory (contract D44), and names each loss still pending there. So do losses only a running writer's
memory holds (contract D43), and an entry of a reserve that names no rollout a writer may open a file for,
until a writer sets it aside; entries set aside are named, and fail the check only with ``strict``
(contract D41).

Model calls served and never recorded are reported too: without a rollout id, with one outside the
grammar, or late to a frozen or retired rollout. The serving processes count them in the directory
(:mod:`otel_capture._store.uncorrelated`); they fail the check only with ``strict``.
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
    INVALID_ID_WORDS,
    LATE_WORDS,
    LIBC_SYNCFS,
    NO_ID_WORDS,
    TOKENS_SUFFIX,
    CaptureStore,
    Loss,
    Reserves,
    choose_sync,
    held_in_memory,
    read_available_model_call_records,
    read_reserves,
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


@dataclass
class StateCheck:
    """What the directory's state says beyond its rollouts: reserve entries set aside or still to be
    (contract D41), losses only a running writer's memory holds (contract D43)."""

    reserves: Reserves
    in_memory: bool

    @property
    def damaged(self) -> bool:
        return bool(self.reserves.unsettled) or self.in_memory

    @property
    def strict_failed(self) -> bool:
        return bool(self.reserves.set_aside)

    def summary(self) -> str:
        """What the state says, in a few words, for the answer line."""
        said = []
        if self.in_memory:
            said.append("lost calls only in a running writer's memory")
        if self.reserves.unsettled:
            said.append(f"{len(self.reserves.unsettled)} loss reserve entry(ies) naming no rollout")
        if self.reserves.set_aside:
            said.append(f"{len(self.reserves.set_aside)} loss reserve entry(ies) set aside")
        return ", ".join(said)

    def lines(self) -> list[str]:
        lines = [
            f"{loss.source}: not a loss of any rollout ({loss.problem}): {loss.calls()}: {loss.reason}; "
            "the next writer sets it aside"
            for loss in self.reserves.unsettled
        ]
        for loss in self.reserves.set_aside:
            where = f"{loss.rollout_id}: " if loss.rollout_id else ""
            lines.append(
                f"{where}{loss.source}: set aside, in no marker ({loss.problem}): {loss.calls()}: {loss.reason}"
            )
        if self.in_memory:
            lines.append(
                "lost calls are only in the memory of a running writer (no loss reserve had room: see its "
                "log); they reach their markers once the directory has room, and are lost if it dies first"
            )
        return lines


def check_state(store: CaptureStore) -> StateCheck:
    """Every reserve of the directory, this node's node-local one included, and whether a running writer
    holds losses in memory only (read once: the rollouts' check takes its pending losses from it)."""
    return StateCheck(read_reserves(store.root), held_in_memory(store.root))


def local_loss_lines(store: CaptureStore) -> list[str]:
    """The losses this node keeps for a directory it cannot reach (contract D44)."""
    return [
        f"{loss.rollout_id or '(rollout unknown)'}: lost, not yet in the incomplete marker: {loss.describe()}"
        for loss in read_reserves(store.root, shared=False).pending
    ]


def check_capture_dir(store: CaptureStore, reserves: Reserves | None = None) -> list[RolloutCheck]:
    """One report per rollout in the directory. Never raises for a damaged file: it reports it."""
    damaged: dict[str, list[tuple[str, str]]] = {}
    for name, what in store.damaged_entries():
        damaged.setdefault(_rollout_of(name), []).append((name, what))
    readable = set(store.rollout_ids())
    unreported: dict[str, list[Loss]] = {}
    for loss in (reserves or read_reserves(store.root)).pending:
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


def format_check(results: list[RolloutCheck], state: StateCheck | None = None) -> list[str]:
    """Human-readable lines: one per problem, then a summary line."""
    lines = state.lines() if state is not None else []
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
    """The lines (one per kind) that say how many model calls were served and not recorded: without a
    rollout id, with one outside the grammar, late to a frozen or retired rollout; ``None``: none were."""
    lines = read_uncorrelated(store.root).lines()
    return "\n".join(lines) if lines else None


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


def _unrecorded_note(uncorrelated: str) -> str:
    kinds = [
        (f" {NO_ID_WORDS} " in uncorrelated, "without a rollout id"),
        (f" {INVALID_ID_WORDS} " in uncorrelated, "with an invalid rollout id"),
        (f" {LATE_WORDS} " in uncorrelated, "late to a frozen or retired rollout"),
    ]
    return "model calls served and not recorded (" + ", ".join(w for present, w in kinds if present) + ")"


def check_answer(
    results: list[RolloutCheck], uncorrelated: str | None, *, strict: bool, state: StateCheck | None = None
) -> str:
    """The first line ``check`` prints: the answer in plain words, ``ok: ...`` or ``NOT OK: ...`` (what is
    wrong, in which rollouts, and what the directory's own state says), as the exit status says it; the
    details follow it."""
    damaged = [r for r in results if r.damaged]
    incomplete = [r.rollout_id for r in results if r.incomplete]
    without_tokens = [r.rollout_id for r in results if r.tokens_missing]
    records = sum(r.records for r in results)
    state_damaged = state is not None and state.damaged
    set_aside = state is not None and state.strict_failed
    notes = []
    if incomplete:
        notes.append(f"{len(incomplete)} rollout(s) incomplete, a call not captured ({_names(incomplete)})")
    if without_tokens:
        notes.append(
            f"{len(without_tokens)} rollout(s) with calls missing the token ids or log-probs they asked for "
            f"({_names(without_tokens)})"
        )
    if uncorrelated is not None:
        notes.append(_unrecorded_note(uncorrelated))
    if set_aside and not state_damaged and state is not None:
        notes.append(state.summary())
    if damaged or state_damaged:
        wrong = []
        if damaged:
            names = _names([r.rollout_id for r in damaged])
            wrong.append(
                f"{len(damaged)} of {len(results)} rollout(s) damaged ({names}): {_damage_kinds(damaged)}"
            )
        if state is not None and state_damaged:
            wrong.append(state.summary())
        return "; ".join(["NOT OK: " + "; ".join(wrong), *notes]) + "; details below"
    if strict and (incomplete or uncorrelated is not None or set_aside):
        return "NOT OK (--strict): " + "; ".join(notes) + "; details below"
    answer = f"ok: {len(results)} rollout(s), {records} record(s), nothing damaged"
    return answer + (f"; but {'; '.join(notes)}; details below" if notes else "")
