"""Where a capture directory keeps each rollout's files.

``<dir>/<rollout_id>.capture.jsonl`` holds one NeMo Gym ``ModelCallRecord`` line per call (append only,
``flock`` exclusive per append, shared per read, as NeMo Gym 0.7.0 does on the same files);
``<dir>/<rollout_id>.capture.incomplete`` exists when a call of that rollout could not be captured. NeMo Gym
only checks that the marker exists; we append one JSON line per failed call to it, saying which and why.
"""

from __future__ import annotations

import os
from pathlib import Path

from ._correlation import validate_rollout_id

CAPTURE_SUFFIX = ".capture.jsonl"
INCOMPLETE_SUFFIX = ".capture.incomplete"


class CaptureStore:
    """A capture directory. Creating the object never touches the filesystem; writers create the directory."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"CaptureStore({str(self.root)!r})"

    def data_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + CAPTURE_SUFFIX)

    def incomplete_path(self, rollout_id: str) -> Path:
        return self.root / (validate_rollout_id(rollout_id) + INCOMPLETE_SUFFIX)

    def is_incomplete(self, rollout_id: str) -> bool:
        return self.incomplete_path(rollout_id).exists()

    def rollout_ids(self) -> list[str]:
        """Every rollout with a data file or an incomplete marker, sorted."""
        if not self.root.is_dir():
            return []
        ids = set()
        for name in os.listdir(self.root):
            for suffix in (CAPTURE_SUFFIX, INCOMPLETE_SUFFIX):
                if name.endswith(suffix):
                    ids.add(name[: -len(suffix)])
        return sorted(ids)
