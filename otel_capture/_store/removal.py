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

from .._errors import DamagedEntryError
from .fs import DirFds
from .names import INFLIGHT_DIR, INFLIGHT_SUFFIX, RECORD_SUFFIXES, TRASH_DIR

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
