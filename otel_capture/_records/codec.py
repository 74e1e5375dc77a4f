"""The line codec, both ways: a call's values to its ``<id>.capture.jsonl`` line, a response's token data
to its ``<id>.tokens.jsonl`` line, a file's bytes to its lines, and one line back to a record (or to the
reason it is damaged, worded one way everywhere).

Nothing here opens a file or knows the store: the store and its readers (:mod:`otel_capture._store`) hand
bytes in and take records out. The fields themselves are declared once, in :mod:`.schema`: adding one of
ours (after Gym's) to :class:`.schema.ModelCallRecord` is all the codec needs (the encoder writes the keys
it is given, in :data:`.schema.LINE_KEYS` order; the decoder reads every added field by its annotation,
:data:`.schema.EXTRA_RECORD_TYPES`); the capture (:meth:`otel_capture._capture.call.InFlightCall.line`) gives it
its value.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import orjson
from pydantic import ValidationError

from .._dialects.tokens import extract_tokens
from .._errors import CaptureReadError, DamagedLine, damaged_line
from .build import build_model_call_record
from .schema import TOKENS_SCHEMA_VERSION, ModelCallRecord

__all__ = [
    "CaptureReadError",
    "DamagedLine",
    "InvalidLine",
    "chunked_lines",
    "damaged_line",
    "decode_record_line",
    "encode_record_line",
    "encode_tokens_line",
    "final_tail",
    "line_spans",
    "parse_record_line",
    "preview",
    "split_lines",
    "stamp_record_line",
    "tokens_line",
]

_logger = logging.getLogger(__name__)

_PREVIEW_BYTES = 300
TORN_REASON = "torn final line (no trailing newline): an append was cut short; not parsed"

# -- encoding -----------------------------------------------------------------------------------------


def encode_record_line(values: dict[str, Any]) -> bytes:
    """One record line (ending in ``\\n``) from a call's values, keyed and ordered as
    :data:`.schema.LINE_KEYS` names them (NeMo Gym 0.7.0's keys first, in its order; ``schema_version``,
    :data:`.schema.SCHEMA_VERSION`, first among ours); absent keys are not written, ``None`` is ``null``.
    Bodies may be ``orjson.Fragment``s, embedded as sent. The keys are not checked here, per call (this
    runs on every captured call): ``tests/unit/test_codec.py`` checks the lines the capture makes."""
    return orjson.dumps(values, default=str, option=orjson.OPT_APPEND_NEWLINE)


STAMPED_KEYS = ("weight_version", "weight_version_at_end")
"""The keys the writer may add to an encoded line once it knows them (:func:`stamp_record_line`)."""


def stamp_record_line(line: bytes, values: dict[str, Any]) -> bytes:
    """A line from :func:`encode_record_line` with ``values`` (keys of :data:`STAMPED_KEYS` that the line
    does not carry) added as its last keys: what the writer knows only in the batch that writes the line
    (the declared weight versions). The line is otherwise untouched (its bodies stay the bytes sent)."""
    if not values:
        return line
    if not set(STAMPED_KEYS).issuperset(values):
        raise KeyError(f"not a stamped key: {sorted(values.keys() - set(STAMPED_KEYS))}")
    if not line.endswith(b"}\n"):
        raise ValueError("not an encoded record line")
    return line[:-2] + b"," + orjson.dumps(values)[1:-1] + b"}\n"


def tokens_line(
    response: dict[str, Any] | None,
    *,
    rollout_id: str,
    model_call_id: str,
    request: dict[str, Any] | None = None,
) -> bytes | None:
    """The ``<id>.tokens.jsonl`` line (ending in ``\\n``) of one call, or ``None`` without token data.

    The line::

        {"schema_version": 1, "rollout_id": ..., "model_call_id": ..., "model": ...,
         "prompt_token_ids": [...] | null,
         "generations": [{"index": 0, "token_ids": [...] | null, "log_probs": [...] | null}, ...]}

    An entry of a list may be ``null`` (an odd one: a NaN log-prob...; ``docs/tokens.md``, "Odd entries").

    What is read from which response shape is the dialects' (:func:`otel_capture._dialects.tokens.
    extract_tokens`); the ``request`` gives a token-in/token-out call's prompt ids."""
    found = extract_tokens(response, request)
    if found is None or response is None:
        return None
    return encode_tokens_line(found, response, rollout_id=rollout_id, model_call_id=model_call_id)


def encode_tokens_line(
    found: dict[str, Any], response: dict[str, Any], *, rollout_id: str, model_call_id: str
) -> bytes:
    """:func:`tokens_line` from tokens already read (``extract_tokens(response, request)``, or the
    response's alone through :func:`otel_capture._dialects.tokens.with_request_prompt`)."""
    model = response.get("model")
    record = {
        "schema_version": TOKENS_SCHEMA_VERSION,
        "rollout_id": rollout_id,
        "model_call_id": model_call_id,
        "model": model if isinstance(model, str) else None,
        **found,
    }
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


# -- splitting ----------------------------------------------------------------------------------------


def split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """A file's bytes split at ``\\n``: its complete lines (newline removed, blank ones kept, so a line's
    position is its physical line number minus one) and what follows the last newline (a non-blank one
    is a torn final line: a writer died, or the disk filled, mid-append)."""
    lines = data.split(b"\n")
    tail = lines.pop()
    return lines, tail


def final_tail(data: bytes) -> bytes:
    """What follows the last ``\\n`` of ``data``: the tail :func:`split_lines` returns, without splitting
    the rest (a non-blank one is a torn final line)."""
    return data[data.rfind(b"\n") + 1 :]


def chunked_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The complete lines of a file read a chunk at a time (newline removed, blank ones kept), as
    :func:`split_lines` would give them for the chunks joined; the tail after the last newline is not
    yielded. A line that spans chunks is joined once."""
    pending: list[bytes] = []  # the start of a line that continues in the next chunk
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            if pending:
                pending.append(chunk[start:end])
                yield b"".join(pending)
                pending.clear()
            else:
                yield chunk[start:end]
            start = end + 1
        if start < len(chunk):
            pending.append(chunk[start:])


def line_spans(data: bytes) -> Iterator[tuple[int, int, int]]:
    """``(physical line number, start, end)`` of each non-blank complete line of ``data`` (the newline
    excluded), one at a time and without copying most lines: the splitter of a file held as one buffer
    (a freeze's snapshot, the incomplete marker). Agrees with :func:`split_lines` on what a line is."""
    start = 0
    number = 0
    while (end := data.find(b"\n", start)) != -1:
        number += 1
        first = data[start : start + 1]
        if first and (not first.isspace() or data[start:end].strip()):
            yield number, start, end
        start = end + 1


def preview(line: bytes) -> str:
    """The start of a damaged line, decoded, for a report."""
    if len(line) <= _PREVIEW_BYTES:
        return line.decode("utf-8", "replace")
    return line[:_PREVIEW_BYTES].decode("utf-8", "replace") + f"... ({len(line)} bytes)"


# -- decoding -----------------------------------------------------------------------------------------


class InvalidLine(NamedTuple):
    """A damaged line: 1-based physical line number, why it was refused, and its start (decoded)."""

    line_number: int
    reason: str
    raw: str


def _validation_reason(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        loc = ".".join(str(part) for part in error["loc"])
        if loc == "latency_total_ms":
            loc = "latency_ms"  # name the key as it is on disk
        parts.append(f"{loc}: {error['msg']}")
    return "invalid record: " + "; ".join(parts)


def decode_record_line(stripped: bytes, call_index: int) -> ModelCallRecord:
    """One stripped non-blank line to its record, as NeMo Gym reads it; :class:`DamagedLine` with the
    reason when it is not one (not JSON, not an object, or a record Gym would refuse)."""
    try:
        obj = orjson.loads(stripped)
    except orjson.JSONDecodeError as exc:
        raise DamagedLine(f"invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise DamagedLine(f"not a JSON object but {type(obj).__name__}")
    try:
        return build_model_call_record(obj, call_index=call_index)
    except ValidationError as exc:
        raise DamagedLine(_validation_reason(exc)) from exc
    except Exception as exc:  # Gym counts any failure to build a record as a damaged line
        raise DamagedLine(f"cannot derive record: {type(exc).__name__}: {exc}") from exc


def parse_record_line(line: bytes, call_index: int) -> ModelCallRecord | None:
    """One non-blank line as the readers read it; ``None`` when it is damaged (what a freeze reports)."""
    try:
        return decode_record_line(line.strip(), call_index)
    except DamagedLine:
        return None
