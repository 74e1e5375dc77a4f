"""Which filesystem the capture directory is on, and therefore how a batch is made durable.

``syncfs(2)`` makes a whole local filesystem durable with one call, which is what lets one flush cover a
batch over many files. On a network or FUSE filesystem it does not: the kernel has nothing of its own to
write back there, so ``syncfs`` returns 0 at once and the server receives no sync at all (traced on a
GlusterFS brick: 0 syncs for 20 ``syncfs``, while every ``fsync`` reached it). There, each file's
``fsync`` is the only call that is forwarded to the server, so the writer uses one ``fsync`` per file per
batch (still one batch per group commit).

The type is the ``f_type`` of ``statfs(2)`` (read through ctypes: the standard library has no ``statfs``),
its name from ``/proc/self/mountinfo`` where it can be read (``fuse.glusterfs``, ``nfs4``...). Only a
filesystem known to be local takes ``syncfs``; any other type, known to be remote or simply unknown,
takes the per-file ``fsync`` that is durable everywhere.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .libc import LIBC

SyncKind = Literal["syncfs", "fsync"]

LOCAL_FILESYSTEMS: dict[int, str] = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0xF2F52010: "f2fs",
    0x2FC12FC1: "zfs",
    0x794C7630: "overlayfs",
    0x3153464A: "jfs",
    0x52654973: "reiserfs",
    0xCA451A4E: "bcachefs",
    0x2011BAB0: "exfat",
    0x4D44: "vfat",
    0x3434: "nilfs2",
}
"""``f_type`` values of filesystems whose ``syncfs`` writes their own disk (``linux/magic.h``)."""

SHARED_FILESYSTEMS: dict[int, str] = {
    0x65735546: "fuse",
    0x6969: "nfs",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x00C36400: "cephfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x517B: "smb",
    0x01021997: "9p",
    0x5346414F: "afs",
    0x6B414653: "kafs",
    0x7461636F: "ocfs2",
    0x01161970: "gfs2",
    0x73757245: "coda",
    0x19830326: "beegfs",
    0x564C: "ncpfs",
}
"""``f_type`` values of network, cluster and FUSE filesystems, where only a file's ``fsync`` reaches the
server (FUSE covers GlusterFS, virtiofs, Weka's and object-store mounts)."""


@dataclass(frozen=True, slots=True)
class SyncChoice:
    """How the writer makes a batch durable, and why (said by ``check`` and the writer's startup log)."""

    kind: SyncKind
    reason: str
    fs_type: int | None = None
    fs_name: str | None = None
    shared: bool = False
    """A network or FUSE filesystem: each call is a round trip to a server, so the writer runs a batch's
    per-file work concurrently there (:mod:`.batch_io`)."""

    def describe(self) -> str:
        what = "one syncfs per batch of several files" if self.kind == "syncfs" else "one fsync per file"
        return f"sync: {what} ({self.reason})"


def _libc_statfs_type() -> object | None:
    function = getattr(LIBC, "statfs", None)
    if function is None:
        return None
    function.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    found: object = function
    return found


_STATFS = _libc_statfs_type()
_STATFS_BUFFER = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type is its first field (a long)


def statfs_type(path: str | os.PathLike[str]) -> int | None:
    """The ``f_type`` of the filesystem holding ``path`` (``None`` where ``statfs`` is not available)."""
    if _STATFS is None:
        return None
    buffer = ctypes.create_string_buffer(_STATFS_BUFFER)
    if _STATFS(os.fsencode(path), buffer) != 0:  # type: ignore[operator]
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), os.fspath(path))
    return int(ctypes.c_long.from_buffer(buffer).value) & 0xFFFFFFFF


def mount_of(path: str | os.PathLike[str], mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str] | None:
    """``(mount point, filesystem type)`` of the mount holding ``path`` from ``/proc/self/mountinfo`` (the
    type with its FUSE subtype: ``fuse.glusterfs``), or ``None`` when that file cannot be read."""
    target = os.path.realpath(path)
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    best: tuple[str, str] | None = None
    for line in lines:
        fields = line.split(" ")
        try:
            point = _unescape(fields[4])
            fs_type = fields[fields.index("-") + 1]
        except (IndexError, ValueError):
            continue
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fs_type)  # the last, longest match is the mount on top
    return best


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing ancestor: the directory may not be made yet, and it will be made
    on the filesystem of that ancestor."""
    current = path.absolute()
    while not current.exists() and current.parent != current:
        current = current.parent
    return current


def choose_sync(root: str | os.PathLike[str], *, syncfs_allowed: bool) -> SyncChoice:
    """The sync for a capture directory: ``syncfs`` only on a filesystem known to be local and when the
    settings allow it (``OTEL_CAPTURE_SYNC=fsync`` does not); one ``fsync`` per file everywhere else."""
    where = existing_ancestor(Path(root))
    mount = mount_of(where)
    name = mount[1] if mount else None
    try:
        magic = statfs_type(where)
    except OSError as exc:
        return SyncChoice(
            "fsync",
            f"the filesystem type could not be read ({exc}): fsync per file is durable everywhere",
            None,
            name,
        )
    shared = magic in SHARED_FILESYSTEMS or (name or "").startswith("fuse")
    if not syncfs_allowed:
        why = "OTEL_CAPTURE_SYNC=fsync (or sync='fsync') asks for it"
        return SyncChoice("fsync", why, magic, name, shared)
    if magic is None:
        return SyncChoice("fsync", "statfs is not available here", None, name, shared)
    label = name or LOCAL_FILESYSTEMS.get(magic) or SHARED_FILESYSTEMS.get(magic) or "unknown"
    shown = f"{label}, f_type 0x{magic:X}"
    if magic in LOCAL_FILESYSTEMS and not (name or "").startswith("fuse"):
        return SyncChoice("syncfs", f"{shown}: a local filesystem, whose syncfs writes its disk", magic, name)
    if shared:
        return SyncChoice(
            "fsync",
            f"{shown}: a network or FUSE filesystem, where syncfs does not reach the server",
            magic,
            name,
            shared,
        )
    return SyncChoice(
        "fsync",
        f"{shown}: not known to be local, so fsync per file, which is durable everywhere",
        magic,
        name,
    )
