"""``otel-capture check DIR`` as a user runs it: a separate process, exit codes, one line per problem."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from support import FIXTURES


def _check(directory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_capture._cli.main", "check", str(directory), *extra],
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_clean_directory_passes(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "gym_server_0-0.capture.jsonl", tmp_path / "0-0.capture.jsonl")
    result = _check(tmp_path)
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines()[-1].startswith("1 rollout(s), ")
    assert "0 damaged" in result.stdout
    assert (
        result.stdout.splitlines()[0] == "ok: 1 rollout(s), 6 record(s), nothing damaged"
    )  # the answer first


def test_a_damaged_line_and_a_torn_tail_fail_with_where_they_are(tmp_path: Path) -> None:
    good = (FIXTURES / "gym_server_0-0.capture.jsonl").read_bytes()
    (tmp_path / "ok.capture.jsonl").write_bytes(good)
    first = good.split(b"\n")[0]
    (tmp_path / "bad.capture.jsonl").write_bytes(first + b"\n{not json\n" + first + b"\n")
    (tmp_path / "torn.capture.jsonl").write_bytes(first + b"\n" + first[: len(first) // 2])
    result = _check(tmp_path)
    assert result.returncode == 1
    assert "bad: line 2: damaged" in result.stdout
    assert "torn: line 2: torn tail" in result.stdout
    assert (
        f"torn: line 2: torn tail, {len(first) // 2} bytes with no newline" in result.stdout
    )  # as show says
    assert "ok:" not in result.stdout
    assert "3 rollout(s)" in result.stdout and "2 damaged" in result.stdout
    answer, *details = result.stdout.splitlines()
    assert answer.startswith(
        "NOT OK: 2 of 3 rollout(s) damaged (bad, torn): lines that are not records, a torn"
    )
    assert answer.endswith("; details below") and not answer.startswith("sync:")
    assert [line for line in details if line.startswith("sync: ")]  # the filesystem's detail comes after


def test_an_incomplete_rollout_is_reported_and_fails_only_when_strict(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "retry_0-0-a1.capture.jsonl", tmp_path / "r.capture.jsonl")
    (tmp_path / "r.capture.incomplete").write_text('{"model_call_id": "x", "reason": "OSError: ENOSPC"}\n')
    result = _check(tmp_path)
    assert result.returncode == 0
    assert "r: incomplete" in result.stdout
    assert result.stdout.startswith("ok: 1 rollout(s), ")
    assert "; but 1 rollout(s) incomplete, a call not captured (r); details below\n" in result.stdout
    strict = _check(tmp_path, "--strict")
    assert strict.returncode == 1
    assert strict.stdout.startswith("NOT OK (--strict): 1 rollout(s) incomplete, a call not captured (r)")


def test_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    result = _check(tmp_path / "nope")
    assert result.returncode == 1
    assert "is not a directory" in result.stderr
