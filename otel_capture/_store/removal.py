"""Taking a rollout's files out of the capture directory, and emptying the trash, by directory descriptor
and entry name: a link is moved or unlinked itself, never followed (contract D24, L14).

Retire and delete rename record files into ``.otel-capture/trash/`` (a rename, far cheaper than freeing a
synced file's blocks); a background task unlinks them. A trash that is not a real directory is never
used: the files are then unlinked in place.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid

from .._errors import DamagedEntryError
from .dirstate import DirState
from .fs import DirFds, describe_error
from .journal import Hook
from .names import INFLIGHT_DIR, INFLIGHT_SUFFIX, RECORD_SUFFIXES, TRASH_DIR
from .types import RemovalResult

_logger = logging.getLogger(__name__)


def trash_fd(dirs: DirFds) -> int | None:
    """The trash directory's descriptor, or ``None`` when it is damaged (logged; files are unlinked)."""
    try:
        return dirs.state_fd(TRASH_DIR)
    except DamagedEntryError as exc:
        _logger.error("%s; removing record files in place instead", exc)
        return None


def _remove(dir_fd: int, name: str, trash: int | None, trash_name: str) -> bool:
    try:
        if trash is None:
            os.unlink(name, dir_fd=dir_fd)
        else:
            os.rename(name, trash_name, src_dir_fd=dir_fd, dst_dir_fd=trash)
    except FileNotFoundError:
        return False
    return True


def unlink_records(dirs: DirFds, rollout_id: str, token: str | None, trash: int | None) -> bool:
    """Take a rollout's record files and in-flight marker out of the directory (contract L14, D24); True if any record file
    existed. With a batch ``token`` and a ``trash`` descriptor they are renamed into the trash, else
    unlinked. A damaged in-flight directory is logged and skipped: the records go all the same."""
    removed = False
    root = dirs.root_fd()
    for suffix in RECORD_SUFFIXES:
        name = rollout_id + suffix
        removed |= _remove(root, name, trash, f"{token}.{name}")
    try:
        inflight = dirs.state_fd(INFLIGHT_DIR)
    except FileNotFoundError:
        return removed
    except DamagedEntryError as exc:
        _logger.error("rollout %s: %s; its in-flight marker is left", rollout_id, exc)
        return removed
    name = rollout_id + INFLIGHT_SUFFIX
    _remove(inflight, name, trash, f"{token}.{name}")
    return removed


def purge_trash(dirs: DirFds) -> int:
    """Unlink every entry of the trash (contract L14, D24): a directory entry is removed as a tree, never
    following a link; ``dirs`` made with ``create=False``. Returns how many entries it removed. A trash
    that is not a real directory holds nothing of ours (removals unlink in place then): it is logged and left alone."""
    try:
        trash = dirs.state_fd(TRASH_DIR)
    except FileNotFoundError:
        return 0
    except DamagedEntryError as exc:
        _logger.error("%s; nothing purged", exc)
        return 0
    removed = 0
    for name in os.listdir(trash):
        try:
            os.unlink(name, dir_fd=trash)
        except FileNotFoundError:
            continue  # another purge got it first
        except IsADirectoryError:
            shutil.rmtree(name, dir_fd=trash)
        removed += 1
    return removed


def remove_fenced(
    state: DirState, dirs: DirFds, expected: dict[str, int], result: RemovalResult, hook: Hook
) -> dict[str, str]:
    """Phase 2 of a retire (contract L7): stripe by stripe, take out the records of each rollout still
    fenced by the retire line ``expected`` names (a rollout deleted and reused since keeps its new
    records). Returns ``{rollout_id: "removed" | "absent"}``; a failure goes to ``result["failed"]``. The
    caller syncs the directory."""
    by_stripe: dict[int, list[str]] = {}
    for rid in expected:
        by_stripe.setdefault(state.locks.stripe(rid), []).append(rid)
    outcome: dict[str, str] = {}
    token = uuid.uuid4().hex[:16]
    trash = trash_fd(dirs)
    for stripe, rids in sorted(by_stripe.items()):
        with state.locks.hold(dirs, [stripe]):
            state.journal.refresh()
            for rid in rids:
                fence = state.journal.fence(rid)
                if fence is None or fence.kind != "retired" or fence.seq != expected[rid]:
                    outcome[rid] = "absent"  # deleted and reused since phase 1: keep its records
                    continue
                try:
                    outcome[rid] = "removed" if unlink_records(dirs, rid, token, trash) else "absent"
                except OSError as exc:
                    result["failed"][rid] = describe_error(exc)
                    _logger.error("could not remove the records of retired rollout %s: %s", rid, exc)
                hook("retire_removed_one")
    return outcome
