"""The C library, loaded once, for the few Linux calls the store makes that the standard library has no
binding for: ``statfs`` (:mod:`.fstype`: which filesystem), ``syncfs`` and ``prctl(PR_SET_NAME)``
(:mod:`.writer`: one sync per batch, the writer thread's name). ``None`` where there is no C library to
load (the callers then do without)."""

from __future__ import annotations

import ctypes
import ctypes.util


def _load() -> ctypes.CDLL | None:
    try:  # find_library runs ldconfig in a child process: once per process, here
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


LIBC = _load()

_PR_SET_NAME = 15


def name_native_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 bytes) in the kernel too, so ``top -H``, ``ps -L``
    and ``/proc/<pid>/task/<tid>/comm`` tell it from the host server's threads (Python before 3.14 names
    only the ``threading.Thread``). Nothing where there is no ``prctl``."""
    prctl = getattr(LIBC, "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
