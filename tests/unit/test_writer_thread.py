"""The writer's thread is named in the kernel too, so a user reading ``top -H`` or ``ps -L`` on a model
server (vLLM's API server, where every Python thread is ``python``) sees what the capture's writer costs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from otel_capture._store.writer import JsonlWriter


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
        assert "otel-capture-wr" in _thread_names()  # "otel-capture-writer", cut to the kernel's 15 bytes
    finally:
        writer.close()
    assert "otel-capture-wr" not in _thread_names()
