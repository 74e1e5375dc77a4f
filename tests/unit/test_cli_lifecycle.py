"""``otel-capture ls``, ``retire`` and ``delete``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from otel_capture import CaptureStore
from otel_capture._cli.main import main


def _states(table: str) -> list[list[str]]:
    """The rollout and state columns of ``ls``'s table, below its header."""
    header, *rows = (line.split() for line in table.splitlines())
    assert header[:2] == ["rollout", "state"]
    return [row[:2] for row in rows]


def test_ls_retire_delete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = CaptureStore(tmp_path)
    for rid in ("a", "b", "c"):
        store.append_now(rid, "c1", {})
    store.freeze_now("b")
    assert main(["ls", str(tmp_path)]) == 0
    assert _states(capsys.readouterr().out) == [["a", "live"], ["b", "frozen"], ["c", "live"]]
    assert main(["retire", str(tmp_path), "a", "b", "never"]) == 0
    assert capsys.readouterr().out.splitlines() == ["removed\ta", "removed\tb", "absent\tnever"]
    assert main(["ls", str(tmp_path), "--state", "retired"]) == 0
    assert _states(capsys.readouterr().out) == [["a", "retired"], ["b", "retired"], ["never", "retired"]]
    assert main(["delete", str(tmp_path), "a", "never", "zzz"]) == 0
    assert capsys.readouterr().out.splitlines() == ["removed\ta", "removed\tnever", "absent\tzzz"]
    assert store.list_rollouts() == {"b": "retired", "c": "live"}


def test_errors_are_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["retire", str(tmp_path), "bad/id"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("otel-capture: error: invalid rollout id") and err.count("\n") == 1
    assert main(["ls", str(tmp_path / "missing")]) == 1
    store = CaptureStore(tmp_path)
    store.append_now("x", "c", {})
    rename = os.rename

    def refusing(src: Any, dst: Any, **dir_fds: Any) -> None:
        if os.path.basename(src) == "x.capture.jsonl":
            raise OSError(5, "Input/output error")
        rename(src, dst, **dir_fds)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "rename", refusing)
        assert main(["retire", str(tmp_path), "x"]) == 1
    assert "retire x:" in capsys.readouterr().err
    assert main(["retire", str(tmp_path), "x"]) == 0  # the same command finishes it
