"""Fixtures the integration tests share."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount a real tmpfs with the given options (root only: skipped elsewhere, failing under CI=true)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"{options},mode=0700", "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            reason = f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}"
            if os.environ.get("CI") == "true":
                pytest.fail(reason)
            pytest.skip(reason)
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)
