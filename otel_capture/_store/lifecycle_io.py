"""Fenced appends and reading a rollout's files: the I/O under a rollout's stripe lock, shared by the
writer thread (``_writer``) and the lifecycle operations (``_lifecycle``)."""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .fences import DirState, Fence, Fsync, _fsync_dir, _write_all
from .types import CaptureFrozenError, CaptureRetiredError, IncompleteCall

_logger = logging.getLogger(__name__)

CAPTURE_SUFFIX = ".capture.jsonl"
INCOMPLETE_SUFFIX = ".capture.incomplete"
TOKENS_SUFFIX = ".tokens.jsonl"
RECORD_SUFFIXES = (CAPTURE_SUFFIX, INCOMPLETE_SUFFIX, TOKENS_SUFFIX)
INFLIGHT_REASON = "in flight when frozen: the call began and was never recorded"


def _fence_error(rollout_id: str, fence: Fence) -> CaptureFrozenError:
    if fence.kind == "retired":
        return CaptureRetiredError(f"rollout {rollout_id} is retired: its captures take no more writes")
    return CaptureFrozenError(f"rollout {rollout_id} is frozen: its captures take no more records")


# --- appending (the writer's path and append_now) -----------------------------------------------------


@dataclass
class AppendOutcome:
    """What one rollout's fenced append did. The caller ``fsync``s ``fds`` and then closes them."""

    accepted: list[int] = field(default_factory=list)
    dropped: list[tuple[int, CaptureFrozenError]] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    created: bool = False


def _open_append(path: Path, mode: int) -> tuple[int, bool]:
    # Read-write so that the append can look at the file's last byte (see _append_locked). The file usually
    # exists: try that first (one syscall, no exception), then create it exclusively to learn that this
    # append made it (its directory entry then needs a sync); a racing creator sends us back to the first.
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC), False
        except FileNotFoundError:
            pass
        try:
            return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode), True
        except FileExistsError:
            continue


def _append_locked(fd: int, data: bytes) -> None:
    """Append under the data file's own ``flock``, as NeMo Gym's writers and readers expect.

    A file that does not end in ``\n`` ends in a line torn by a writer that died mid-``write``: it is
    terminated first, so it stays one damaged line for readers to report instead of swallowing our line.
    """
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = os.fstat(fd).st_size
        if start and os.pread(fd, 1, start - 1) != b"\n":
            data = b"\n" + data
        try:
            _write_all(fd, data)
        except OSError:
            # Half a batch would leave a torn line that every later append follows: cut it back.
            try:
                os.ftruncate(fd, start)
            except OSError as exc:
                _logger.error("could not cut a partly written batch back to %d bytes: %s", start, exc)
            raise
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def fenced_append(
    state: DirState,
    rollout_id: str,
    calls: list[tuple[str, bytes, bytes | None]],
    begins: Iterable[str] = (),
    *,
    file_mode: int = 0o600,
) -> AppendOutcome:
    """Append one rollout's ``(model_call_id, capture line, tokens line)`` entries, unless fenced.

    Under the rollout's stripe: a frozen or retired rollout drops every entry (each with its typed
    error); a call admitted before the rollout's latest lifecycle event is dropped as late; the rest is
    written in one ``write`` per file. ``begins`` are calls that started since the last batch: their
    ``+`` markers are written here (when their line is not in the same batch). Raises ``OSError`` when a
    file cannot be written (the caller marks the rollout incomplete); no descriptor is leaked.
    """
    outcome = AppendOutcome()
    root = state.root
    begins = list(begins)
    with state.locks.hold_ids([rollout_id]):
        state.journal.refresh()
        fence = state.journal.fence(rollout_id)
        mcids = [mcid for mcid, _, _ in calls]
        if fence is not None:
            error = _fence_error(rollout_id, fence)
            outcome.dropped = [(i, error) for i in range(len(calls))]
            last = state.journal.last_seq(rollout_id)
            for mcid in begins:  # admitted at this epoch: still late after a delete reuses the id
                state.calls.admit(rollout_id, mcid, last)
            state.calls.end(rollout_id, mcids)
            return outcome
        epoch = state.journal.last_seq(rollout_id)
        for mcid in begins:
            state.calls.admit(rollout_id, mcid, epoch)
        kept: list[tuple[str, bytes, bytes | None]] = []
        marked_ended: list[str] = []
        begun_here = set(begins)
        for index, (mcid, line, tokens) in enumerate(calls):
            admitted = state.calls.epoch(rollout_id, mcid)
            if admitted is not None and epoch > admitted:
                late = CaptureRetiredError(
                    f"rollout {rollout_id} was retired or deleted while call {mcid} was in flight"
                )
                outcome.dropped.append((index, late))
                continue
            if admitted is not None and mcid not in begun_here:
                marked_ended.append(mcid)
            outcome.accepted.append(index)
            kept.append((mcid, line, tokens))
        try:
            if kept:
                fd, created = _open_append(root / (rollout_id + CAPTURE_SUFFIX), file_mode)
                outcome.fds.append(fd)
                outcome.created |= created
                _append_locked(fd, b"".join(line for _, line, _ in kept))
                token_data = b"".join(tokens for _, _, tokens in kept if tokens)
                if token_data:
                    fd, created = _open_append(root / (rollout_id + TOKENS_SUFFIX), file_mode)
                    outcome.fds.append(fd)
                    outcome.created |= created
                    _append_locked(fd, token_data)
            in_batch = set(mcids)
            state.write_markers(rollout_id, [m for m in begins if m not in in_batch], marked_ended)
        except BaseException:
            for fd in outcome.fds:
                os.close(fd)
            raise
        finally:
            state.calls.end(rollout_id, mcids)
    return outcome


def fenced_mark_incomplete(
    state: DirState,
    rollout_id: str,
    calls: list[tuple[str, str]],
    *,
    fsync: Fsync,
    check: Callable[[str], Fence | None],
    file_mode: int = 0o600,
) -> Fence | None:
    """Durably mark ``(model_call_id, reason)`` calls as not captured: one JSON line each in
    ``<id>.capture.incomplete`` (NeMo Gym only checks that the file exists), and the calls end (their
    ``-`` markers, so no other process takes them for calls still in flight).

    Under the rollout's stripe, after ``check`` (which refreshes the journal and returns the fence): a
    retired rollout's marker would outlive its removed records, so nothing is written and the fence is
    returned for the caller to refuse or ignore. A frozen rollout is marked: its snapshot may list a line
    whose sync failed, and the changed version makes a stale ``drop`` fail. The one path shared by the
    writer thread (a failed batch, an unbuildable record) and ``CaptureStore.mark_incomplete``.
    """
    now = time.time()
    data = b"".join(
        orjson.dumps({"model_call_id": mcid, "reason": reason, "at": now}, option=orjson.OPT_APPEND_NEWLINE)
        for mcid, reason in calls
    )
    mcids = [mcid for mcid, _ in calls]
    with state.locks.hold_ids([rollout_id]):
        try:
            fence = check(rollout_id)
            if fence is not None and fence.kind == "retired":
                return fence
            state.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, created = _open_append(state.root / (rollout_id + INCOMPLETE_SUFFIX), file_mode)
            try:
                _append_locked(fd, data)
                fsync(fd)
            finally:
                os.close(fd)
            if created:
                _fsync_dir(state.root, fsync)
            if fence is None:
                state.write_markers(rollout_id, [], mcids)
            return fence
        finally:
            state.calls.end(rollout_id, mcids)


# --- reading a rollout --------------------------------------------------------------------------------


@dataclass
class _Contents:
    records: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[dict[str, Any]] = field(default_factory=list)
    incomplete: list[IncompleteCall] = field(default_factory=list)
    marker_exists: bool = False
    version: int = 0
    paths: list[Path] = field(default_factory=list)

    def call_ids(self) -> set[str]:
        ids = {r.get("model_call_id") for r in self.records} | {c.model_call_id for c in self.incomplete}
        return {i for i in ids if isinstance(i, str)}


def _split(path: Path) -> tuple[list[bytes], bytes] | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    lines = data.split(b"\n")
    tail = lines.pop()
    return [line for line in lines if line.strip()], tail


def _parse_lines(path: Path, into: list[dict[str, Any]], contents: _Contents) -> None:
    split = _split(path)
    if split is None:
        return
    contents.paths.append(path)
    lines, tail = split
    contents.version += len(lines)
    for number, line in enumerate(lines, 1):
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            into.append(value)
        else:
            contents.incomplete.append(IncompleteCall("", f"{path.name}: damaged line {number}"))
    if tail.strip():
        contents.incomplete.append(
            IncompleteCall("", f"{path.name}: torn final line (a write was cut short)")
        )


def read_contents(root: Path, rollout_id: str) -> _Contents:
    contents = _Contents()
    _parse_lines(root / (rollout_id + CAPTURE_SUFFIX), contents.records, contents)
    _parse_lines(root / (rollout_id + TOKENS_SUFFIX), contents.tokens, contents)
    marker = root / (rollout_id + INCOMPLETE_SUFFIX)
    split = _split(marker)
    if split is not None:
        contents.marker_exists = True
        contents.paths.append(marker)
        lines, _ = split
        contents.version += len(lines)
        for line in lines:
            try:
                value = orjson.loads(line)
            except orjson.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                mcid, reason = value.get("model_call_id"), value.get("reason")
                contents.incomplete.append(
                    IncompleteCall(mcid if isinstance(mcid, str) else "", str(reason or "marked incomplete"))
                )
            else:
                contents.incomplete.append(IncompleteCall("", "marked incomplete"))
        if not lines:
            contents.incomplete.append(IncompleteCall("", "marked incomplete"))  # NeMo Gym's empty marker
    return contents
