"""Plain-text tables of captured calls, for ``otel-capture show``, ``ls`` and ``demo``.

Pure formatting: records in, aligned text out (one line at a time for a rollout's calls). The only I/O is
:func:`rollout_summaries` reading the store (``otel-capture ls``) and :func:`torn_tail`.

A call answered without usage (a stream requested without ``stream_options={"include_usage": true}``, or a
server that sends none) has unknown tokens, never zero: its cells are ``?`` in ``show``, and a rollout's
sums in ``ls`` read ``120+?`` (``?`` when no call had usage).
"""

from __future__ import annotations

import itertools
import logging
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .._records import InvalidLine, ModelCallRecord
from .._store import scan_available_model_call_records

if TYPE_CHECKING:
    from .._store import CaptureStore, RolloutState

_logger = logging.getLogger(__name__)

ReadRecords = Callable[["CaptureStore", str], Iterable[ModelCallRecord | InvalidLine]]

MISSING = "-"
UNKNOWN = "?"  # tokens of a call answered without usage: unknown, not zero
CALL_HEADERS = (
    "#",
    "dialect",
    "model",
    "status",
    "tokens in",
    "tokens out",
    "latency ms",
    "ttft ms",
    "error",
    "weight",
)
CALL_RIGHT = frozenset({0, 3, 4, 5, 6, 7})
ROLLOUT_HEADERS = (
    "rollout",
    "state",
    "calls",
    "errors",
    "tokens in",
    "tokens out",
    "model s",
    "p50 ms",
    "max ms",
    "ttft ms",
    "refused",
    "incomplete",
    "damaged",
)
ROLLOUT_RIGHT = frozenset(range(2, 11))


class TornTail(NamedTuple):
    """A data file's final line without its newline (a writer died mid-append): its 1-based line number
    and its size in bytes. Never parsed as a record."""

    line_number: int
    size: int

    def describe(self) -> str:
        return f"torn tail: line {self.line_number}, {self.size} bytes with no newline (a writer died mid-append)"


@dataclass(frozen=True)
class RolloutSummary:
    rollout_id: str
    calls: int
    errors: int
    tokens_in: int
    tokens_out: int
    incomplete: bool
    state: str = MISSING  # live, frozen or retired (``CaptureStore.list_rollouts``)
    refused: int = 0  # calls the capture proxy refused for capacity: retries to come, not in ``errors``
    no_usage: int = 0  # calls answered without usage: their tokens are unknown, not in the sums
    model_ms: float | None = None  # the calls' latencies summed: the rollout's time in the model
    p50_ms: float | None = None  # the median call latency
    max_ms: float | None = None
    ttft_ms: float | None = None  # the mean time to first chunk of the streamed calls
    damaged_lines: int = 0  # lines that are not records (the torn tail apart)
    torn_tail: TornTail | None = None
    unreadable: str | None = None  # why its file could not be read (e.g. a lock held past the timeout)

    @property
    def damaged(self) -> bool:
        return bool(self.damaged_lines) or self.torn_tail is not None or self.unreadable is not None


def short_model(model: str | None) -> str:
    """The file name of a model given as a filesystem path (llama.cpp echoes its model file's path).

    Hub-style names such as ``org/model`` are kept whole: there the organisation is part of the name.
    """
    if not model:
        return MISSING
    if model.startswith(("/", "~", "./", "../")) or "\\" in model:
        return model.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    return model


def _cell(value: object, digits: int = 1) -> str:
    if value is None or value == "":
        return MISSING
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


SAMPLE_ROWS = 1000
"""``otel-capture show DIR ID`` prints each call's line as it is read; its columns are as wide as the
widest cell of the header and the first ``SAMPLE_ROWS`` calls (the ``#`` column: the last line's index).
A wider cell further down overflows its column on that line only; up to that many calls the output is
what sizing from every row gives."""


def iter_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    right: frozenset[int],
    sample: int | None = None,
    min_widths: Sequence[int] = (),
) -> Iterator[str]:
    """The lines of :func:`format_table`, one at a time: columns sized from the header and the first
    ``sample`` rows (all rows when ``None``), which are the only rows held, and at least ``min_widths``;
    the rest are formatted as they come."""
    rows = iter(rows)
    held = [list(headers), *(list(row) for row in itertools.islice(rows, sample))]
    widths = [max(len(row[i]) for row in held) for i in range(len(headers))]
    widths = [max(w, m) for w, m in itertools.zip_longest(widths, min_widths[: len(widths)], fillvalue=0)]

    def line(row: Sequence[str]) -> str:
        cells = (
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=False))
        )
        return "  ".join(cells).rstrip()

    for sampled in held:
        yield line(sampled)
    del held
    for row in rows:
        yield line(row)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]], right: frozenset[int]) -> str:
    """Columns padded to their widest cell; columns in ``right`` (numbers) aligned right."""
    return "\n".join(iter_table(headers, rows, right))


def usage_unknown(record: ModelCallRecord) -> bool:
    """A call answered without usage: it has a status, did not fail, and has neither token count (a stream
    requested without ``include_usage``, or a server that sends no usage). Its tokens are unknown, not
    zero."""
    answered = record.status_code is not None and not record.failed
    return answered and record.tokens_in is None and record.tokens_out is None


def _call_row(record: ModelCallRecord) -> list[str]:
    unknown = usage_unknown(record)
    return [
        _cell(record.call_index),
        _cell(record.dialect),
        short_model(record.model),
        _cell(record.status_code),
        UNKNOWN if unknown else _cell(record.tokens_in),
        UNKNOWN if unknown else _cell(record.tokens_out),
        _cell(record.latency_total_ms),
        _cell(record.latency_ttft_ms),
        "refused" if record.refused else _cell(record.error_category),
        weight_cell(record),
    ]


def weight_cell(record: ModelCallRecord) -> str:
    """The call's weight version: ``7``; ``7->8`` when the declared version changed while it ran; the
    engine's own when it differs, ``7 (engine 6)``; ``-`` when none is known."""
    admitted, at_end, engine = (
        record.weight_version,
        record.weight_version_at_end,
        record.engine_weight_version,
    )
    cell = admitted or MISSING
    if at_end:
        cell += f"->{at_end}"
    if engine and engine != admitted:
        cell += f" (engine {engine})"
    return cell


def trace_link(trace_url: str, trace_id: str | None) -> str:
    """The page of one trace in a tracing UI whose base URL is ``trace_url``: ``{trace_url}/trace/{id}``
    (Jaeger's), or ``trace_url`` with ``{trace_id}`` replaced when it has that placeholder (e.g. Phoenix:
    ``http://127.0.0.1:6006/redirects/traces/{trace_id}``)."""
    if not trace_id:
        return MISSING
    if "{trace_id}" in trace_url:
        return trace_url.replace("{trace_id}", trace_id)
    return f"{trace_url.rstrip('/')}/trace/{trace_id}"


def format_calls_table(records: Iterable[ModelCallRecord], trace_url: str | None = None) -> str:
    """One line per call: index, dialect, model, status, tokens in/out, latency, TTFT, error category, and
    with ``trace_url`` (a tracing UI's base URL) the link to the call's trace (:func:`trace_link`)."""
    return "\n".join(iter_calls_table(records, trace_url, sample=None))


def iter_calls_table(
    records: Iterable[ModelCallRecord],
    trace_url: str | None = None,
    *,
    sample: int | None = SAMPLE_ROWS,
    last_index: int = 0,
) -> Iterator[str]:
    """:func:`format_calls_table` line by line, columns sized from the first ``sample`` calls: a rollout of
    any length is printed holding only those rows (``otel-capture show``). The ``#`` column is as wide as
    ``last_index`` (the rollout's last line), so it stays aligned past the sample."""
    widths = (len(str(last_index)),)
    if trace_url is None:
        return iter_table(CALL_HEADERS, (_call_row(r) for r in records), CALL_RIGHT, sample, widths)
    rows = ([*_call_row(r), trace_link(trace_url, r.trace_id)] for r in records)
    return iter_table((*CALL_HEADERS, "trace"), rows, CALL_RIGHT, sample, widths)


def summarize_rollout(
    rollout_id: str,
    items: Iterable[ModelCallRecord | InvalidLine],
    incomplete: bool,
    state: str = MISSING,
    torn: TornTail | None = None,
) -> RolloutSummary:
    """A rollout's calls, failed calls (:attr:`ModelCallRecord.failed`, as ``num_errors`` counts them:
    refused calls apart, in ``refused``),
    summed tokens (the calls without usage counted apart), latencies and damaged lines, in one pass:
    ``items`` may be an iterator (records and damaged lines as the tolerant reader yields them), so a
    rollout is never held whole, only its calls' latencies."""
    calls = errors = refused = tokens_in = tokens_out = no_usage = damaged = 0
    latencies: list[float] = []
    ttfts: list[float] = []
    for item in items:
        if isinstance(item, InvalidLine):
            damaged += 1
            continue
        calls += 1
        if item.refused:
            refused += 1
        else:
            errors += item.failed
        no_usage += usage_unknown(item)
        tokens_in += item.tokens_in or 0
        tokens_out += item.tokens_out or 0
        if item.latency_total_ms is not None:
            latencies.append(item.latency_total_ms)
        if item.stream is not False and item.latency_ttft_ms is not None:  # streamed, or not known not to be
            ttfts.append(item.latency_ttft_ms)
    return RolloutSummary(
        rollout_id,
        calls,
        errors,
        tokens_in,
        tokens_out,
        incomplete,
        state,
        refused=refused,
        no_usage=no_usage,
        model_ms=sum(latencies) if latencies else None,
        p50_ms=statistics.median(latencies) if latencies else None,
        max_ms=max(latencies) if latencies else None,
        ttft_ms=statistics.fmean(ttfts) if ttfts else None,
        damaged_lines=damaged,
        torn_tail=torn,
    )


def format_rollout_summaries(summaries: Iterable[RolloutSummary]) -> str:
    rows = [_rollout_row(s) for s in summaries]
    return format_table(ROLLOUT_HEADERS, rows, ROLLOUT_RIGHT)


def _tokens_cell(total: int, no_usage: int) -> str:
    """A rollout's summed tokens; ``+?`` when some calls had no usage (``?`` alone: the sum is of none)."""
    if not no_usage:
        return str(total)
    return f"{total}+{UNKNOWN}" if total else UNKNOWN


def damage_cell(s: RolloutSummary) -> str:
    """``-``; ``2 lines``; ``torn 37 B`` (a torn tail of 37 bytes); or both; ``unreadable``."""
    if s.unreadable is not None:
        return "unreadable"
    parts = []
    if s.damaged_lines:
        parts.append(f"{s.damaged_lines} line{'s' if s.damaged_lines != 1 else ''}")
    if s.torn_tail is not None:
        parts.append(f"torn {s.torn_tail.size} B")
    return ", ".join(parts) or MISSING


def _rollout_row(s: RolloutSummary) -> list[str]:
    seconds = None if s.model_ms is None else s.model_ms / 1000
    return [
        s.rollout_id,
        s.state,
        str(s.calls),
        str(s.errors),
        _tokens_cell(s.tokens_in, s.no_usage),
        _tokens_cell(s.tokens_out, s.no_usage),
        _cell(seconds, 2),
        _cell(s.p50_ms),
        _cell(s.max_ms),
        _cell(s.ttft_ms),
        str(s.refused),
        "yes" if s.incomplete else "no",
        damage_cell(s),
    ]


def _tolerant(store: CaptureStore, rollout_id: str) -> Iterable[ModelCallRecord | InvalidLine]:
    return scan_available_model_call_records(store, rollout_id)[1]


def torn_tail(store: CaptureStore, rollout_id: str) -> TornTail | None:
    """The rollout's torn final line, if its data file ends with one: read as the store streams it (opened
    without following a link, up to the size seen under its shared lock), so its size in bytes is exact."""
    streamed = store.stream_lines(rollout_id)
    if streamed is None:
        return None
    lines = consumed = 0
    for line in streamed:
        lines += 1
        consumed += len(line) + 1
    left = streamed.size - consumed
    return TornTail(lines + 1, left) if left > 0 else None


def rollout_summaries(
    store: CaptureStore,
    read_records: ReadRecords = _tolerant,
    state: RolloutState | None = None,
) -> list[RolloutSummary]:
    """One summary per rollout of the store (:meth:`CaptureStore.list_rollouts`, only ``state`` ones if
    given), damaged ones included: a damaged line is counted and skipped, a torn tail measured. Each
    rollout's records are summed as they are parsed (a retired one has none)."""
    states = store.list_rollouts(state)
    return [_summary(store, rid, states[rid], read_records) for rid in states]


def _summary(store: CaptureStore, rollout_id: str, state: str, read_records: ReadRecords) -> RolloutSummary:
    """One rollout's summary; one whose file cannot be read (a lock held past the lock timeout, an I/O
    error) is listed all the same, as ``unreadable``, as ``check`` reports it."""
    incomplete = store.is_incomplete(rollout_id)
    try:
        return summarize_rollout(
            rollout_id, read_records(store, rollout_id), incomplete, state, torn_tail(store, rollout_id)
        )
    except OSError as exc:
        _logger.debug("cannot read rollout %s", rollout_id, exc_info=True)
        return RolloutSummary(
            rollout_id, 0, 0, 0, 0, incomplete, state, unreadable=f"{type(exc).__name__}: {exc}"
        )


def format_rollouts_table(
    store: CaptureStore,
    read_records: ReadRecords = _tolerant,
    state: RolloutState | None = None,
) -> str:
    """The table of :func:`rollout_summaries`: per rollout its state, calls, errors, summed tokens, time in
    the model (s), median and longest call latency (ms), mean time to first chunk of its streamed calls
    (ms), whether a capture failed, and its damage; the header alone when there is none."""
    return format_rollout_summaries(rollout_summaries(store, read_records, state))
