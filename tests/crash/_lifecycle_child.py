"""A child process that runs one lifecycle batch and SIGKILLs itself at a chosen point.

    python _lifecycle_child.py DIR OPERATION POINT[#N] ID...

``POINT`` is a crash-hook name of ``CaptureStore`` (``journal_written``, ``retire_fenced``, ...); with
``#N`` the process dies at the N-th time that point is reached. Exit status 0 means the point was never
reached (the parent treats that as a failed test)."""

from __future__ import annotations

import os
import signal
import sys

from otel_capture import CaptureStore


def main() -> None:
    directory, operation, point, *ids = sys.argv[1:]
    name, _, nth = point.partition("#")
    remaining = int(nth or 1)

    def hook(reached: str) -> None:
        nonlocal remaining
        if reached == name:
            remaining -= 1
            if remaining == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    store = CaptureStore(directory, crash_hook=hook)
    getattr(store, operation)(ids)


if __name__ == "__main__":
    main()
