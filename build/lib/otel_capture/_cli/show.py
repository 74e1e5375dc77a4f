"""Plain-text tables of captured calls, for ``otel-capture show`` and ``otel-capture demo``.

Pure formatting: records in, aligned text out (one line at a time for a rollout's calls). The only I/O is ``format_rollouts_table`` reading the store.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._records import ModelCallRecord
from .._store import iter_model_call_records

if TYPE_CHECKING:
    from .._store import CaptureStore

_logger = logging.getLogger(__name__)

ReadRecords = Callable[["CaptureStore", str], Iterable[ModelCallRecord]]

MISSING = "-"
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
)
CALL_RIGHT = frozenset({0, 3, 4, 5, 6, 7})
ROLLOUT_HEADERS = ("rollout", "calls", "errors", "tokens in", "tokens out", "incomplete")
ROLLOUT_RIGHT = frozenset({1, 2, 3, 4})


@dataclass(frozen=True)
class RolloutSummary:
    rollout_id: str
    calls: int
    errors: int
    tokens_in: int
    tokens_out: int
    incomplete: bool


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


def _call_row(record: ModelCallRecord) -> list[str]:
    return [
        _cell(record.call_index),
        _cell(record.dialect),
        short_model(record.model),
        _cell(record.status_code),
        _cell(record.tokens_in),
        _cell(record.tokens_out),
        _cell(record.latency_total_ms),
        _cell(record.latency_ttft_ms),
        _cell(record.error_category),
    ]


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
    rollout_id: str, records: Iterable[ModelCallRecord], incomplete: bool
) -> RolloutSummary:
    """A rollout's calls, failed calls (:attr:`ModelCallRecord.failed`, as ``num_errors`` counts them) and
    summed tokens, in one pass: ``records`` may be an iterator, so a rollout is never held whole."""
    calls = errors = tokens_in = tokens_out = 0
    for record in records:
        calls += 1
        errors += record.failed
        tokens_in += record.tokens_in or 0
        tokens_out += record.tokens_out or 0
    return RolloutSummary(rollout_id, calls, errors, tokens_in, tokens_out, incomplete)


def format_rollout_summaries(summaries: Iterable[RolloutSummary]) -> str:
    rows = [_rollout_row(s) for s in summaries]
    return format_table(ROLLOUT_HEADERS, rows, ROLLOUT_RIGHT)


def _rollout_row(s: RolloutSummary) -> list[str]:
    counts = (s.calls, s.errors, s.tokens_in, s.tokens_out)
    return [s.rollout_id, *(str(n) for n in counts), "yes" if s.incomplete else "no"]


def format_rollouts_table(store: CaptureStore, read_records: ReadRecords = iter_model_call_records) -> str:
    """One line per rollout in the store (:meth:`CaptureStore.rollout_ids`): calls, errors, summed tokens,
    and whether a capture failed. Each rollout's records are summed as they are parsed."""
    read = read_records
    summaries = [
        summarize_rollout(rollout_id, read(store, rollout_id), store.is_incomplete(rollout_id))
        for rollout_id in store.rollout_ids()
    ]
    return format_rollout_summaries(summaries)
