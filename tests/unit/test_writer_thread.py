"""The writer's thread is named in the kernel too, so a user reading ``top -H`` or ``ps -L`` on a model
server (vLLM's API server, where every Python thread is ``python``) sees what the capture's writer costs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from otel_capture._store import JsonlWriter
from otel_capture._store.writer import WRITER_THREAD, WRITER_THREAD_KERNEL_NAME


def _thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc: Linux")
def test_the_writer_thread_has_its_name_in_the_kernel(tmp_path: Path) -> None:
    writer = JsonlWriter(tmp_path / "calls")
    try:
        assert writer.flush(10)  # the thread has run its first loop
        assert (
            WRITER_THREAD_KERNEL_NAME == "otel-capture-wr" == WRITER_THREAD[:15]
        )  # the kernel keeps 15 bytes
        assert WRITER_THREAD_KERNEL_NAME in _thread_names()
    finally:
        writer.close()
    assert WRITER_THREAD_KERNEL_NAME not in _thread_names()
